"""Triton kernels of chunked attention over a sorted sequence (Reformer's LSH attention after the sort;
Kitaev et al., 2020, arXiv 2001.04451), built on the FlashAttention-2 loops of k_flash_attention.py (Dao, 2023,
arXiv 2307.08691).

Query chunk c attends to key chunks c, c-1, ..., c-(n_look-1) (modulo n_chunks when WRAP). The host passes
n_look = min(lookback, n_chunks - 1) + 1 so that no chunk is visited twice. A program owns one block of rows
inside one chunk, so a block never straddles two chunks and the last chunk may be shorter than `chunk`.
Masks come from the original token positions: causal drops keys with a later position, and SELF_MASK
replaces the logit of a key at the query's own position by SELF_LOGIT (no gradient flows through it).

Rows and tokens. The chunks are cut from `seq_len` layout rows; row l of round r holds token tok[r, l] of the
inputs. INDEXED: tok is read from an index tensor (-1 = a filler row: a masked key whose query is discarded), so
Q, K, V are loaded from the tokens' own rows, and out, lse (forward) and dQ, dK, dV (backward) are stored at the
tokens' rows of round r: no sorted copy of the inputs or outputs exists (Reformer's LSH attention after its sort).
Otherwise tok = l and there is one round. A program of axis 1 is one (batch, head, round); its round's outputs
sit at stride_*r (0 without rounds). Positions, when not given (HAS_POS off), are the tokens' indices.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.k_flash_tiles import (
    LOG2E,
    _dot,
    _finish_softmax,
    _online_softmax_step,
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
def _looks_of(n_look, tok):
    """`n_look`, or 0 when no row of the program's block holds a token (all -1): it has nothing to load, compute or
    store. LSH's causal layout on the kernels is sized for the worst case of the hashes, so that no length is read
    back from the device (models/attention/lsh.py `bucket_aligned_slots`): its last chunks are filler rows only, and
    their programs end here at the cost of one index load."""
    return tl.where(tl.max(tok) < 0, 0, n_look)


@triton.jit
def _row_tokens(tok_ptr, rows, row_hi, INDEXED: tl.constexpr):
    """Token of each layout row (int64); -1 for rows past the chunk's end and for filler rows."""
    if INDEXED:
        return tl.load(tok_ptr + rows, mask=rows < row_hi, other=-1).to(tl.int64)
    return tl.where(rows < row_hi, rows, -1).to(tl.int64)


@triton.jit
def _load_rows(ptr, tok, offs_d, stride_t, stride_d, head_dim):
    """[len(tok), BLOCK_D] tile of the tokens' rows; rows of token -1 and head-dim padding read as zero."""
    ok = (tok >= 0)[:, None] & (offs_d < head_dim)[None, :]
    offsets = tl.maximum(tok, 0)[:, None] * stride_t + offs_d[None, :] * stride_d
    return tl.load(ptr + offsets, mask=ok, other=0.0)


@triton.jit
def _store_rows(ptr, x, tok, offs_d, stride_t, stride_d, head_dim):
    ok = (tok >= 0)[:, None] & (offs_d < head_dim)[None, :]
    offsets = tl.maximum(tok, 0)[:, None] * stride_t + offs_d[None, :] * stride_d
    tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _load_token_stats(lse_ptr, delta_ptr, tok):
    """lse in base 2 and delta of the query tokens (k_flash_tiles._load_row_stats through the token index)."""
    ok = tok >= 0
    lse2 = tl.load(lse_ptr + tl.maximum(tok, 0), mask=ok, other=0.0) * LOG2E
    delta = tl.load(delta_ptr + tl.maximum(tok, 0), mask=ok, other=0.0)
    return tl.where(lse2 == float("-inf"), 0.0, lse2), delta


