"""The @triton.jit building blocks of the exact-attention kernels and of the chunked ones
(k_chunked_attention.py): tile loads and stores, the online softmax, row statistics, and the loop boundaries
that split each loop into mask-free blocks and masked ones (the causal band, the sequence tail). The design
is in k_flash_attention.py."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# ---- tiles and the online softmax (shared with k_chunked_attention.py) ------------------------------------


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """tl.dot with an fp32 accumulator. DOT_UPCAST computes it on fp32 copies of the operands: the Triton
    interpreter multiplies bf16 tiles as their raw uint16 bits, and bf16 values are exact in fp32, so the
    upcast gives what a bf16 MMA with fp32 accumulation gives."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_tile(
    ptr, rows, cols, stride_row, stride_col, n_rows, n_cols,
    ROWS_IN_BOUNDS: tl.constexpr = False, COLS_IN_BOUNDS: tl.constexpr = False,
):  # fmt: skip
    """[len(rows), len(cols)] load; out-of-range rows (sequence tail) and columns (head-dim padding) read as
    zero. A side declared in bounds is not masked."""
    offsets = rows[:, None] * stride_row + cols[None, :] * stride_col
    if ROWS_IN_BOUNDS and COLS_IN_BOUNDS:
        return tl.load(ptr + offsets)
    if ROWS_IN_BOUNDS:
        return tl.load(ptr + offsets, mask=cols[None, :] < n_cols, other=0.0)
    if COLS_IN_BOUNDS:
        return tl.load(ptr + offsets, mask=rows[:, None] < n_rows, other=0.0)
    return tl.load(ptr + offsets, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def _store_tile(
    ptr, x, rows, cols, stride_row, stride_col, n_rows, n_cols,
    ROWS_IN_BOUNDS: tl.constexpr = False, COLS_IN_BOUNDS: tl.constexpr = False,
):  # fmt: skip
    offsets = rows[:, None] * stride_row + cols[None, :] * stride_col
    x = x.to(ptr.dtype.element_ty)
    if ROWS_IN_BOUNDS and COLS_IN_BOUNDS:
        tl.store(ptr + offsets, x)
    elif ROWS_IN_BOUNDS:
        tl.store(ptr + offsets, x, mask=cols[None, :] < n_cols)
    elif COLS_IN_BOUNDS:
        tl.store(ptr + offsets, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptr + offsets, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def _online_softmax_step(
    s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, MAY_BE_EMPTY: tl.constexpr = True
):
    """One key block of the FA2 forward loop (Algorithm 1) on masked base-2 logits s [BLOCK_M, BLOCK_N]:
    rescale the running max m_i, sum l_i and output accumulator. MAY_BE_EMPTY=False promises every row has
    a finite logit by now (so its max is finite)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if MAY_BE_EMPTY:
        # While a row has seen only masked keys its max is -inf; subtracting 0 instead avoids
        # -inf - -inf = NaN and still gives p = 0 and alpha = 0 for it.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return m_new, l_i, acc


@triton.jit
def _finish_softmax(m_i, l_i, acc):
    """Normalise the accumulator; rows without any valid key give zeros and lse = -inf (in natural log)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    return out, lse


@triton.jit
def _stat_row(b, h, n_heads, stat_pieces):
    """The row of lse and delta (contiguous rows of n_q) that batch row b, head h reads or writes: b * H + h, or
    where the batch rows are `stat_pieces` consecutive pieces of longer sequences (HyperAttention's causal pieces,
    kernels/hyper_levels.py), the piece's part of its sequence's [B / P, H, P * n_q] row, so that the statistics
    of the pieces are those of the whole sequences with no copy between the layouts."""
    return ((b // stat_pieces) * n_heads + h) * stat_pieces + b % stat_pieces


@triton.jit
def _load_row_stats(lse_ptr, delta_ptr, rows, n_q, ROWS_IN_BOUNDS: tl.constexpr = False):
    """lse in base 2 (with -inf of empty rows replaced by 0, whose P is all-zero anyway) and delta."""
    if ROWS_IN_BOUNDS:
        lse2 = tl.load(lse_ptr + rows) * LOG2E
        delta = tl.load(delta_ptr + rows)
    else:
        lse2 = tl.load(lse_ptr + rows, mask=rows < n_q, other=0.0) * LOG2E
        delta = tl.load(delta_ptr + rows, mask=rows < n_q, other=0.0)
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    return lse2, delta


# ---- loop boundaries -----------------------------------------------------------------------------------


@triton.jit
def _key_split(
    start_m, n_k, CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Key loop of the query block [start_m, start_m + BLOCK_M) (forward and dQ): blocks starting in
    [0, full_hi) are seen whole by every query of the block and end inside n_k, so they need no mask;
    [full_hi, hi) holds the rest of the keys any of the queries sees (the causal band, the key tail)."""
    full_hi = n_k // BLOCK_N * BLOCK_N
    if EVEN_N:
        full_hi = n_k
    hi = n_k
    if CAUSAL:
        # Key block [j, j + BLOCK_N) is seen whole by the block's first query iff j + BLOCK_N - 1 <= start_m,
        # i.e. the first (start_m + 1) // BLOCK_N key blocks; no query sees a key >= start_m + BLOCK_M.
        full_hi = tl.minimum(full_hi, (start_m + 1) // BLOCK_N * BLOCK_N)
        hi = tl.minimum(n_k, start_m + BLOCK_M)
    return full_hi, hi


@triton.jit
def _query_split(
    start_n, n_q, CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Query loop of the key block [start_n, start_n + BLOCK_N) (dK/dV), in three ranges of block starts:
    [band_lo, band_hi) the causal band, where some queries see only part of the keys (masked);
    [band_hi, full_hi) queries that see every key of the block, inside n_q (no mask);
    [max(band_hi, full_hi), n_q) the query tail (bounds-masked loads)."""
    full_hi = n_q // BLOCK_M * BLOCK_M
    if EVEN_M:
        full_hi = n_q
    band_lo = 0
    band_hi = 0
    if CAUSAL:
        # The first query block holding a query >= start_n, and the first whose first query sees the
        # block's last key (start_n + BLOCK_N - 1).
        band_lo = start_n // BLOCK_M * BLOCK_M
        band_hi = tl.minimum(n_q, (start_n + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    return band_lo, band_hi, full_hi


@triton.jit
def _mask_logits(
    s, rows, cols, n_k, kpm_ptr, stride_kpm_n,
    CAUSAL_MASK: tl.constexpr, KEYS_IN_BOUNDS: tl.constexpr, HAS_KPM: tl.constexpr,
):  # fmt: skip
    """-inf where key j is padded, past n_k, or (causal) after query i: only the masks asked for."""
    if HAS_KPM:
        if KEYS_IN_BOUNDS:
            padded = tl.load(kpm_ptr + cols * stride_kpm_n)
        else:
            padded = tl.load(kpm_ptr + cols * stride_kpm_n, mask=cols < n_k, other=1)
        s = tl.where((padded == 0)[None, :], s, float("-inf"))
    elif not KEYS_IN_BOUNDS:
        s = tl.where((cols < n_k)[None, :], s, float("-inf"))
    if CAUSAL_MASK:
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    return s


@triton.jit
def _key_block(
    q, k_ptr, v_ptr, kpm_ptr, rows, cols, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_kpm_n,
    n_k, head_dim, qk_scale,
    CAUSAL_MASK: tl.constexpr, KEYS_IN_BOUNDS: tl.constexpr, HAS_KPM: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):  # fmt: skip
    """The K and V tiles of one key block and the query block's masked base-2 logits against it: the step the
    forward and dQ loops share."""
    k = _load_tile(k_ptr, cols, offs_d, stride_kn, stride_kd, n_k, head_dim, KEYS_IN_BOUNDS, EVEN_D)
    v = _load_tile(v_ptr, cols, offs_d, stride_vn, stride_vd, n_k, head_dim, KEYS_IN_BOUNDS, EVEN_D)
    s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
    s = _mask_logits(s, rows, cols, n_k, kpm_ptr, stride_kpm_n, CAUSAL_MASK, KEYS_IN_BOUNDS, HAS_KPM)
    return k, v, s
