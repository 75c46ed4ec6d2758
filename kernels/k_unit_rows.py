"""Triton kernels of rows scaled to unit length, y = x / max(|x|, eps) along the last dim, and of its backward:
LSH's shared-QK keys (models/attention/projections.py `unit_rows`), one launch each way where PyTorch takes three
forward and six backward.

Rows are x's [B, H, T] positions, read through their strides (a layer's head-split projection is token-major),
E features each, contiguous. The forward rounds as `F.normalize` in x's dtype does: the norm, accumulated in fp32,
rounded to x's dtype and clamped at eps there, then x / that norm computed in fp32 and rounded once (to nearest,
even on ties, on the bits: `_round_to_input`, which the interpreter's truncating cast needs). It keeps the
rounded norm (fp32 [B, H, T]) for the backward, dx = (g - y (y . g)) / d, the projection onto the row's tangent,
or g / d where the norm was clamped (it then passes no gradient), computed in fp32 and rounded once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.k_lsh_hash import _round_to_input
from kernels.k_merge_rounds import _tile, launch_config  # noqa: F401 (rows of features, as the merge's)


@triton.jit
def _offsets(r, e, n_heads, n_tokens, stride_b, stride_h, stride_t):
    """[rows, features] offsets of rows r under strides (b, h, t), the features contiguous."""
    t = r % n_tokens
    bh = r // n_tokens
    row = (bh // n_heads) * stride_b + (bh % n_heads) * stride_h + t.to(tl.int64) * stride_t
    return row[:, None] + e[None, :]


@triton.jit
def _clamp_bound(eps, dtype: tl.constexpr, BLOCK_M: tl.constexpr):
    """eps in `dtype`, as fp32 [BLOCK_M]: the value the norm is clamped at."""
    return _round_to_input(tl.zeros([BLOCK_M], tl.float32) + eps, dtype)


@triton.jit
def _unit_rows_fwd(
    X, Y, D,
    stride_xb, stride_xh, stride_xt, stride_yb, stride_yh, stride_yt,
    n_rows, n_heads, n_tokens, n_feat, eps,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Y = X / max(|X|, eps) rowwise in X's dtype; D [rows] fp32: the norm as rounded and clamped."""
    r, e, _, row_ok, live = _tile(n_rows, n_feat, BLOCK_M, BLOCK_E)
    dtype = X.dtype.element_ty
    x = tl.load(X + _offsets(r, e, n_heads, n_tokens, stride_xb, stride_xh, stride_xt), mask=live,
                other=0.0).to(tl.float32)
    norm = _round_to_input(tl.sqrt(tl.sum(x * x, axis=1)), dtype)  # vector_norm's, in x's dtype
    d = tl.maximum(norm, _clamp_bound(eps, dtype, BLOCK_M))
    y = _round_to_input(x / d[:, None], dtype).to(dtype)
    tl.store(Y + _offsets(r, e, n_heads, n_tokens, stride_yb, stride_yh, stride_yt), y, mask=live)
    tl.store(D + r, d, mask=row_ok)


@triton.jit
def _unit_rows_bwd(
    G, Y, D, DX,
    stride_gb, stride_gh, stride_gt, stride_yb, stride_yh, stride_yt, stride_db, stride_dh, stride_dt,
    n_rows, n_heads, n_tokens, n_feat, eps,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """DX = (G - Y (Y . G)) / D rowwise, or G / D where the norm was clamped to eps (D == eps)."""
    r, e, _, row_ok, live = _tile(n_rows, n_feat, BLOCK_M, BLOCK_E)
    g = tl.load(G + _offsets(r, e, n_heads, n_tokens, stride_gb, stride_gh, stride_gt), mask=live,
                other=0.0).to(tl.float32)
    y = tl.load(Y + _offsets(r, e, n_heads, n_tokens, stride_yb, stride_yh, stride_yt), mask=live,
                other=0.0).to(tl.float32)
    d = tl.load(D + r, mask=row_ok, other=1.0)
    along = tl.where(d == _clamp_bound(eps, Y.dtype.element_ty, BLOCK_M), 0.0, tl.sum(g * y, axis=1))
    dx = _round_to_input((g - y * along[:, None]) / d[:, None], DX.dtype.element_ty).to(DX.dtype.element_ty)
    tl.store(DX + _offsets(r, e, n_heads, n_tokens, stride_db, stride_dh, stride_dt), dx, mask=live)
