"""The backward kernels of exact attention (design: k_flash_attention.py), without atomics as in FA2: one
program per key block accumulates dK, dV over query blocks (`_flash_bwd_dkdv`), one program per query block
accumulates dQ over key blocks (`_flash_bwd_dq`); both recompute P = exp(S - lse) and use
dS = P * (dP - delta), whose delta (the lse gradient folded in) `_bwd_delta` computes first."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.k_flash_configs import _EVEN_SIZES, autotuned
from kernels.k_flash_tiles import (
    _dot,
    _key_block,
    _key_split,
    _load_row_stats,
    _load_tile,
    _query_split,
    _stat_row,
    _store_tile,
)


@triton.jit
def _dkdv_query_loop(
    dk, dv, k, v, key_ok, q_ptr, do_ptr, lse_ptr, delta_ptr, cols, offs_m, offs_d, lo, hi,
    stride_qm, stride_qd, stride_dom, stride_dod, n_q, head_dim, qk_scale,
    CAUSAL_MASK: tl.constexpr, QUERIES_IN_BOUNDS: tl.constexpr, MASK_KEYS: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q = _load_tile(q_ptr, rows, offs_d, stride_qm, stride_qd, n_q, head_dim, QUERIES_IN_BOUNDS, EVEN_D)
        do = _load_tile(do_ptr, rows, offs_d, stride_dom, stride_dod, n_q, head_dim, QUERIES_IN_BOUNDS, EVEN_D)
        lse2, delta = _load_row_stats(lse_ptr, delta_ptr, rows, n_q, QUERIES_IN_BOUNDS)
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
        if MASK_KEYS:
            s = tl.where(key_ok[None, :], s, float("-inf"))
        if CAUSAL_MASK:
            s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
        # Queries past n_q need no mask: they load as q = dO = 0 with lse = delta = 0, so P = 1 but dO = 0 and
        # dP - delta = 0 make their dV and dK terms zero.
        # P recomputed from the saved lse (FA2 Algorithm 2); masked logits are -inf, so P is 0 there.
        p = tl.exp2(s - lse2[:, None])
        dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION, DOT_UPCAST)
        dp = _dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION, DOT_UPCAST)
    return dk, dv


@triton.heuristics(_EVEN_SIZES)
@triton.jit
def _flash_bwd_dkdv(
    Q, K, V, DO, Lse, Delta, DK, DV, Kpm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_kpm_b, stride_kpm_n,
    n_heads, n_q, n_k, head_dim, qk_scale, sm_scale, n_q_key, n_k_key, stat_pieces,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dV = P^T dO and dK = scale * dS^T Q for one key block; DK and DV share one set of strides."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    start_n = pid_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptr = Q + b * stride_qb + h * stride_qh
    do_ptr = DO + b * stride_dob + h * stride_doh
    row_stats = _stat_row(b, h, n_heads, stat_pieces) * n_q
    lse_ptr = Lse + row_stats
    delta_ptr = Delta + row_stats

    k = _load_tile(K + b * stride_kb + h * stride_kh, cols, offs_d, stride_kn, stride_kd, n_k, head_dim, EVEN_N, EVEN_D)
    v = _load_tile(V + b * stride_vb + h * stride_vh, cols, offs_d, stride_vn, stride_vd, n_k, head_dim, EVEN_N, EVEN_D)
    # This program's keys are fixed, so their padding and bounds mask is built once, not per query block.
    key_ok = cols < n_k
    if HAS_KPM:
        padded = tl.load(Kpm + b * stride_kpm_b + cols * stride_kpm_n, mask=key_ok, other=1)
        key_ok = key_ok & (padded == 0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    band_lo, band_hi, full_hi = _query_split(start_n, n_q, CAUSAL, EVEN_M, BLOCK_M, BLOCK_N)
    if CAUSAL:
        dk, dv = _dkdv_query_loop(
            dk, dv, k, v, key_ok, q_ptr, do_ptr, lse_ptr, delta_ptr, cols, offs_m, offs_d, band_lo, band_hi,
            stride_qm, stride_qd, stride_dom, stride_dod, n_q, head_dim, qk_scale,
            True, EVEN_M, HAS_KPM or not EVEN_N, EVEN_D, DOT_PRECISION, DOT_UPCAST, BLOCK_M,
        )  # fmt: skip
    dk, dv = _dkdv_query_loop(
        dk, dv, k, v, key_ok, q_ptr, do_ptr, lse_ptr, delta_ptr, cols, offs_m, offs_d, band_hi, full_hi,
        stride_qm, stride_qd, stride_dom, stride_dod, n_q, head_dim, qk_scale,
        False, True, HAS_KPM or not EVEN_N, EVEN_D, DOT_PRECISION, DOT_UPCAST, BLOCK_M,
    )  # fmt: skip
    if not EVEN_M:
        dk, dv = _dkdv_query_loop(
            dk, dv, k, v, key_ok, q_ptr, do_ptr, lse_ptr, delta_ptr, cols, offs_m, offs_d,
            tl.maximum(band_hi, full_hi), n_q,
            stride_qm, stride_qd, stride_dom, stride_dod, n_q, head_dim, qk_scale,
            False, False, HAS_KPM or not EVEN_N, EVEN_D, DOT_PRECISION, DOT_UPCAST, BLOCK_M,
        )  # fmt: skip

    dk_ptr = DK + b * stride_dkb + h * stride_dkh
    dv_ptr = DV + b * stride_dkb + h * stride_dkh
    _store_tile(dk_ptr, dk * sm_scale, cols, offs_d, stride_dkn, stride_dkd, n_k, head_dim, EVEN_N, EVEN_D)
    _store_tile(dv_ptr, dv, cols, offs_d, stride_dkn, stride_dkd, n_k, head_dim, EVEN_N, EVEN_D)


@triton.jit
def _dq_key_loop(
    dq, q, do, lse2, delta, k_ptr, v_ptr, kpm_ptr, rows, offs_n, offs_d, lo, hi,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kpm_n, n_k, head_dim, qk_scale,
    CAUSAL_MASK: tl.constexpr, KEYS_IN_BOUNDS: tl.constexpr, HAS_KPM: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k, v, s = _key_block(
            q, k_ptr, v_ptr, kpm_ptr, rows, cols, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_kpm_n,
            n_k, head_dim, qk_scale, CAUSAL_MASK, KEYS_IN_BOUNDS, HAS_KPM, EVEN_D, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip
        # P recomputed from the saved lse (FA2 Algorithm 2); masked logits are -inf, so P is 0 there.
        p = tl.exp2(s - lse2[:, None])
        dp = _dot(do, tl.trans(v), DOT_PRECISION, DOT_UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_PRECISION, DOT_UPCAST)
    return dq


@triton.heuristics(_EVEN_SIZES)
@triton.jit
def _flash_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ, Kpm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_kpm_b, stride_kpm_n,
    n_heads, n_q, n_k, head_dim, qk_scale, sm_scale, n_q_key, n_k_key, stat_pieces,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dQ = scale * dS K for one query block, over the same key blocks (and split) as the forward."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    kpm_ptr = Kpm + b * stride_kpm_b

    q_ptr = Q + b * stride_qb + h * stride_qh
    do_ptr = DO + b * stride_dob + h * stride_doh
    q = _load_tile(q_ptr, rows, offs_d, stride_qm, stride_qd, n_q, head_dim, EVEN_M, EVEN_D)
    do = _load_tile(do_ptr, rows, offs_d, stride_dom, stride_dod, n_q, head_dim, EVEN_M, EVEN_D)
    row_stats = _stat_row(b, h, n_heads, stat_pieces) * n_q
    lse2, delta = _load_row_stats(Lse + row_stats, Delta + row_stats, rows, n_q, EVEN_M)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_hi, hi = _key_split(start_m, n_k, CAUSAL, EVEN_N, BLOCK_M, BLOCK_N)
    dq = _dq_key_loop(
        dq, q, do, lse2, delta, k_ptr, v_ptr, kpm_ptr, rows, offs_n, offs_d, 0, full_hi,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_kpm_n, n_k, head_dim, qk_scale,
        False, True, HAS_KPM, EVEN_D, DOT_PRECISION, DOT_UPCAST, BLOCK_N,
    )  # fmt: skip
    if CAUSAL or not EVEN_N:
        dq = _dq_key_loop(
            dq, q, do, lse2, delta, k_ptr, v_ptr, kpm_ptr, rows, offs_n, offs_d, full_hi, hi,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_kpm_n, n_k, head_dim, qk_scale,
            CAUSAL, EVEN_N, HAS_KPM, EVEN_D, DOT_PRECISION, DOT_UPCAST, BLOCK_N,
        )  # fmt: skip

    dq_ptr = DQ + b * stride_dqb + h * stride_dqh
    _store_tile(dq_ptr, dq * sm_scale, rows, offs_d, stride_dqm, stride_dqd, n_q, head_dim, EVEN_M, EVEN_D)


# The same kernels behind triton.autotune, for CUDA launches without a fixed configuration.


_flash_bwd_dkdv_tuned = autotuned("bwd_dkdv", _flash_bwd_dkdv)
_flash_bwd_dq_tuned = autotuned("bwd_dq", _flash_bwd_dq)


@triton.jit
def _bwd_delta(
    Out, DO, DLse, Delta,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    n_heads, n_q, head_dim,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """delta_i = sum_d dO_id O_id - dlse_i in fp32 for one block of rows (FA2's backward pre-processing, with
    the lse gradient folded in); Delta and DLse are contiguous [B, H, M]. Reads O and dO once, in their own
    dtype, instead of materialising fp32 copies of both."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(Out + b * stride_ob + h * stride_oh, rows, offs_d, stride_om, stride_od, n_q, head_dim)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, rows, offs_d, stride_dom, stride_dod, n_q, head_dim)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row_ptr = pid_bh.to(tl.int64) * n_q + rows
    if HAS_DLSE:
        delta -= tl.load(DLse + row_ptr, mask=rows < n_q, other=0.0)
    tl.store(Delta + row_ptr, delta, mask=rows < n_q)
