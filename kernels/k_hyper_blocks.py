"""Triton kernels of HyperAttention's approximate step (Han et al., 2023, arXiv 2310.05869, Algorithms 1-3): each
query attends exactly to one block of keys in sortLSH order and to m uniformly sampled keys weighted by n / m, in
ONE softmax, built on the FlashAttention-2 loops of k_flash_attention.py (Dao, 2023, arXiv 2307.08691).

The paper (and models/attention/hyper.py on PyTorch) computes the block-diagonal part and the sampled part as two
attentions and merges them through their log-sum-exp; a softmax over the union of two disjoint key sets is that
merge, so here the sampled keys are a second loop of the same online softmax, their logits raised by log(n / m).
Nothing sorted is copied: the kernels read q, k, v through indices and store at the tokens' own rows.

Layout (int64 indices, all per (batch, head)):
- query slots QTOK [G * b]: slot g*b + i of group g holds a query token, or -1 (a filler: nothing stored);
- key rows KTOK [NB * b]: row kb*b + j of key block kb holds a key token, or -1 (a masked filler);
- GBLOCK [G]: the key block group g attends to (non-causal HyperAttention: g itself; past-only routing of a causal
  off-diagonal block: several consecutive groups share a key block, models/attention/hyper.py `placed`);
- SROW [m]: the sampled keys as key rows, ascending; a sample in the group's own key block is masked (its key
  is already in the block part), as is a padded or filler key. LOGW [B, S]: the samples' log-weight, natural log.
- Segments (S >= 1, the levels of the causal recursion laid side by side: models/attention/hyper_levels.py): the key
  blocks fall into S runs of `seg_blocks` blocks and the samples into S runs of `seg_samples`; a group sees only its
  own segment's samples, weighted by its segment's LOGW. One segment is the plain layout.
- MERGE (forward): the result is merged through the log-sum-exp into the out and lse already stored at the query
  tokens (the causal recursion's earlier parts) instead of overwriting them; ACCUMULATE (backward): dq, dk, dv are
  added to what the buffers hold. The backward of such a merged softmax takes the final out's lse and delta, with
  which each part's gradient is its own FlashAttention-2 backward (docs/kernels.md).
Every query token sits in exactly one slot and every key token in exactly one row, so no two programs store to
one place. A key's gradient from the samples is summed over every group: the samples kernel writes one fp32
partial per split of the groups, and the block kernel sums the splits of its samples and adds each sample's sum to
its key row's accumulator (a one-hot product), so dK and dV are each stored once, rounded once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.k_chunked_attention import _load_rows, _load_token_stats, _program, _row_tokens, _store_rows
from kernels.k_flash_tiles import LOG2E, _dot, _finish_softmax, _online_softmax_step
from kernels.k_merge_rounds import _normaliser


def launch_config(block_d: int, elem_bytes: int, block: int, interpret: bool) -> dict[str, int]:
    """Tiles no larger than a block (rounded up to a power of two, at least the 16 tl.dot needs); fp32 gets half
    the tile size. BLOCK_S: samples per step of the one-hot product that moves their gradients to key rows."""
    if interpret:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_S": 16, "num_warps": 1, "num_stages": 1}
    tile = min(64 if elem_bytes < 4 else 32, max(16, triton.next_power_of_2(block)))
    return {"BLOCK_M": tile, "BLOCK_N": tile, "BLOCK_S": 16, "num_warps": 4 if block_d <= 64 else 8, "num_stages": 2}


@triton.jit
def _block_logits(s, q_tok, k_tok, pad_ptr, HAS_KPM: tl.constexpr):
    """Masked base-2 logits of query tokens q_tok against key tokens k_tok (-1: filler) of the block part."""
    valid = (q_tok >= 0)[:, None] & (k_tok >= 0)[None, :]
    if HAS_KPM:
        padded = tl.load(pad_ptr + tl.maximum(k_tok, 0), mask=k_tok >= 0, other=1)
        valid = valid & (padded == 0)[None, :]
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _sample_logits(s, q_tok, k_tok, sample_block, key_block, logw2, pad_ptr, HAS_KPM: tl.constexpr):
    """The samples' logits: raised by log2(n / m), masked where the sample lies in the group's own key block
    (`key_block`), is a filler or padded, or the query is a filler."""
    valid = (q_tok >= 0)[:, None] & ((k_tok >= 0) & (sample_block != key_block))[None, :]
    if HAS_KPM:
        padded = tl.load(pad_ptr + tl.maximum(k_tok, 0), mask=k_tok >= 0, other=1)
        valid = valid & (padded == 0)[None, :]
    return tl.where(valid, s + logw2, float("-inf"))


@triton.jit
def _sample_tokens(srow_ptr, ktok_ptr, j, j_end, block):
    """(key token, key block) of samples j; -1 for both from sample j_end on (the segment's end)."""
    srow = tl.load(srow_ptr + j, mask=j < j_end, other=-1)
    k_tok = tl.load(ktok_ptr + tl.maximum(srow, 0), mask=srow >= 0, other=-1)
    return k_tok, tl.where(srow >= 0, srow // block, -1)


@triton.jit
def _key_tile(k_ptr, v_ptr, k_tok, offs_d, stride_kt, stride_kd, stride_vt, stride_vd, head_dim):
    return (_load_rows(k_ptr, k_tok, offs_d, stride_kt, stride_kd, head_dim),
            _load_rows(v_ptr, k_tok, offs_d, stride_vt, stride_vd, head_dim))


@triton.jit
def _query_tile(qtok_ptr, rows, row_end, q_ptr, do_ptr, lse_ptr, delta_ptr, offs_d, stride_qt, stride_qd, stride_dot,
                stride_dod, head_dim):
    """A backward's tile of query slots: tokens, q, dO, lse in base 2 and delta."""
    q_tok = _row_tokens(qtok_ptr, rows, row_end, True)
    q = _load_rows(q_ptr, q_tok, offs_d, stride_qt, stride_qd, head_dim)
    do = _load_rows(do_ptr, q_tok, offs_d, stride_dot, stride_dod, head_dim)
    lse2, delta = _load_token_stats(lse_ptr, delta_ptr, q_tok)
    return q_tok, q, do, lse2, delta


@triton.jit
def _key_gradients(q, do, lse2, delta, k, v, s, dk, dv, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One (query tile, key tile) step of dK, dV (unscaled) from the masked base-2 logits s."""
    p = tl.exp2(s - lse2[:, None])
    dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION, DOT_UPCAST)
    ds = p * (_dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST) - delta[:, None])
    dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION, DOT_UPCAST)
    return dk, dv


@triton.jit
def _query_gradient(q, do, lse2, delta, k, v, s, dq, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One (query tile, key tile) step of dQ (unscaled)."""
    p = tl.exp2(s - lse2[:, None])
    ds = p * (_dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST) - delta[:, None])
    return dq + _dot(ds.to(k.dtype), k, DOT_PRECISION, DOT_UPCAST)


@triton.jit
def _query_program(GBlock, LogW, n_heads, n_groups, block, tiles_per_group, seg_blocks, n_segs,
                   BLOCK_M: tl.constexpr):
    """What a program of the forward or of dQ owns: (batch, head, their flat index as int64, group, its slots' rows,
    the key block it reads, its segment, the samples' log2 weight)."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, _r = _program(pid_bh, n_heads, 1)
    bh = pid_bh.to(tl.int64)
    g = pid // tiles_per_group
    rows = g * block + (pid % tiles_per_group) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.load(GBlock + bh * n_groups + g)
    seg = kb // seg_blocks
    return b, h, bh, g, rows, kb, seg, tl.load(LogW + b * n_segs + seg) * LOG2E


@triton.jit
def _merge_into(out, lse, Out, Lse, q_tok, offs_d, stride_ot, stride_od, head_dim):
    """(out, lse) merged through the log-sum-exp with what is stored at the query tokens, as kernels/k_merge_rounds.py
    `_merge_below_fwd` merges a level's two parts (fp32; a row neither part has keys for keeps zeros, lse -inf)."""
    lse_prev = tl.load(Lse + tl.maximum(q_tok, 0), mask=q_tok >= 0, other=float("-inf"))
    out_prev = _load_rows(Out, q_tok, offs_d, stride_ot, stride_od, head_dim).to(tl.float32)
    m = tl.maximum(lse_prev, lse)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_prev, w_new = tl.exp(lse_prev - m), tl.exp(lse - m)
    safe, merged_lse = _normaliser(m, w_prev + w_new)
    return out_prev * (w_prev / safe)[:, None] + out * (w_new / safe)[:, None], merged_lse


@triton.jit
def _store_grad(ptr, x, tok, offs_d, stride_t, stride_d, head_dim, ACCUMULATE: tl.constexpr):
    """Store a gradient tile at the tokens' rows, or add it to what is there (ACCUMULATE)."""
    if ACCUMULATE:
        x += _load_rows(ptr, tok, offs_d, stride_t, stride_d, head_dim).to(tl.float32)
    _store_rows(ptr, x, tok, offs_d, stride_t, stride_d, head_dim)


@triton.jit
def _hyper_fwd(
    Q, K, V, Out, Lse, QTok, KTok, GBlock, SRow, LogW, Pad,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    n_heads, n_q, n_k, n_groups, n_blocks, block, n_samples, head_dim, tiles_per_group, qk_scale,
    seg_blocks, seg_samples, n_segs,
    HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MERGE: tl.constexpr = False,
):  # fmt: skip
    """One tile of BLOCK_M query slots inside one group: its key block, then its segment's samples."""
    b, h, bh, g, rows, kb, seg, logw2 = _query_program(GBlock, LogW, n_heads, n_groups, block, tiles_per_group,
                                                       seg_blocks, n_segs, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    ktok_ptr = KTok + bh * n_blocks * block
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    pad_ptr = Pad + b * n_k

    q_tok = _row_tokens(QTok + bh * n_groups * block, rows, g * block + block, True)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, q_tok, offs_d, stride_qt, stride_qd, head_dim)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(kb * block, kb * block + block, BLOCK_N):
        k_tok = _row_tokens(ktok_ptr, start_n + offs_n, kb * block + block, True)
        k, v = _key_tile(k_ptr, v_ptr, k_tok, offs_d, stride_kt, stride_kd, stride_vt, stride_vd, head_dim)
        s = _block_logits(_dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale, q_tok, k_tok, pad_ptr, HAS_KPM)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION, DOT_UPCAST)
    s_end = seg * seg_samples + seg_samples
    for start_s in range(seg * seg_samples, s_end, BLOCK_N):
        k_tok, s_block = _sample_tokens(SRow + bh * n_samples, ktok_ptr, start_s + offs_n, s_end, block)
        k, v = _key_tile(k_ptr, v_ptr, k_tok, offs_d, stride_kt, stride_kd, stride_vt, stride_vd, head_dim)
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
        s = _sample_logits(s, q_tok, k_tok, s_block, kb, logw2, pad_ptr, HAS_KPM)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION, DOT_UPCAST)

    out, lse = _finish_softmax(m_i, l_i, acc)
    out_ptr = Out + b * stride_ob + h * stride_oh
    if MERGE:
        out, lse = _merge_into(out, lse, out_ptr, Lse + bh * n_q, q_tok, offs_d, stride_ot, stride_od, head_dim)
    _store_rows(out_ptr, out, q_tok, offs_d, stride_ot, stride_od, head_dim)
    tl.store(Lse + bh * n_q + tl.maximum(q_tok, 0), lse, mask=q_tok >= 0)


