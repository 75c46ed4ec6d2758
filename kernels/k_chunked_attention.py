"""Triton kernels of chunked attention over a sorted sequence (Reformer's LSH attention after the sort;
Kitaev et al., 2020, arXiv 2001.04451), built on the FlashAttention-2 loops of k_flash_attention.py (Dao, 2023,
arXiv 2307.08691).

Query chunk c attends to key chunks c, c-1, ..., c-(n_look-1) (modulo n_chunks when WRAP). The host passes
n_look = min(lookback, n_chunks - 1) + 1 so that no chunk is visited twice. A program owns one block of rows
inside one chunk, so a block never straddles two chunks and the last chunk may be shorter than `chunk`.
Masks come from the original token positions: causal drops keys with a later position, and SELF_MASK
replaces the logit of a key at the query's own position by SELF_LOGIT (no gradient flows through it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.k_flash_tiles import (
    _dot,
    _finish_softmax,
    _load_row_stats,
    _load_tile,
    _online_softmax_step,
    _store_tile,
)

# kernels.reference.SELF_LOGIT (-1e5) in the base-2 domain of the kernels' logits.
SELF_LOGIT2: tl.constexpr = tl.constexpr(-1e5 * 1.4426950408889634)


def launch_config(block_d: int, elem_bytes: int, chunk: int, interpret: bool) -> dict[str, int]:
    """Blocks no larger than the chunk (rounded up to a power of two, at least the 16 that tl.dot needs);
    fp32 (twice the bytes per element) gets half the tile size."""
    if interpret:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    block = min(64 if elem_bytes < 4 else 32, max(16, triton.next_power_of_2(chunk)))
    return {"BLOCK_M": block, "BLOCK_N": block, "num_warps": 4 if block_d <= 64 else 8, "num_stages": 2}


@triton.jit
def _chunk_bounds(chunk_id, chunk, seq_len):
    lo = chunk_id * chunk
    return lo, tl.minimum(lo + chunk, seq_len)


@triton.jit
def _chunked_logits(
    s, rows, cols, row_hi, col_hi, pos_ptr, pad_ptr, stride_pos_t, stride_pad_t,
    CAUSAL: tl.constexpr, SELF_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
):  # fmt: skip
    """Apply the chunk bounds, padding, causal and self masks to base-2 logits s [BLOCK_M, BLOCK_N].

    Returns the masked logits (-inf where masked) and the self-pair indicator (for the backward)."""
    col_ok = cols < col_hi
    valid = (rows[:, None] < row_hi) & col_ok[None, :]
    if HAS_KPM:
        padded = tl.load(pad_ptr + cols * stride_pad_t, mask=col_ok, other=1)
        valid = valid & (padded == 0)[None, :]
    is_self = valid & False
    if CAUSAL or SELF_MASK:
        qpos = tl.load(pos_ptr + rows * stride_pos_t, mask=rows < row_hi, other=0)
        kpos = tl.load(pos_ptr + cols * stride_pos_t, mask=col_ok, other=0)
        if CAUSAL:
            valid = valid & (kpos[None, :] <= qpos[:, None])
        if SELF_MASK:
            is_self = valid & (kpos[None, :] == qpos[:, None])
            s = tl.where(is_self, SELF_LOGIT2, s)
    return tl.where(valid, s, float("-inf")), is_self


@triton.jit
def _chunked_fwd(
    Q, K, V, Out, Lse, Pos, Pad,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_pos_b, stride_pos_h, stride_pos_t,
    stride_pad_b, stride_pad_h, stride_pad_t,
    n_heads, seq_len, head_dim, chunk, n_chunks, n_look, blocks_per_chunk, qk_scale,
    WRAP: tl.constexpr, CAUSAL: tl.constexpr, SELF_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    c = pid // blocks_per_chunk
    q_lo, q_hi = _chunk_bounds(c, chunk, seq_len)
    rows = q_lo + (pid % blocks_per_chunk) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    pos_ptr = Pos + b * stride_pos_b + h * stride_pos_h
    pad_ptr = Pad + b * stride_pad_b + h * stride_pad_h

    q = _load_tile(Q + b * stride_qb + h * stride_qh, rows, offs_d, stride_qt, stride_qd, q_hi, head_dim)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_look_c = n_look
    if not WRAP:
        n_look_c = tl.minimum(n_look - 1, c) + 1  # chunk c has only c chunks before it
    for look in range(0, n_look_c):
        kc = c - look
        if WRAP:
            kc = (kc + n_chunks) % n_chunks
        k_lo, k_hi = _chunk_bounds(kc, chunk, seq_len)
        for start_n in range(k_lo, k_hi, BLOCK_N):
            cols = start_n + offs_n
            k = _load_tile(k_ptr, cols, offs_d, stride_kt, stride_kd, k_hi, head_dim)
            v = _load_tile(v_ptr, cols, offs_d, stride_vt, stride_vd, k_hi, head_dim)
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            s, is_self = _chunked_logits(
                s, rows, cols, q_hi, k_hi, pos_ptr, pad_ptr, stride_pos_t, stride_pad_t, CAUSAL, SELF_MASK, HAS_KPM
            )
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION, DOT_UPCAST)

    out, lse = _finish_softmax(m_i, l_i, acc)
    _store_tile(Out + b * stride_ob + h * stride_oh, out, rows, offs_d, stride_ot, stride_od, q_hi, head_dim)
    tl.store(Lse + pid_bh.to(tl.int64) * seq_len + rows, lse, mask=rows < q_hi)


@triton.jit
def _chunked_bwd_dkdv(
    Q, K, V, DO, Lse, Delta, DK, DV, Pos, Pad,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_pos_b, stride_pos_h, stride_pos_t,
    stride_pad_b, stride_pad_h, stride_pad_t,
    n_heads, seq_len, head_dim, chunk, n_chunks, n_look, blocks_per_chunk, qk_scale, sm_scale,
    WRAP: tl.constexpr, CAUSAL: tl.constexpr, SELF_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block: loop over the query chunks that look at this key chunk, the inverse of the
    forward's neighbour rule (query chunk kc + look, modulo n_chunks when WRAP)."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    kc = pid // blocks_per_chunk
    k_lo, k_hi = _chunk_bounds(kc, chunk, seq_len)
    cols = k_lo + (pid % blocks_per_chunk) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptr = Q + b * stride_qb + h * stride_qh
    do_ptr = DO + b * stride_dob + h * stride_doh
    lse_ptr = Lse + pid_bh.to(tl.int64) * seq_len
    delta_ptr = Delta + pid_bh.to(tl.int64) * seq_len
    pos_ptr = Pos + b * stride_pos_b + h * stride_pos_h
    pad_ptr = Pad + b * stride_pad_b + h * stride_pad_h

    k = _load_tile(K + b * stride_kb + h * stride_kh, cols, offs_d, stride_kt, stride_kd, k_hi, head_dim)
    v = _load_tile(V + b * stride_vb + h * stride_vh, cols, offs_d, stride_vt, stride_vd, k_hi, head_dim)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    n_look_k = n_look
    if not WRAP:
        n_look_k = tl.minimum(n_look - 1, n_chunks - 1 - kc) + 1  # no chunk after the last one
    for look in range(0, n_look_k):
        qc = kc + look
        if WRAP:
            qc = qc % n_chunks
        q_lo, q_hi = _chunk_bounds(qc, chunk, seq_len)
        for start_m in range(q_lo, q_hi, BLOCK_M):
            rows = start_m + offs_m
            q = _load_tile(q_ptr, rows, offs_d, stride_qt, stride_qd, q_hi, head_dim)
            do = _load_tile(do_ptr, rows, offs_d, stride_dot, stride_dod, q_hi, head_dim)
            lse2, delta = _load_row_stats(lse_ptr, delta_ptr, rows, q_hi)
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            s, is_self = _chunked_logits(
                s, rows, cols, q_hi, k_hi, pos_ptr, pad_ptr, stride_pos_t, stride_pad_t, CAUSAL, SELF_MASK, HAS_KPM
            )
            p = tl.exp2(s - lse2[:, None])
            dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION, DOT_UPCAST)
            dp = _dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST)
            # The self logit is a constant, so its pair passes no gradient to q or k.
            ds = tl.where(is_self, 0.0, p * (dp - delta[:, None]))
            dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION, DOT_UPCAST)

    dk_ptr = DK + b * stride_dkb + h * stride_dkh
    dv_ptr = DV + b * stride_dkb + h * stride_dkh
    _store_tile(dk_ptr, dk * sm_scale, cols, offs_d, stride_dkt, stride_dkd, k_hi, head_dim)
    _store_tile(dv_ptr, dv, cols, offs_d, stride_dkt, stride_dkd, k_hi, head_dim)


@triton.jit
def _chunked_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ, Pos, Pad,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    stride_pos_b, stride_pos_h, stride_pos_t,
    stride_pad_b, stride_pad_h, stride_pad_t,
    n_heads, seq_len, head_dim, chunk, n_chunks, n_look, blocks_per_chunk, qk_scale, sm_scale,
    WRAP: tl.constexpr, CAUSAL: tl.constexpr, SELF_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dQ of one query block, over the same key chunks as the forward."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    c = pid // blocks_per_chunk
    q_lo, q_hi = _chunk_bounds(c, chunk, seq_len)
    rows = q_lo + (pid % blocks_per_chunk) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    pos_ptr = Pos + b * stride_pos_b + h * stride_pos_h
    pad_ptr = Pad + b * stride_pad_b + h * stride_pad_h

    q = _load_tile(Q + b * stride_qb + h * stride_qh, rows, offs_d, stride_qt, stride_qd, q_hi, head_dim)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, rows, offs_d, stride_dot, stride_dod, q_hi, head_dim)
    row_stats = pid_bh.to(tl.int64) * seq_len
    lse2, delta = _load_row_stats(Lse + row_stats, Delta + row_stats, rows, q_hi)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_look_c = n_look
    if not WRAP:
        n_look_c = tl.minimum(n_look - 1, c) + 1
    for look in range(0, n_look_c):
        kc = c - look
        if WRAP:
            kc = (kc + n_chunks) % n_chunks
        k_lo, k_hi = _chunk_bounds(kc, chunk, seq_len)
        for start_n in range(k_lo, k_hi, BLOCK_N):
            cols = start_n + offs_n
            k = _load_tile(k_ptr, cols, offs_d, stride_kt, stride_kd, k_hi, head_dim)
            v = _load_tile(v_ptr, cols, offs_d, stride_vt, stride_vd, k_hi, head_dim)
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            s, is_self = _chunked_logits(
                s, rows, cols, q_hi, k_hi, pos_ptr, pad_ptr, stride_pos_t, stride_pad_t, CAUSAL, SELF_MASK, HAS_KPM
            )
            p = tl.exp2(s - lse2[:, None])
            dp = _dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST)
            ds = tl.where(is_self, 0.0, p * (dp - delta[:, None]))
            dq += _dot(ds.to(k.dtype), k, DOT_PRECISION, DOT_UPCAST)

    dq_ptr = DQ + b * stride_dqb + h * stride_dqh
    _store_tile(dq_ptr, dq * sm_scale, rows, offs_d, stride_dqt, stride_dqd, q_hi, head_dim)
