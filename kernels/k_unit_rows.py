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


def launch_config(interpret: bool) -> dict[str, int]:
    """64 rows a program on a GPU (an fp32 tile of 64 x E), the interpreter's 16."""
    if interpret:
        return {"BLOCK_R": 16, "num_warps": 1}
    return {"BLOCK_R": 64, "num_warps": 4}


@triton.jit
def _row_offsets(r, n_heads, n_tokens, stride_b, stride_h, stride_t):
    """Offsets of rows r (their (b, h, t) in [B, H, T] order) under strides (b, h, t)."""
    t = r % n_tokens
    bh = r // n_tokens
    return (bh // n_heads) * stride_b + (bh % n_heads) * stride_h + t.to(tl.int64) * stride_t


@triton.jit
def _unit_rows_fwd(
    X, Y, D,
    stride_xb, stride_xh, stride_xt, stride_yb, stride_yh, stride_yt,
    n_rows, n_heads, n_tokens, n_feat, eps,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Y = X / max(|X|, eps) rowwise in X's dtype; D [rows] fp32: the norm as rounded and clamped."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    e = tl.arange(0, BLOCK_E)
    live = (r < n_rows)[:, None] & (e < n_feat)[None, :]
    x_raw = tl.load(X + _row_offsets(r, n_heads, n_tokens, stride_xb, stride_xh, stride_xt)[:, None] + e[None, :],
                    mask=live, other=0.0)
    x = x_raw.to(tl.float32)
    norm = _round_to_input(tl.sqrt(tl.sum(x * x, axis=1)), X.dtype.element_ty)  # vector_norm's, in x's dtype
    d = tl.maximum(norm, _round_to_input(tl.zeros([BLOCK_R], tl.float32) + eps, X.dtype.element_ty))
    y = _round_to_input(x / d[:, None], X.dtype.element_ty).to(X.dtype.element_ty)
    tl.store(Y + _row_offsets(r, n_heads, n_tokens, stride_yb, stride_yh, stride_yt)[:, None] + e[None, :], y,
             mask=live)
    tl.store(D + r, d, mask=r < n_rows)


@triton.jit
def _unit_rows_bwd(
    G, Y, D, DX,
    stride_gb, stride_gh, stride_gt, stride_yb, stride_yh, stride_yt, stride_db, stride_dh, stride_dt,
    n_rows, n_heads, n_tokens, n_feat, eps,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """DX = (G - Y (Y . G)) / D rowwise, or G / D where the norm was clamped to eps (D == eps)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    e = tl.arange(0, BLOCK_E)
    live = (r < n_rows)[:, None] & (e < n_feat)[None, :]
    g_raw = tl.load(G + _row_offsets(r, n_heads, n_tokens, stride_gb, stride_gh, stride_gt)[:, None] + e[None, :],
                    mask=live, other=0.0)
    g = g_raw.to(tl.float32)
    y = tl.load(Y + _row_offsets(r, n_heads, n_tokens, stride_yb, stride_yh, stride_yt)[:, None] + e[None, :],
                mask=live, other=0.0).to(tl.float32)
    d = tl.load(D + r, mask=r < n_rows, other=1.0)
    eps_d = _round_to_input(tl.zeros([BLOCK_R], tl.float32) + eps, Y.dtype.element_ty)  # as the forward clamped
    along = tl.where(d == eps_d, 0.0, tl.sum(g * y, axis=1))
    dx = _round_to_input((g - y * along[:, None]) / d[:, None], DX.dtype.element_ty).to(DX.dtype.element_ty)
    tl.store(DX + _row_offsets(r, n_heads, n_tokens, stride_db, stride_dh, stride_dt)[:, None] + e[None, :], dx,
             mask=live)
