"""The forward kernel of exact attention (design: k_flash_attention.py): one program per (query block,
batch*head) streams the keys with the online softmax in base 2 and stores out and the natural-log lse."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.k_flash_configs import _EVEN_SIZES, autotuned
from kernels.k_flash_tiles import (
    _finish_softmax,
    _key_block,
    _key_split,
    _load_tile,
    _online_softmax_step,
    _stat_row,
    _store_tile,
)


@triton.jit
def _fwd_key_loop(
    acc, l_i, m_i, q, k_ptr, v_ptr, kpm_ptr, rows, offs_n, offs_d, lo, hi,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kpm_n, n_k, head_dim, qk_scale,
    CAUSAL_MASK: tl.constexpr, KEYS_IN_BOUNDS: tl.constexpr, HAS_KPM: tl.constexpr, MAY_BE_EMPTY: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        _, v, s = _key_block(
            q, k_ptr, v_ptr, kpm_ptr, rows, cols, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_kpm_n,
            n_k, head_dim, qk_scale, CAUSAL_MASK, KEYS_IN_BOUNDS, HAS_KPM, EVEN_D, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION, DOT_UPCAST, MAY_BE_EMPTY)
    return acc, l_i, m_i


@triton.heuristics(_EVEN_SIZES)
@triton.jit
def _flash_fwd(
    Q, K, V, Out, Lse, Kpm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_kpm_b, stride_kpm_n,
    n_heads, n_q, n_k, head_dim, qk_scale, n_q_key, n_k_key, stat_pieces,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # int64 base offsets: batch*heads*seq*head_dim passes 2**31 at long sequences.
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptr = K + b * stride_kb + h * stride_kh
    v_ptr = V + b * stride_vb + h * stride_vh
    kpm_ptr = Kpm + b * stride_kpm_b

    q = _load_tile(Q + b * stride_qb + h * stride_qh, rows, offs_d, stride_qm, stride_qd, n_q, head_dim, EVEN_M, EVEN_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_hi, hi = _key_split(start_m, n_k, CAUSAL, EVEN_N, BLOCK_M, BLOCK_N)
    # Key blocks every query sees whole: no causal or bounds mask (only padding, which may empty a row).
    acc, l_i, m_i = _fwd_key_loop(
        acc, l_i, m_i, q, k_ptr, v_ptr, kpm_ptr, rows, offs_n, offs_d, 0, full_hi,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_kpm_n, n_k, head_dim, qk_scale,
        False, True, HAS_KPM, HAS_KPM, EVEN_D, DOT_PRECISION, DOT_UPCAST, BLOCK_N,
    )  # fmt: skip
    if CAUSAL or not EVEN_N:
        # The diagonal band and the key tail. Causal keys past the block's last query are never visited.
        acc, l_i, m_i = _fwd_key_loop(
            acc, l_i, m_i, q, k_ptr, v_ptr, kpm_ptr, rows, offs_n, offs_d, full_hi, hi,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_kpm_n, n_k, head_dim, qk_scale,
            CAUSAL, EVEN_N, HAS_KPM, True, EVEN_D, DOT_PRECISION, DOT_UPCAST, BLOCK_N,
        )  # fmt: skip

    out, lse = _finish_softmax(m_i, l_i, acc)
    out_ptr = Out + b * stride_ob + h * stride_oh
    _store_tile(out_ptr, out, rows, offs_d, stride_om, stride_od, n_q, head_dim, EVEN_M, EVEN_D)
    lse_ptr = Lse + _stat_row(b, h, n_heads, stat_pieces) * n_q
    if EVEN_M:
        tl.store(lse_ptr + rows, lse)
    else:
        tl.store(lse_ptr + rows, lse, mask=rows < n_q)


_flash_fwd_tuned = autotuned("fwd", _flash_fwd)