@triton.jit
def _chunked_logits(
    s, q_tok, k_tok, pos_ptr, pad_ptr, stride_pos_t, stride_pad_t,
    CAUSAL: tl.constexpr, SELF_MASK: tl.constexpr, HAS_KPM: tl.constexpr, HAS_POS: tl.constexpr,
):  # fmt: skip
    """Apply the chunk bounds and filler rows (token -1), padding, causal and self masks to base-2 logits
    s [BLOCK_M, BLOCK_N] of query tokens q_tok against key tokens k_tok.

    Returns the masked logits (-inf where masked) and the self-pair indicator (for the backward)."""
    q_ok = q_tok >= 0
    k_ok = k_tok >= 0
    valid = q_ok[:, None] & k_ok[None, :]
    if HAS_KPM:
        padded = tl.load(pad_ptr + tl.maximum(k_tok, 0) * stride_pad_t, mask=k_ok, other=1)
        valid = valid & (padded == 0)[None, :]
    is_self = valid & False
    if CAUSAL or SELF_MASK:
        if HAS_POS:
            qpos = tl.load(pos_ptr + tl.maximum(q_tok, 0) * stride_pos_t, mask=q_ok, other=0)
            kpos = tl.load(pos_ptr + tl.maximum(k_tok, 0) * stride_pos_t, mask=k_ok, other=0)
        else:
            qpos = q_tok
            kpos = k_tok
        if CAUSAL:
            valid = valid & (kpos[None, :] <= qpos[:, None])
        if SELF_MASK:
            is_self = valid & (kpos[None, :] == qpos[:, None])
            s = tl.where(is_self, SELF_LOGIT2, s)
    return tl.where(valid, s, float("-inf")), is_self


@triton.jit
def _program(pid_bhr, n_heads, n_rounds):
    """(batch, head, round) of a program of axis 1, as int64 (offsets of long sequences overflow int32)."""
    pid = pid_bhr.to(tl.int64)
    return pid // (n_heads * n_rounds), (pid // n_rounds) % n_heads, pid % n_rounds


@triton.jit
def _chunked_fwd(
    Q, K, V, Out, Lse, Pos, Pad, Tok,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_or, stride_ot, stride_od,
    stride_pos_b, stride_pos_h, stride_pos_r, stride_pos_t,
    stride_pad_b, stride_pad_h, stride_pad_t,
    n_heads, n_rounds, n_tokens, seq_len, head_dim, chunk, n_chunks, n_look, blocks_per_chunk, qk_scale,
    WRAP: tl.constexpr, CAUSAL: tl.constexpr, SELF_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_POS: tl.constexpr, INDEXED: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_bhr = tl.program_id(1)
    b, h, r = _program(pid_bhr, n_heads, n_rounds)
    c = pid // blocks_per_chunk
    q_lo, q_hi = _chunk_bounds(c, chunk, seq_len)
    rows = q_lo + (pid % blocks_per_chunk) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok_ptr = Tok + pid_bhr.to(tl.int64) * seq_len
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    pos_ptr = Pos + b * stride_pos_b + h * stride_pos_h + r * stride_pos_r
    pad_ptr = Pad + b * stride_pad_b + h * stride_pad_h

    q_tok = _row_tokens(tok_ptr, rows, q_hi, INDEXED)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, q_tok, offs_d, stride_qt, stride_qd, head_dim)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_look_c = n_look
    if not WRAP:
        n_look_c = tl.minimum(n_look - 1, c) + 1  # chunk c has only c chunks before it
    n_look_c = _looks_of(n_look_c, q_tok)
    for look in range(0, n_look_c):
        kc = c - look
        if WRAP:
            kc = (kc + n_chunks) % n_chunks
        k_lo, k_hi = _chunk_bounds(kc, chunk, seq_len)
        for start_n in range(k_lo, k_hi, BLOCK_N):
            k_tok = _row_tokens(tok_ptr, start_n + offs_n, k_hi, INDEXED)
            k = _load_rows(k_ptr, k_tok, offs_d, stride_kt, stride_kd, head_dim)
            v = _load_rows(v_ptr, k_tok, offs_d, stride_vt, stride_vd, head_dim)
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            s, is_self = _chunked_logits(
                s, q_tok, k_tok, pos_ptr, pad_ptr, stride_pos_t, stride_pad_t, CAUSAL, SELF_MASK, HAS_KPM, HAS_POS
            )
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION, DOT_UPCAST)

    out, lse = _finish_softmax(m_i, l_i, acc)
    out_ptr = Out + b * stride_ob + h * stride_oh + r * stride_or
    _store_rows(out_ptr, out, q_tok, offs_d, stride_ot, stride_od, head_dim)
    tl.store(Lse + pid_bhr.to(tl.int64) * n_tokens + tl.maximum(q_tok, 0), lse, mask=q_tok >= 0)