@triton.jit
def _hyper_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ, QTok, KTok, GBlock, SRow, LogW, Pad,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    n_heads, n_q, n_k, n_groups, n_blocks, block, n_samples, head_dim, tiles_per_group, qk_scale, sm_scale,
    seg_blocks, seg_samples, n_segs,
    HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACCUMULATE: tl.constexpr = False,
):  # fmt: skip
    """dQ of one tile of query slots, over the forward's keys; stored at the query tokens' rows."""
    b, h, bh, g, rows, kb, seg, logw2 = _query_program(GBlock, LogW, n_heads, n_groups, block, tiles_per_group,
                                                       seg_blocks, n_segs, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    ktok_ptr = KTok + bh * n_blocks * block
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    pad_ptr = Pad + b * n_k

    q_tok, q, do, lse2, delta = _query_tile(
        QTok + bh * n_groups * block, rows, g * block + block, Q + b * stride_qb + h * stride_qh,
        DO + b * stride_dob + h * stride_doh, Lse + bh * n_q, Delta + bh * n_q, offs_d, stride_qt, stride_qd,
        stride_dot, stride_dod, head_dim)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(kb * block, kb * block + block, BLOCK_N):
        k_tok = _row_tokens(ktok_ptr, start_n + offs_n, kb * block + block, True)
        k, v = _key_tile(k_ptr, v_ptr, k_tok, offs_d, stride_kt, stride_kd, stride_vt, stride_vd, head_dim)
        s = _block_logits(_dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale, q_tok, k_tok, pad_ptr, HAS_KPM)
        dq = _query_gradient(q, do, lse2, delta, k, v, s, dq, DOT_PRECISION, DOT_UPCAST)
    s_end = seg * seg_samples + seg_samples
    for start_s in range(seg * seg_samples, s_end, BLOCK_N):
        k_tok, s_block = _sample_tokens(SRow + bh * n_samples, ktok_ptr, start_s + offs_n, s_end, block)
        k, v = _key_tile(k_ptr, v_ptr, k_tok, offs_d, stride_kt, stride_kd, stride_vt, stride_vd, head_dim)
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
        s = _sample_logits(s, q_tok, k_tok, s_block, kb, logw2, pad_ptr, HAS_KPM)
        dq = _query_gradient(q, do, lse2, delta, k, v, s, dq, DOT_PRECISION, DOT_UPCAST)

    _store_grad(DQ + b * stride_dqb + h * stride_dqh, dq * sm_scale, q_tok, offs_d, stride_dqt, stride_dqd, head_dim,
                ACCUMULATE)


@triton.jit
def _hyper_bwd_samples(
    Q, K, V, DO, Lse, Delta, DKS, DVS, QTok, KTok, GBlock, FirstGroup, SRow, LogW, Pad,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    n_heads, n_q, n_k, n_groups, n_blocks, block, n_samples, head_dim, sample_tiles, splits, qk_scale,
    seg_blocks, seg_samples, n_segs,
    HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Unscaled fp32 dK, dV of one tile of one segment's samples (`sample_tiles` tiles a segment) from that
    segment's query groups in one split of them: DKS, DVS [splits, B*H, m, BLOCK_D] (summed over the splits by
    `_hyper_bwd_dkdv`). A sample sees every group of its segment but its own key block's."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, _r = _program(pid_bh, n_heads, 1)
    bh = pid_bh.to(tl.int64)
    split = pid // (sample_tiles * n_segs)
    seg = (pid // sample_tiles) % n_segs
    s_end = seg * seg_samples + seg_samples
    j = seg * seg_samples + (pid % sample_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qtok_ptr = QTok + bh * n_groups * block
    q_ptr = Q + b * stride_qb + h * stride_qh
    do_ptr = DO + b * stride_dob + h * stride_doh
    pad_ptr = Pad + b * n_k
    logw2 = tl.load(LogW + b * n_segs + seg) * LOG2E

    k_tok, s_block = _sample_tokens(SRow + bh * n_samples, KTok + bh * n_blocks * block, j, s_end, block)
    k, v = _key_tile(K + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh, k_tok, offs_d, stride_kt,
                     stride_kd, stride_vt, stride_vd, head_dim)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # The segment's groups (groups come in key-block order), split `splits` ways.
    seg_g_lo = tl.load(FirstGroup + bh * (n_blocks + 1) + seg * seg_blocks)
    seg_g_hi = tl.load(FirstGroup + bh * (n_blocks + 1) + seg * seg_blocks + seg_blocks)
    groups_per_split = (seg_g_hi - seg_g_lo + splits - 1) // splits
    g_lo = seg_g_lo + split * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, seg_g_hi)
    for g in range(g_lo, g_hi):
        kb = tl.load(GBlock + bh * n_groups + g)
        for start_m in range(g * block, g * block + block, BLOCK_M):
            q_tok, q, do, lse2, delta = _query_tile(
                qtok_ptr, start_m + offs_m, g * block + block, q_ptr, do_ptr, Lse + bh * n_q, Delta + bh * n_q,
                offs_d, stride_qt, stride_qd, stride_dot, stride_dod, head_dim)
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            s = _sample_logits(s, q_tok, k_tok, s_block, kb, logw2, pad_ptr, HAS_KPM)
            dk, dv = _key_gradients(q, do, lse2, delta, k, v, s, dk, dv, DOT_PRECISION, DOT_UPCAST)

    part = ((split * tl.num_programs(1) + bh) * n_samples + j)[:, None] * BLOCK_D + offs_d[None, :]
    tl.store(DKS + part, dk, mask=(j < s_end)[:, None])
    tl.store(DVS + part, dv, mask=(j < s_end)[:, None])


@triton.jit
def _hyper_bwd_dkdv(
    Q, K, V, DO, Lse, Delta, DK, DV, DKS, DVS, QTok, KTok, GBlock, FirstGroup, SRow, SampleStart, Pad,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    n_heads, n_q, n_k, n_groups, n_blocks, block, n_samples, head_dim, tiles_per_block, splits, qk_scale, sm_scale,
    HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ACCUMULATE: tl.constexpr = False,
):  # fmt: skip
    """dK, dV of one tile of key rows inside key block kb: the groups FirstGroup[kb] .. FirstGroup[kb+1]-1 that
    attend to it, plus the sample gradients DKS, DVS [splits, B*H, m, BLOCK_D] of the samples at these rows, summed
    over the splits (samples SampleStart[kb] .. SampleStart[kb+1]-1, SROW being ascending). Stored once at the key
    tokens' rows."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, _r = _program(pid_bh, n_heads, 1)
    bh = pid_bh.to(tl.int64)
    kb = pid // tiles_per_block
    cols = kb * block + (pid % tiles_per_block) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qtok_ptr = QTok + bh * n_groups * block
    q_ptr = Q + b * stride_qb + h * stride_qh
    do_ptr = DO + b * stride_dob + h * stride_doh
    pad_ptr = Pad + b * n_k

    k_tok = _row_tokens(KTok + bh * n_blocks * block, cols, kb * block + block, True)
    k, v = _key_tile(K + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh, k_tok, offs_d, stride_kt,
                     stride_kd, stride_vt, stride_vd, head_dim)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    g_lo = tl.load(FirstGroup + bh * (n_blocks + 1) + kb)
    g_hi = tl.load(FirstGroup + bh * (n_blocks + 1) + kb + 1)
    for g in range(g_lo, g_hi):
        for start_m in range(g * block, g * block + block, BLOCK_M):
            q_tok, q, do, lse2, delta = _query_tile(
                qtok_ptr, start_m + offs_m, g * block + block, q_ptr, do_ptr, Lse + bh * n_q, Delta + bh * n_q,
                offs_d, stride_qt, stride_qd, stride_dot, stride_dod, head_dim)
            s = _block_logits(_dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale, q_tok, k_tok, pad_ptr,
                              HAS_KPM)
            dk, dv = _key_gradients(q, do, lse2, delta, k, v, s, dk, dv, DOT_PRECISION, DOT_UPCAST)

    # The samples' summed gradients, each added to the accumulator of its own key row: a one-hot [BLOCK_N, BLOCK_S]
    # times [BLOCK_S, BLOCK_D] product, exact in fp32 (each output sums the samples drawn at that row).
    offs_s = tl.arange(0, BLOCK_S)
    s_lo = tl.load(SampleStart + bh * (n_blocks + 1) + kb)
    s_hi = tl.load(SampleStart + bh * (n_blocks + 1) + kb + 1)
    for start_s in range(s_lo, s_hi, BLOCK_S):
        j = start_s + offs_s
        srow = tl.load(SRow + bh * n_samples + j, mask=j < s_hi, other=-1)
        one_hot = (cols[:, None] == srow[None, :]).to(tl.float32)
        dks = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
        dvs = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
        for split in range(splits):
            part = ((split * tl.num_programs(1) + bh) * n_samples + j)[:, None] * BLOCK_D + offs_d[None, :]
            dks += tl.load(DKS + part, mask=(j < s_hi)[:, None], other=0.0)
            dvs += tl.load(DVS + part, mask=(j < s_hi)[:, None], other=0.0)
        dk += tl.dot(one_hot, dks, input_precision="ieee")
        dv += tl.dot(one_hot, dvs, input_precision="ieee")

    _store_grad(DK + b * stride_dkb + h * stride_dkh, dk * sm_scale, k_tok, offs_d, stride_dkt, stride_dkd, head_dim,
                ACCUMULATE)
    _store_grad(DV + b * stride_dvb + h * stride_dvh, dv, k_tok, offs_d, stride_dvt, stride_dvd, head_dim, ACCUMULATE)
