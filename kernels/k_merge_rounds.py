"""Triton kernels that merge attention computed in R parts over the same queries (Reformer's hash rounds) by their
log-sum-exp, forward and backward, one launch each: what models/attention/lse.py `_MergeLseMany` does in about 30
PyTorch ops (the weights' max, exp, sum, log and where; a multiply-add per part; the backward's products, sums
and stack), each a launch of its own on a GPU, where the first H200 profile found the host's time per launch
setting the LSH layer's time at 16k tokens (benchmarks/RESULTS.md, "The second H200 window").

Forward, per part r of a row: weight_r = e^(lse_r - m) / sum_s e^(lse_s - m), m the largest finite lse_r (0 when
none is: a row no part has keys for gets weights 0 and lse -inf), lse = m + log(sum_s e^(lse_s - m)), out = sum_r
weight_r out_r accumulated in fp32 in the order r = 0, 1, ... The weights are stored for the backward.

Backward (the closed form of `_MergeLseMany`): with g_r = <g_out, out_r> over the feature axis, d out_r = weight_r
g_out and d lse_r = weight_r (g_r + g_lse - sum_s weight_s g_s). The g_r go to the lse gradient's buffer first
(one program owns its rows, so the buffer is its scratch), then, after a barrier, each is read back and replaced
by its gradient.

One program takes BLOCK_M rows of one (batch x head) slice with all R parts (R is a constexpr: the loops unroll)
and the whole feature axis (BLOCK_E, a power of two >= E). Every tensor is contiguous: out [P, R, M, E], lse and
weights [P, R, M], the merged out [P, M, E] and lse [P, M].
"""

from __future__ import annotations

import triton
import triton.language as tl


def launch_config(interpret: bool) -> dict[str, int]:
    """64 rows a program (an fp32 tile of 64 x E), the interpreter 16."""
    if interpret:
        return {"BLOCK_M": 16, "num_warps": 1}
    return {"BLOCK_M": 64, "num_warps": 4}


@triton.jit
def _row_max(LSE, base, rows, row_ok, n_rows, R: tl.constexpr):
    """The largest lse over the parts, 0 where every part's is -inf (as `_round_weights`)."""
    m = tl.full(rows.shape, float("-inf"), tl.float32)
    for r in tl.static_range(R):
        m = tl.maximum(m, tl.load(LSE + base + r * n_rows + rows, mask=row_ok, other=float("-inf")).to(tl.float32))
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _merge_rounds_fwd(OUT, LSE, MERGED, LSE_OUT, WEIGHT, n_rows, n_feat,
                      R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    p = tl.program_id(1).to(tl.int64)
    row_ok = rows < n_rows
    tile_ok = row_ok[:, None] & (cols < n_feat)[None, :]
    base = p * R * n_rows  # the (p, r = 0) rows of lse and the weights
    m = _row_max(LSE, base, rows, row_ok, n_rows, R)
    total = tl.zeros([BLOCK_M], tl.float32)
    for r in tl.static_range(R):
        lse_r = tl.load(LSE + base + r * n_rows + rows, mask=row_ok, other=float("-inf")).to(tl.float32)
        total += tl.exp(lse_r - m)
    has_keys = total > 0
    safe = tl.where(has_keys, total, 1.0)
    tl.store(LSE_OUT + p * n_rows + rows, tl.where(has_keys, m + tl.log(safe), float("-inf")), mask=row_ok)
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for r in tl.static_range(R):
        lse_r = tl.load(LSE + base + r * n_rows + rows, mask=row_ok, other=float("-inf")).to(tl.float32)
        w = tl.exp(lse_r - m) / safe
        tl.store(WEIGHT + base + r * n_rows + rows, w, mask=row_ok)
        part = tl.load(OUT + (base + r * n_rows + rows[:, None]) * n_feat + cols[None, :], mask=tile_ok, other=0.0)
        acc += part.to(tl.float32) * w[:, None]
    tl.store(MERGED + (p * n_rows + rows[:, None]) * n_feat + cols[None, :], acc.to(MERGED.dtype.element_ty), mask=tile_ok)


@triton.jit
def _merge_rounds_bwd(G_OUT, G_LSE, OUT, WEIGHT, G_OUT_R, G_LSE_R, n_rows, n_feat,
                      HAS_G_LSE: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    p = tl.program_id(1).to(tl.int64)
    row_ok = rows < n_rows
    tile_ok = row_ok[:, None] & (cols < n_feat)[None, :]
    base = p * R * n_rows
    g = tl.load(G_OUT + (p * n_rows + rows[:, None]) * n_feat + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    g_lse = tl.zeros([BLOCK_M], tl.float32)
    if HAS_G_LSE:
        g_lse = tl.load(G_LSE + p * n_rows + rows, mask=row_ok, other=0.0).to(tl.float32)
    shared = tl.zeros([BLOCK_M], tl.float32)
    for r in tl.static_range(R):
        w = tl.load(WEIGHT + base + r * n_rows + rows, mask=row_ok, other=0.0)
        part = tl.load(OUT + (base + r * n_rows + rows[:, None]) * n_feat + cols[None, :], mask=tile_ok, other=0.0)
        g_r = tl.sum(g * part.to(tl.float32), 1)
        shared += w * g_r
        tl.store(G_LSE_R + base + r * n_rows + rows, g_r, mask=row_ok)  # scratch until the second loop
        tl.store(G_OUT_R + (base + r * n_rows + rows[:, None]) * n_feat + cols[None, :],
                 (g * w[:, None]).to(G_OUT_R.dtype.element_ty), mask=tile_ok)
    tl.debug_barrier()  # every thread's g_r stored before any is read back in another thread's layout
    for r in tl.static_range(R):
        w = tl.load(WEIGHT + base + r * n_rows + rows, mask=row_ok, other=0.0)
        g_r = tl.load(G_LSE_R + base + r * n_rows + rows, mask=row_ok, other=0.0)
        tl.store(G_LSE_R + base + r * n_rows + rows, w * (g_r + g_lse - shared), mask=row_ok)
