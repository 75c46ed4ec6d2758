"""Launch configurations of the exact-attention kernels (k_flash_forward.py, k_flash_backward.py): the
autotune candidates on CUDA, pruned to the device's shared memory, and the one fixed 16 x 16 configuration
under the interpreter; and the EVEN_* heuristics every kernel is compiled with. The design is in
k_flash_attention.py."""

from __future__ import annotations

import triton

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
    (head dim 128, bf16), and sm_80 needs less. The dK/dV kernel counts one more [BLOCK_N, BLOCK_M] tile: on sm_90
    Triton 3.6 (torch 2.11's) needs up to this less the 1 KB allowance, 7-14.5 KB more than the count without
    that tile (every configuration of 64 rows or more, head dims 64 and 128, bf16); Triton 3.9 needs 7-50 KB less
    than this.
    tests/test_kernels.py::test_kernels_compile_for_gpu checks the bound against the compiler."""
    block_m, block_n, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]
    if kernel == "fwd":  # streams K, V; keeps Q
        streamed, resident, row_stats = 2 * block_n * block_d, block_m * block_d, 0
    elif kernel == "bwd_dkdv":  # streams Q, dO and the fp32 lse, delta of the rows; keeps K, V and P^T or dS^T
        streamed, row_stats = 2 * block_m * block_d, 2 * 4 * block_m
        # Triton 3.6 stages P^T / dS^T for Hopper's warpgroup matmuls, which it uses from 64 rows on.
        resident = 2 * block_n * block_d + (block_n * block_m if block_m >= 64 else 0)
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
