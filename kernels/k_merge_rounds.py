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
and the whole feature axis (BLOCK_E, a power of two >= E). Contiguous: out [P, R, M, E], lse and weights [P, R, M]
and the merged lse [P, M]. The merged out and its gradient [P, M, E] take strides: slice p = p_outer * n_inner +
p_inner sits at p_outer * stride_po + p_inner * stride_pi, row m at m * stride_pm, so that LSH's merged heads
[B, H, T, E] can live in the layer's [B, T, H, E] layout (P = B * H, n_inner = H) and the output projection reads
them, and writes their gradient, without a copy.
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
def _tile(n_rows, n_feat, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's rows (axis 0: BLOCK_M of them) and slice (axis 1), the feature columns and both masks."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < n_rows
    return rows, cols, tl.program_id(1).to(tl.int64), row_ok, row_ok[:, None] & (cols < n_feat)[None, :]


@triton.jit
def _strided_rows(p, rows, n_inner, stride_po, stride_pi, stride_pm):
    """Offsets of slice p's rows in a strided [P, M, E] tensor whose P is (outer, inner) with n_inner inner slices."""
    return (p // n_inner) * stride_po + (p % n_inner) * stride_pi + rows.to(tl.int64) * stride_pm


@triton.jit
def _below_rows(p, rows, n_slices, n_rows):
    """Axis 2 of a causal level's program: 0 the first halves, 1 the second. Its rows in out_a [2B, H, h, ..], in
    out_b [B, H, h, ..] and in the joined out [B, H, 2h, ..] (`n_slices` = B * H, `n_rows` = h)."""
    second = tl.program_id(2)
    return second, (p + second * n_slices) * n_rows + rows, p * n_rows + rows, (p * 2 + second) * n_rows + rows


@triton.jit
def _normaliser(m, total):
    """(the weights' divisor, the merged lse) of rows whose parts' e^(lse - m) sum to `total`: a row no part has
    keys for (total 0) divides by 1, so its weights are 0, and gets lse -inf."""
    has_keys = total > 0
    safe = tl.where(has_keys, total, 1.0)
    return safe, tl.where(has_keys, m + tl.log(safe), float("-inf"))


@triton.jit
def _row_max(LSE, base, rows, row_ok, n_rows, R: tl.constexpr):
    """The largest lse over the parts, 0 where every part's is -inf (as `_round_weights`)."""
    m = tl.full(rows.shape, float("-inf"), tl.float32)
    for r in tl.static_range(R):
        m = tl.maximum(m, tl.load(LSE + base + r * n_rows + rows, mask=row_ok, other=float("-inf")).to(tl.float32))
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _merge_rounds_fwd(OUT, LSE, MERGED, LSE_OUT, WEIGHT, n_rows, n_feat, n_inner, stride_po, stride_pi, stride_pm,
                      R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    rows, cols, p, row_ok, tile_ok = _tile(n_rows, n_feat, BLOCK_M, BLOCK_E)
    base = p * R * n_rows  # the (p, r = 0) rows of lse and the weights
    m = _row_max(LSE, base, rows, row_ok, n_rows, R)
    total = tl.zeros([BLOCK_M], tl.float32)
    for r in tl.static_range(R):
        lse_r = tl.load(LSE + base + r * n_rows + rows, mask=row_ok, other=float("-inf")).to(tl.float32)
        total += tl.exp(lse_r - m)
    safe, lse = _normaliser(m, total)
    tl.store(LSE_OUT + p * n_rows + rows, lse, mask=row_ok)
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for r in tl.static_range(R):
        lse_r = tl.load(LSE + base + r * n_rows + rows, mask=row_ok, other=float("-inf")).to(tl.float32)
        w = tl.exp(lse_r - m) / safe
        tl.store(WEIGHT + base + r * n_rows + rows, w, mask=row_ok)
        part = tl.load(OUT + (base + r * n_rows + rows[:, None]) * n_feat + cols[None, :], mask=tile_ok, other=0.0)
        acc += part.to(tl.float32) * w[:, None]
    merged_rows = _strided_rows(p, rows, n_inner, stride_po, stride_pi, stride_pm)
    tl.store(MERGED + merged_rows[:, None] + cols[None, :], acc.to(MERGED.dtype.element_ty), mask=tile_ok)


@triton.jit
def _merge_rounds_bwd(G_OUT, G_LSE, OUT, WEIGHT, G_OUT_R, G_LSE_R, n_rows, n_feat, n_inner, stride_po, stride_pi,
                      stride_pm, HAS_G_LSE: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_E: tl.constexpr):
    rows, cols, p, row_ok, tile_ok = _tile(n_rows, n_feat, BLOCK_M, BLOCK_E)
    base = p * R * n_rows
    g_rows = _strided_rows(p, rows, n_inner, stride_po, stride_pi, stride_pm)
    g = tl.load(G_OUT + g_rows[:, None] + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32)
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


@triton.jit
def _merge_below_fwd(OUT_A, LSE_A, OUT_B, LSE_B, OUT, LSE_OUT, ALPHA, BETA, n_slices, n_rows, n_feat,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """HyperAttention's causal level (models/attention/lse.py `merge_lse_below`): out_a [2B, H, h, E] holds the
    diagonal halves (rows :B the first, B: the second), out_b [B, H, h, E] the off-diagonal block. The joined out
    [B, H, 2h, E]: its first h rows are the first halves (program axis 2 = 0: a copy), its last h the second halves
    merged with out_b (axis 2 = 1). `n_slices` = B * H, `n_rows` = h."""
    rows, cols, p, row_ok, tile_ok = _tile(n_rows, n_feat, BLOCK_M, BLOCK_E)
    second, a_rows, b_rows, out_rows = _below_rows(p, rows, n_slices, n_rows)
    lse_a = tl.load(LSE_A + a_rows, mask=row_ok, other=float("-inf")).to(tl.float32)
    part_a = tl.load(OUT_A + a_rows[:, None] * n_feat + cols[None, :], mask=tile_ok, other=0.0)
    if second == 0:
        tl.store(OUT + out_rows[:, None] * n_feat + cols[None, :], part_a, mask=tile_ok)
        tl.store(LSE_OUT + out_rows, lse_a, mask=row_ok)
    else:
        lse_b = tl.load(LSE_B + b_rows, mask=row_ok, other=float("-inf")).to(tl.float32)
        m = tl.maximum(lse_a, lse_b)
        m = tl.where(m == float("-inf"), 0.0, m)
        w_a, w_b = tl.exp(lse_a - m), tl.exp(lse_b - m)
        safe, lse = _normaliser(m, w_a + w_b)
        alpha, beta = w_a / safe, w_b / safe
        tl.store(ALPHA + b_rows, alpha, mask=row_ok)
        tl.store(BETA + b_rows, beta, mask=row_ok)
        tl.store(LSE_OUT + out_rows, lse, mask=row_ok)
        part_b = tl.load(OUT_B + b_rows[:, None] * n_feat + cols[None, :], mask=tile_ok, other=0.0)
        merged = part_a.to(tl.float32) * alpha[:, None] + part_b.to(tl.float32) * beta[:, None]
        tl.store(OUT + out_rows[:, None] * n_feat + cols[None, :], merged.to(OUT.dtype.element_ty), mask=tile_ok)


@triton.jit
def _merge_below_bwd(G_OUT, G_LSE, OUT_A, OUT_B, ALPHA, BETA, G_OUT_A, G_LSE_A, G_OUT_B, G_LSE_B,
                     n_slices, n_rows, n_feat, HAS_G_LSE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_E: tl.constexpr):
    """The backward of `_merge_below_fwd`: the first halves take the joined gradient's first h rows as they are;
    the second halves and out_b the closed form of `_MergeLseMany` with two parts."""
    rows, cols, p, row_ok, tile_ok = _tile(n_rows, n_feat, BLOCK_M, BLOCK_E)
    second, a_rows, b_rows, out_rows = _below_rows(p, rows, n_slices, n_rows)
    g = tl.load(G_OUT + out_rows[:, None] * n_feat + cols[None, :], mask=tile_ok, other=0.0)
    g_lse = tl.zeros([BLOCK_M], tl.float32)
    if HAS_G_LSE:
        g_lse = tl.load(G_LSE + out_rows, mask=row_ok, other=0.0).to(tl.float32)
    if second == 0:
        tl.store(G_OUT_A + a_rows[:, None] * n_feat + cols[None, :], g.to(G_OUT_A.dtype.element_ty), mask=tile_ok)
        tl.store(G_LSE_A + a_rows, g_lse, mask=row_ok)
    else:
        alpha = tl.load(ALPHA + b_rows, mask=row_ok, other=0.0)
        beta = tl.load(BETA + b_rows, mask=row_ok, other=0.0)
        g32 = g.to(tl.float32)
        part_a = tl.load(OUT_A + a_rows[:, None] * n_feat + cols[None, :], mask=tile_ok, other=0.0)
        part_b = tl.load(OUT_B + b_rows[:, None] * n_feat + cols[None, :], mask=tile_ok, other=0.0)
        g_alpha = tl.sum(g32 * part_a.to(tl.float32), 1)
        g_beta = tl.sum(g32 * part_b.to(tl.float32), 1)
        shared = alpha * g_alpha + beta * g_beta
        tl.store(G_LSE_A + a_rows, alpha * (g_alpha + g_lse - shared), mask=row_ok)
        tl.store(G_LSE_B + b_rows, beta * (g_beta + g_lse - shared), mask=row_ok)
        tl.store(G_OUT_A + a_rows[:, None] * n_feat + cols[None, :], (g32 * alpha[:, None]).to(G_OUT_A.dtype.element_ty),
                 mask=tile_ok)
        tl.store(G_OUT_B + b_rows[:, None] * n_feat + cols[None, :], (g32 * beta[:, None]).to(G_OUT_B.dtype.element_ty),
                 mask=tile_ok)
