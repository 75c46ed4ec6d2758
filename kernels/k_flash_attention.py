"""Triton kernels of exact attention, FlashAttention-2 style (Dao, 2023, "FlashAttention-2: Faster Attention
with Better Parallelism and Work Partitioning", arXiv 2307.08691), after the Triton fused-attention tutorial.

Layout [batch, heads, seq, head_dim] addressed through strides (no contiguity required). Every load is
masked, so sequence lengths need not be block multiples, and the head-dim block is the next power of two
above head_dim with the extra columns loaded as zeros (they add nothing to q.k or to p.v).

Forward: one program per (query block, batch*head); keys are streamed with the online softmax in base 2
(exp2 is a single instruction; logits are pre-multiplied by log2(e)). It stores out and the natural-log lse.
Backward: two kernels without atomics, as in FA2 and the tutorial: one program per key block accumulates
dK, dV over query blocks; one program per query block accumulates dQ over key blocks. Both recompute
P = exp(S - lse) and use dS = P * (dP - delta) where delta_i = rowsum(dO_i * O_i) - dlse_i carries the
gradient of lse (see docs/kernels.md).

Launch configurations live here, next to the kernels; the interpreter gets the smallest legal blocks.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


def launch_config(block_d: int, elem_bytes: int, interpret: bool, backward: bool) -> dict[str, int]:
    """Block sizes, warps and pipeline stages. Hand-picked rather than autotuned so that a run is
    deterministic and the interpreter is not made to try every configuration."""
    if interpret:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    num_warps = 4 if block_d <= 64 else 8
    # fp32 tiles take twice the shared memory of fp16/bf16 ones: halve the blocks so that head dim 128 stays
    # within an A100's 163 KB per block.
    shrink = 2 if elem_bytes >= 4 else 1
    if backward:
        # dK/dV and dQ accumulators plus q, k, v, dO tiles live in registers: smaller tiles than forward.
        return {"BLOCK_M": 64 // shrink, "BLOCK_N": 64 // shrink, "num_warps": num_warps, "num_stages": 2}
    stages = 3 if block_d <= 64 else 2
    return {"BLOCK_M": 128 // shrink, "BLOCK_N": 64 // shrink, "num_warps": num_warps, "num_stages": stages}


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """tl.dot with an fp32 accumulator. DOT_UPCAST computes it on fp32 copies of the operands: the Triton
    interpreter multiplies bf16 tiles as their raw uint16 bits, and bf16 values are exact in fp32, so the
    upcast gives what a bf16 MMA with fp32 accumulation gives."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_tile(ptr, rows, cols, stride_row, stride_col, n_rows, n_cols):
    """Masked [len(rows), len(cols)] load; out-of-range rows (sequence tail) and columns (head-dim padding)
    read as zero."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0.0)


@triton.jit
def _store_tile(ptr, x, rows, cols, stride_row, stride_col, n_rows, n_cols):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _valid_logits(rows, cols, n_q, n_k, kpm_ptr, stride_kpm_n, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: which (query, key) pairs take part. Causal is aligned top-left (key j <= query
    i, whatever n_q and n_k are)."""
    key_ok = cols < n_k
    if HAS_KPM:
        padded = tl.load(kpm_ptr + cols * stride_kpm_n, mask=key_ok, other=1)
        key_ok = key_ok & (padded == 0)
    valid = (rows[:, None] < n_q) & key_ok[None, :]
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None])
    return valid


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One key block of the FA2 forward loop (Algorithm 1) on masked base-2 logits s [BLOCK_M, BLOCK_N]:
    rescale the running max m_i, sum l_i and output accumulator."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # While a row has seen only masked keys its max is -inf; subtracting 0 instead avoids -inf - -inf = NaN
    # and still gives p = 0 and alpha = 0 for it.
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
def _masked_logits(q, k, valid, qk_scale, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Base-2 logits S * log2(e), -inf where masked."""
    s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _load_row_stats(lse_ptr, delta_ptr, rows, n_q):
    """lse in base 2 (with -inf of empty rows replaced by 0, whose P is all-zero anyway) and delta."""
    in_range = rows < n_q
    lse2 = tl.load(lse_ptr + rows, mask=in_range, other=0.0) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(delta_ptr + rows, mask=in_range, other=0.0)
    return lse2, delta


@triton.jit
def _flash_fwd(
    Q, K, V, Out, Lse, Kpm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_kpm_b, stride_kpm_n,
    n_heads, n_q, n_k, head_dim, qk_scale,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # int64 base offsets: batch*heads*seq*head_dim passes 2**31 at long sequences.
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptr = Q + b * stride_qb + h * stride_qh
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    kpm_ptr = Kpm + b * stride_kpm_b

    q = _load_tile(q_ptr, rows, offs_d, stride_qm, stride_qd, n_q, head_dim)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = n_k
    if CAUSAL:
        # Keys past the block's last query are all masked: skip them (half the work when n_q == n_k).
        hi = tl.minimum(n_k, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptr, cols, offs_d, stride_kn, stride_kd, n_k, head_dim)
        v = _load_tile(v_ptr, cols, offs_d, stride_vn, stride_vd, n_k, head_dim)
        valid = _valid_logits(rows, cols, n_q, n_k, kpm_ptr, stride_kpm_n, CAUSAL, HAS_KPM)
        s = _masked_logits(q, k, valid, qk_scale, DOT_PRECISION, DOT_UPCAST)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION, DOT_UPCAST)

    out, lse = _finish_softmax(m_i, l_i, acc)
    _store_tile(Out + b * stride_ob + h * stride_oh, out, rows, offs_d, stride_om, stride_od, n_q, head_dim)
    tl.store(Lse + pid_bh.to(tl.int64) * n_q + rows, lse, mask=rows < n_q)


@triton.jit
def _flash_bwd_dkdv(
    Q, K, V, DO, Lse, Delta, DK, DV, Kpm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_kpm_b, stride_kpm_n,
    n_heads, n_q, n_k, head_dim, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dV = P^T dO and dK = scale * dS^T Q for one key block; DK and DV share one set of strides."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptr = Q + b * stride_qb + h * stride_qh
    do_ptr = DO + b * stride_dob + h * stride_doh
    lse_ptr = Lse + pid_bh.to(tl.int64) * n_q
    delta_ptr = Delta + pid_bh.to(tl.int64) * n_q
    kpm_ptr = Kpm + b * stride_kpm_b

    k = _load_tile(K + b * stride_kb + h * stride_kh, cols, offs_d, stride_kn, stride_kd, n_k, head_dim)
    v = _load_tile(V + b * stride_vb + h * stride_vh, cols, offs_d, stride_vn, stride_vd, n_k, head_dim)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:
        # Queries before this key block cannot see it.
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(lo, n_q, BLOCK_M):
        rows = start_m + offs_m
        q = _load_tile(q_ptr, rows, offs_d, stride_qm, stride_qd, n_q, head_dim)
        do = _load_tile(do_ptr, rows, offs_d, stride_dom, stride_dod, n_q, head_dim)
        lse2, delta = _load_row_stats(lse_ptr, delta_ptr, rows, n_q)
        valid = _valid_logits(rows, cols, n_q, n_k, kpm_ptr, stride_kpm_n, CAUSAL, HAS_KPM)
        # P recomputed from the saved lse (FA2 Algorithm 2); masked logits are -inf, so P is 0 there.
        p = tl.exp2(_masked_logits(q, k, valid, qk_scale, DOT_PRECISION, DOT_UPCAST) - lse2[:, None])
        dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION, DOT_UPCAST)
        dp = _dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION, DOT_UPCAST)

    dk_ptr = DK + b * stride_dkb + h * stride_dkh
    dv_ptr = DV + b * stride_dkb + h * stride_dkh
    _store_tile(dk_ptr, dk * sm_scale, cols, offs_d, stride_dkn, stride_dkd, n_k, head_dim)
    _store_tile(dv_ptr, dv, cols, offs_d, stride_dkn, stride_dkd, n_k, head_dim)


@triton.jit
def _flash_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ, Kpm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_kpm_b, stride_kpm_n,
    n_heads, n_q, n_k, head_dim, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dQ = scale * dS K for one query block."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    kpm_ptr = Kpm + b * stride_kpm_b

    q = _load_tile(Q + b * stride_qb + h * stride_qh, rows, offs_d, stride_qm, stride_qd, n_q, head_dim)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, rows, offs_d, stride_dom, stride_dod, n_q, head_dim)
    lse2, delta = _load_row_stats(Lse + pid_bh.to(tl.int64) * n_q, Delta + pid_bh.to(tl.int64) * n_q, rows, n_q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = n_k
    if CAUSAL:
        hi = tl.minimum(n_k, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptr, cols, offs_d, stride_kn, stride_kd, n_k, head_dim)
        v = _load_tile(v_ptr, cols, offs_d, stride_vn, stride_vd, n_k, head_dim)
        valid = _valid_logits(rows, cols, n_q, n_k, kpm_ptr, stride_kpm_n, CAUSAL, HAS_KPM)
        # P recomputed from the saved lse (FA2 Algorithm 2); masked logits are -inf, so P is 0 there.
        p = tl.exp2(_masked_logits(q, k, valid, qk_scale, DOT_PRECISION, DOT_UPCAST) - lse2[:, None])
        dp = _dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_PRECISION, DOT_UPCAST)

    dq_ptr = DQ + b * stride_dqb + h * stride_dqh
    _store_tile(dq_ptr, dq * sm_scale, rows, offs_d, stride_dqm, stride_dqd, n_q, head_dim)
