"""Triton kernel of angular LSH's hash (Reformer, Sec. 2; Kitaev et al., 2020, arXiv 2001.04451): bucket ids
argmax([xR; -xR]) without writing the projections xR.

One program hashes BLOCK_T tokens of one (batch, head, round): it loads their keys once, walks the rotation's
columns BLOCK_N at a time, and keeps per token the running first maximum of xR and the running first minimum
(the first maximum of -xR, negation being exact), as models/attention/lsh.py `angular_argmax` does on the
materialised projections. Only the ids are stored: the [B, H, R, T, n_half] projections (n_half ~ T /
bucket_size, so they grow as T^2) never reach memory.

Ties follow torch's argmax over the concatenation: inside a tile the lowest column at the extreme is taken,
across tiles a later tile replaces the running value only when strictly better, and the
positive half wins a tie with the negative half (`top >= -low`). Each product is accumulated in fp32 and rounded
to the keys' dtype before it is compared (ROUND_TO_INPUT), as a bf16 or fp16 matmul's output is rounded before
torch's max sees it; the ids can then differ from the matmul's only where the two fp32 sums, added in another
order, round to different bf16 values (tests/test_lsh_hash_kernel.py counts how often).

Columns at or past a row's own half count (HALF[b]: rows of one batch may have fewer buckets than others) are
not its buckets and win in neither half. Without HALF_PER_ROW every row's count is the rotation's width n_half
(no padding, or a fixed n_buckets), so no count tensor exists.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.k_flash_tiles import _dot


def launch_config(interpret: bool) -> dict[str, int]:
    """Tiles of 64 tokens x 64 columns (an fp32 accumulator of 16 KB per program); the interpreter gets the
    smallest tiles tl.dot takes, which it runs fastest."""
    if interpret:
        return {"BLOCK_T": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    return {"BLOCK_T": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _round_to_input(x, dtype: tl.constexpr):
    """fp32 -> `dtype` -> fp32, rounding to nearest, ties to even, as a matmul in `dtype` rounds its output. bf16
    is rounded on the bits: the interpreter's cast truncates (triton 3.9, whatever fp_downcast_rounding says),
    and compiled this is what the cast does."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _angular_hash(
    K, R, HALF, IDS,
    stride_kb, stride_kh, stride_kt, stride_ke,
    stride_rh, stride_rr, stride_re, stride_rn,
    stride_ib, stride_ih, stride_ir, stride_it,
    n_heads, n_rounds, seq_len, head_dim, n_half,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    HALF_PER_ROW: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ROUND_TO_INPUT: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_bhr = tl.program_id(1)
    r = pid_bhr % n_rounds
    bh = pid_bhr // n_rounds
    h = bh % n_heads
    b = bh // n_heads
    if HALF_PER_ROW:
        half = tl.load(HALF + b)
    else:  # every row's count is the rotation's width
        half = n_half

    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    feats = tl.arange(0, BLOCK_E)
    k_ptrs = K + b * stride_kb + h * stride_kh + rows[:, None] * stride_kt + feats[None, :] * stride_ke
    keys = tl.load(k_ptrs, mask=(rows[:, None] < seq_len) & (feats[None, :] < head_dim), other=0.0)

    top = tl.full([BLOCK_T], float("-inf"), tl.float32)
    low = tl.full([BLOCK_T], float("inf"), tl.float32)
    top_idx = tl.zeros([BLOCK_T], tl.int32)
    low_idx = tl.zeros([BLOCK_T], tl.int32)
    r_base = R + h * stride_rh + r * stride_rr
    for n0 in range(0, n_half, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        r_ptrs = r_base + feats[:, None] * stride_re + cols[None, :] * stride_rn
        rot = tl.load(r_ptrs, mask=(feats[:, None] < head_dim) & (cols[None, :] < n_half), other=0.0)
        xr = _dot(keys, rot, DOT_PRECISION, DOT_UPCAST)
        if ROUND_TO_INPUT:
            xr = _round_to_input(xr, K.dtype.element_ty)
        used = cols[None, :] < half
        hi = tl.where(used, xr, float("-inf"))
        lo = tl.where(used, xr, float("inf"))
        # The first column at the tile's extreme, spelt out: the interpreter's argmax ignores tie_break_left, so
        # a test could not tell it from the last.
        tile_top = tl.max(hi, axis=1)
        tile_top_idx = tl.min(tl.where(hi == tile_top[:, None], cols[None, :], n_half), axis=1)
        tile_low = tl.min(lo, axis=1)
        tile_low_idx = tl.min(tl.where(lo == tile_low[:, None], cols[None, :], n_half), axis=1)
        higher = tile_top > top  # strictly: an equal maximum in a later tile is not the first
        top_idx = tl.where(higher, tile_top_idx, top_idx)
        top = tl.where(higher, tile_top, top)
        lower = tile_low < low
        low_idx = tl.where(lower, tile_low_idx, low_idx)
        low = tl.where(lower, tile_low, low)

    ids = tl.where(top >= -low, top_idx, low_idx + half)
    i_ptrs = IDS + b * stride_ib + h * stride_ih + r * stride_ir + rows * stride_it
    tl.store(i_ptrs, ids.to(tl.int64), mask=rows < seq_len)
