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

The kernels live in four modules, gathered here so that callers (kernels/flash_attention.py, the tests) find
every kernel and its launch configuration in one place: k_flash_configs.py (launch configurations),
k_flash_tiles.py (the @triton.jit building blocks and loop boundaries), k_flash_forward.py and
k_flash_backward.py.
"""

from kernels.k_flash_backward import (
    _bwd_delta,
    _flash_bwd_dkdv,
    _flash_bwd_dkdv_tuned,
    _flash_bwd_dq,
    _flash_bwd_dq_tuned,
)
from kernels.k_flash_configs import (
    AUTOTUNE_KEY,
    CONFIGS,
    INTERPRETER_CONFIG,
    SHARED_MEMORY_BY_ARCH,
    autotuned,
    prune_configs,
    shared_memory_estimate,
)
from kernels.k_flash_forward import _flash_fwd, _flash_fwd_tuned
from kernels.k_flash_tiles import LN2, LOG2E, _key_split, _query_split

__all__ = [
    "AUTOTUNE_KEY", "CONFIGS", "INTERPRETER_CONFIG", "LN2", "LOG2E", "SHARED_MEMORY_BY_ARCH", "autotuned",
    "prune_configs", "shared_memory_estimate", "_bwd_delta", "_flash_bwd_dkdv", "_flash_bwd_dkdv_tuned",
    "_flash_bwd_dq", "_flash_bwd_dq_tuned", "_flash_fwd", "_flash_fwd_tuned", "_key_split", "_query_split",
]