@triton.jit
def _chunked_bwd_dkdv(
    Q, K, V, DO, Lse, Delta, DK, DV, Pos, Pad, Tok,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dor, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkr, stride_dkt, stride_dkd,
    stride_pos_b, stride_pos_h, stride_pos_r, stride_pos_t,
    stride_pad_b, stride_pad_h, stride_pad_t,
    n_heads, n_rounds, n_tokens, seq_len, head_dim, chunk, n_chunks, n_look, blocks_per_chunk, qk_scale, sm_scale,
    WRAP: tl.constexpr, CAUSAL: tl.constexpr, SELF_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_POS: tl.constexpr, INDEXED: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block: loop over the query chunks that look at this key chunk, the inverse of the
    forward's neighbour rule (query chunk kc + look, modulo n_chunks when WRAP). Stored at the key tokens' rows
    of this program's round: each token has one row per round, so no two programs write the same place."""
    pid = tl.program_id(0)
    pid_bhr = tl.program_id(1)
    b, h, r = _program(pid_bhr, n_heads, n_rounds)
    kc = pid // blocks_per_chunk
    k_lo, k_hi = _chunk_bounds(kc, chunk, seq_len)
    cols = k_lo + (pid % blocks_per_chunk) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok_ptr = Tok + pid_bhr.to(tl.int64) * seq_len
    q_ptr = Q + b * stride_qb + h * stride_qh
    do_ptr = DO + b * stride_dob + h * stride_doh + r * stride_dor
    lse_ptr = Lse + pid_bhr.to(tl.int64) * n_tokens
    delta_ptr = Delta + pid_bhr.to(tl.int64) * n_tokens
    pos_ptr = Pos + b * stride_pos_b + h * stride_pos_h + r * stride_pos_r
    pad_ptr = Pad + b * stride_pad_b + h * stride_pad_h

    k_tok = _row_tokens(tok_ptr, cols, k_hi, INDEXED)
    k = _load_rows(K + b * stride_kb + h * stride_kh, k_tok, offs_d, stride_kt, stride_kd, head_dim)
    v = _load_rows(V + b * stride_vb + h * stride_vh, k_tok, offs_d, stride_vt, stride_vd, head_dim)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    n_look_k = n_look
    if not WRAP:
        n_look_k = tl.minimum(n_look - 1, n_chunks - 1 - kc) + 1  # no chunk after the last one
    n_look_k = _looks_of(n_look_k, k_tok)
    for look in range(0, n_look_k):
        qc = kc + look
        if WRAP:
            qc = qc % n_chunks
        q_lo, q_hi = _chunk_bounds(qc, chunk, seq_len)
        for start_m in range(q_lo, q_hi, BLOCK_M):
            q_tok = _row_tokens(tok_ptr, start_m + offs_m, q_hi, INDEXED)
            q = _load_rows(q_ptr, q_tok, offs_d, stride_qt, stride_qd, head_dim)
            do = _load_rows(do_ptr, q_tok, offs_d, stride_dot, stride_dod, head_dim)
            lse2, delta = _load_token_stats(lse_ptr, delta_ptr, q_tok)
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            s, is_self = _chunked_logits(
                s, q_tok, k_tok, pos_ptr, pad_ptr, stride_pos_t, stride_pad_t, CAUSAL, SELF_MASK, HAS_KPM, HAS_POS
            )
            p = tl.exp2(s - lse2[:, None])
            dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION, DOT_UPCAST)
            dp = _dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST)
            # The self logit is a constant, so its pair passes no gradient to q or k.
            ds = tl.where(is_self, 0.0, p * (dp - delta[:, None]))
            dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION, DOT_UPCAST)

    dk_ptr = DK + b * stride_dkb + h * stride_dkh + r * stride_dkr
    dv_ptr = DV + b * stride_dkb + h * stride_dkh + r * stride_dkr
    _store_rows(dk_ptr, dk * sm_scale, k_tok, offs_d, stride_dkt, stride_dkd, head_dim)
    _store_rows(dv_ptr, dv, k_tok, offs_d, stride_dkt, stride_dkd, head_dim)


