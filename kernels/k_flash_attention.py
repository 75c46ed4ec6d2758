"""Triton kernels of exact attention, FlashAttention-2 style (Dao, 2023, "FlashAttention-2: Faster Attention
with Better Parallelism and Work Partitioning", arXiv 2307.08691), after the Triton fused-attention tutorial.

Layout [batch, heads, seq, head_dim] addressed through strides (no contiguity required). The head-dim block
is the next power of two above head_dim, its extra columns loaded as zeros (they add nothing to q.k or p.v).

Forward: one program per (query block, batch*head); keys are streamed with the online softmax in base 2
(exp2 is a single instruction; logits are pre-multiplied by log2(e)). It stores out and the natural-log lse.
Backward: two kernels without atomics, as in FA2 and the tutorial: one program per key block accumulates
dK, dV over query blocks; one program per query block accumulates dQ over key blocks. Both recompute
P = exp(S - lse) and use dS = P * (dP - delta) where delta_i = rowsum(dO_i * O_i) - dlse_i carries the
gradient of lse (see docs/kernels.md).

Mask work only where a block needs it (the tutorial's STAGE split, FA2's EVEN_M/EVEN_N/EVEN_HEADDIM):
- EVEN_M / EVEN_N / EVEN_D (set by @triton.heuristics from the launch's sizes and blocks) drop the bounds
  masks of loads and stores when the sequence lengths are block multiples and head_dim == BLOCK_D.
- Each loop is split into blocks every pair of which takes part (no mask at all, apart from the key padding
  mask when there is one) and the rest: the causal diagonal band and the sequence tail, which get the
  masks. `_key_split` and `_query_split` hold the boundaries (causal is aligned top-left: key j is visible
  to query i iff j <= i, also when n_q != n_k).

Launch configurations live here, next to the kernels: autotuned on CUDA over CONFIGS (pruned to the
device's shared memory), one fixed 16 x 16 configuration under the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# ---- launch configurations -----------------------------------------------------------------------------

# The smallest legal blocks (tl.dot needs 16 along every dimension): the interpreter runs every program as
# numpy, so small tiles keep tests fast while short sequences still span several blocks.
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}


def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)


# Candidates for sm_80 / sm_90, per kernel. BLOCK_M is the query block, BLOCK_N the key block in all three.
# A 64-row tile on 8 warps leaves each warp fewer rows than one 16-row MMA, so 8 warps go with 128-row tiles.
# The forward keeps its per-program block (BLOCK_M) at least the streamed one, as the tutorial does; each
# backward kernel gets its larger block on the side it keeps resident (dK/dV: keys, dQ: queries), as the
# tutorial's BLOCK_N1 > BLOCK_M1 and BLOCK_M2 > BLOCK_N2, with 8 warps: the two fp32 accumulators of a
# 128 x 128 dK/dV tile alone would take 256 registers per thread on 4 warps.
# The first entry of each list is a fallback, tried only when no other fits the shared memory (fp32 with
# head dim 128, or a 99 KB sm_86/sm_89 part).
CONFIGS = {
    "fwd": [
        _config(32, 32, 4, 2),
        _config(64, 64, 4, 2), _config(64, 64, 4, 3), _config(64, 64, 4, 4),
        _config(128, 64, 4, 3), _config(128, 64, 4, 4), _config(128, 64, 8, 3),
        _config(128, 128, 8, 2), _config(128, 128, 8, 3),
    ],
    "bwd_dkdv": [
        _config(32, 32, 4, 2),
        _config(64, 64, 4, 2), _config(64, 64, 4, 3), _config(64, 128, 8, 2), _config(64, 128, 8, 3),
    ],
    "bwd_dq": [
        _config(32, 32, 4, 2),
        _config(64, 64, 4, 2), _config(64, 64, 4, 3), _config(128, 64, 8, 2), _config(128, 64, 8, 3),
    ],
}  # fmt: skip

# Shared memory per block by compute capability (bytes, the opt-in maximum), for when the device cannot
# be asked: sm_80 A100 163 KB, sm_86/sm_89 99 KB, sm_90 H100/H200 227 KB.
SHARED_MEMORY_BY_ARCH = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def shared_memory_estimate(kernel: str, cfg: dict[str, int], block_d: int, elem_bytes: int) -> int:
    """Bytes of shared memory a configuration needs, as Triton's software pipeliner lays it out: each tile
    the inner loop streams gets num_stages buffers, each tile kept for the whole program one. An upper
    bound: for sm_90 the compiler's figure for the forward and dQ kernels is this less the 1 KB allowance
    (head dim 128, bf16), the dK/dV kernel keeps one of K, V in registers, and sm_80 needs less.
    tests/test_kernels.py::test_kernels_compile_for_gpu checks the bound against the compiler."""
    block_m, block_n, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]
    if kernel == "fwd":  # streams K, V; keeps Q
        streamed, resident, row_stats = 2 * block_n * block_d, block_m * block_d, 0
    elif kernel == "bwd_dkdv":  # streams Q, dO and the fp32 lse, delta of the rows; keeps K, V
        streamed, resident, row_stats = 2 * block_m * block_d, 2 * block_n * block_d, 2 * 4 * block_m
    else:  # bwd_dq: streams K, V; keeps Q, dO
        streamed, resident, row_stats = 2 * block_n * block_d, 2 * block_m * block_d, 0
    barriers = 1024  # the pipeline's mbarriers and alignment, generously
    return stages * (streamed * elem_bytes + row_stats) + resident * elem_bytes + barriers


def prune_configs(
    kernel: str, configs: list[triton.Config], block_d: int, elem_bytes: int, shared_memory: int
) -> list[triton.Config]:
    """The candidates (all but the first entry) that fit `shared_memory` bytes at this head dim and dtype;
    the fallback (the first entry) when none does."""
    fits = [
        c for c in configs[1:]
        if shared_memory_estimate(kernel, {**c.kwargs, "num_stages": c.num_stages}, block_d, elem_bytes)
        <= shared_memory
    ]  # fmt: skip
    return fits or configs[:1]


def _device_shared_memory(device) -> float:
    """The opt-in shared memory per block of a CUDA device; no limit elsewhere (the interpreter)."""
    import torch

    if device.type != "cuda":
        return float("inf")
    props = torch.cuda.get_device_properties(device)
    fallback = SHARED_MEMORY_BY_ARCH.get(props.major * 10 + props.minor, 99 * 1024)
    return getattr(props, "shared_memory_per_block_optin", fallback)


def _early_prune(kernel: str):
    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        q = named_args["Q"]
        return prune_configs(kernel, configs, kwargs["BLOCK_D"], q.element_size(), _device_shared_memory(q.device))

    return prune


# Tuning is keyed on the sequence lengths rounded up to a power of two (the n_q_key, n_k_key arguments,
# which only the tuner reads), so variable-length batches reuse one tuning per octave; the tuner appends
# the dtypes of the tensor arguments to the key itself.
AUTOTUNE_KEY = ["n_q_key", "n_k_key", "head_dim", "CAUSAL"]


def autotuned(kernel: str, fn, configs: list[triton.Config] | None = None, do_bench=None):
    """`fn` behind triton.autotune over CONFIGS[kernel] (or `configs`), pruned to the device's shared
    memory. `do_bench` replaces Triton's timer (tests use it to run the tuner's code path without a GPU)."""
    # No reset_to_zero / restore_value: every output (Out, Lse, DK, DV, DQ) is written in full by each run,
    # never accumulated into, so re-running a kernel while tuning leaves the right result.
    return triton.autotune(
        CONFIGS[kernel] if configs is None else configs, key=AUTOTUNE_KEY,
        prune_configs_by={"early_config_prune": _early_prune(kernel)}, do_bench=do_bench,
    )(fn)  # fmt: skip


_EVEN_SIZES = {
    "EVEN_M": lambda args: args["n_q"] % args["BLOCK_M"] == 0,
    "EVEN_N": lambda args: args["n_k"] % args["BLOCK_N"] == 0,
    "EVEN_D": lambda args: args["head_dim"] == args["BLOCK_D"],
}

# ---- helpers shared with k_chunked_attention.py --------------------------------------------------------


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


# ---- forward -------------------------------------------------------------------------------------------


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
    n_heads, n_q, n_k, head_dim, qk_scale, n_q_key, n_k_key,
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
    if EVEN_M:
        tl.store(Lse + pid_bh.to(tl.int64) * n_q + rows, lse)
    else:
        tl.store(Lse + pid_bh.to(tl.int64) * n_q + rows, lse, mask=rows < n_q)


# ---- backward ------------------------------------------------------------------------------------------


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
    n_heads, n_q, n_k, head_dim, qk_scale, sm_scale, n_q_key, n_k_key,
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
    lse_ptr = Lse + pid_bh.to(tl.int64) * n_q
    delta_ptr = Delta + pid_bh.to(tl.int64) * n_q

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
    n_heads, n_q, n_k, head_dim, qk_scale, sm_scale, n_q_key, n_k_key,
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
    row_stats = pid_bh.to(tl.int64) * n_q
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
_flash_fwd_tuned = autotuned("fwd", _flash_fwd)
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