@triton.jit
def _chunked_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ, Pos, Pad, Tok,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dor, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqr, stride_dqt, stride_dqd,
    stride_pos_b, stride_pos_h, stride_pos_r, stride_pos_t,
    stride_pad_b, stride_pad_h, stride_pad_t,
    n_heads, n_rounds, n_tokens, seq_len, head_dim, chunk, n_chunks, n_look, blocks_per_chunk, qk_scale, sm_scale,
    WRAP: tl.constexpr, CAUSAL: tl.constexpr, SELF_MASK: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_POS: tl.constexpr, INDEXED: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dQ of one query block, over the same key chunks as the forward; stored at the query tokens' rows."""
    pid = tl.program_id(0)
    pid_bhr = tl.program_id(1)
    b, h, r = _program(pid_bhr, n_heads, n_rounds)
    c = pid // blocks_per_chunk
    q_lo, q_hi = _chunk_bounds(c, chunk, seq_len)
    rows = q_lo + (pid % blocks_per_chunk) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok_ptr = Tok + pid_bhr.to(tl.int64) * seq_len
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    pos_ptr = Pos + b * stride_pos_b + h * stride_pos_h + r * stride_pos_r
    pad_ptr = Pad + b * stride_pad_b + h * stride_pad_h

    q_tok = _row_tokens(tok_ptr, rows, q_hi, INDEXED)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, q_tok, offs_d, stride_qt, stride_qd, head_dim)
    do = _load_rows(DO + b * stride_dob + h * stride_doh + r * stride_dor, q_tok, offs_d, stride_dot, stride_dod,
                    head_dim)
    row_stats = pid_bhr.to(tl.int64) * n_tokens
    lse2, delta = _load_token_stats(Lse + row_stats, Delta + row_stats, q_tok)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_look_c = n_look
    if not WRAP:
        n_look_c = tl.minimum(n_look - 1, c) + 1
    n_look_c = _looks_of(n_look_c, q_tok)
    for look in range(0, n_look_c):
        kc = c - look
        if WRAP:
            kc = (kc + n_chunks) % n_chunks
        k_lo, k_hi = _chunk_bounds(kc, chunk, seq_len)
        for start_n in range(k_lo, k_hi, BLOCK_N):
            k_tok = _row_tokens(tok_ptr, start_n + offs_n, k_hi, INDEXED)
            k = _load_rows(k_ptr, k_tok, offs_d, stride_kt, stride_kd, head_dim)
            v = _load_rows(v_ptr, k_tok, offs_d, stride_vt, stride_vd, head_dim)
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            s, is_self = _chunked_logits(
                s, q_tok, k_tok, pos_ptr, pad_ptr, stride_pos_t, stride_pad_t, CAUSAL, SELF_MASK, HAS_KPM, HAS_POS
            )
            p = tl.exp2(s - lse2[:, None])
            dp = _dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST)
            ds = tl.where(is_self, 0.0, p * (dp - delta[:, None]))
            dq += _dot(ds.to(k.dtype), k, DOT_PRECISION, DOT_UPCAST)

    dq_ptr = DQ + b * stride_dqb + h * stride_dqh + r * stride_dqr
    _store_rows(dq_ptr, dq * sm_scale, q_tok, offs_d, stride_dqt, stride_dqd, head_dim)
