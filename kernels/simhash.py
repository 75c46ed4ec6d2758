"""HyperAttention's bucket ranks on the Triton kernel of k_simhash.py: models/attention/hyper.py `bucket_rank`'s
Gray ranks of the SimHash codes, with no projection or bit tensor written to memory. Ranks are integers and
nothing differentiates through them (the sort they feed is not differentiable), so this is a plain function, not an
autograd.Function; under `kernels.dispatch.stand_in_kernels()` its one launch is counted, not run, and its output
allocated as the kernel's (kernels/stand_in.py).
"""

from __future__ import annotations

import torch

from kernels import stand_in
from kernels.flash_attention import (
    cdiv,
    check_triton_inputs,
    dot_options,
    interpreter_enabled,
    jit_module,
    next_power_of_two,
    strides,
)

MAX_BITS = 30
"""The kernel weights a code's bits in int32, so at most 30 of them (models/attention/hyper.py MAX_LSH_BITS, the
config's bound, is this one)."""


def simhash_rank(x_BHTE: torch.Tensor, hyperplanes_ER: torch.Tensor) -> torch.Tensor:
    """Gray ranks [B, H, T] (int64) of the SimHash codes of x [B, H, T, E] under hyperplanes [E, r]: bit j set
    where x's product with hyperplane j, rounded to x's dtype, is positive, and the code's place along the
    reflected Gray sequence (`gray_rank`)."""
    check_triton_inputs(x_BHTE, x_BHTE, x_BHTE)  # what every kernel of the package takes: layout, dtype, head dim
    B, H, T, E = x_BHTE.shape
    if hyperplanes_ER.dim() != 2 or hyperplanes_ER.shape[0] != E or not 1 <= hyperplanes_ER.shape[1] <= MAX_BITS:
        raise ValueError(f"hyperplanes must be [E, r] with x's {E} features and 1 <= r <= {MAX_BITS}; got "
                         f"{tuple(hyperplanes_ER.shape)}")
    bits = hyperplanes_ER.shape[1]
    # In x's dtype, as `x @ hyperplanes.to(x.dtype)` multiplies them (torch's rounding; [E, r] is small).
    hyperplanes_ER = hyperplanes_ER.to(x_BHTE.dtype)
    log = stand_in.active()
    with stand_in.kernel_region(log):  # the ranks are the kernel's own output, not glue
        rank_BHT = torch.empty(B, H, T, device=x_BHTE.device, dtype=torch.int64)
        from kernels import k_simhash

        kern = jit_module(k_simhash)
        cfg = kern.launch_config(interpreter_enabled())
        grid = (cdiv(T, cfg["BLOCK_T"]), B * H)
        stand_in.launch("simhash_rank", lambda: kern._simhash_rank[grid](
            x_BHTE, hyperplanes_ER, rank_BHT,
            *strides(x_BHTE), *strides(hyperplanes_ER), *strides(rank_BHT),
            H, T, E, bits,
            BLOCK_E=max(16, next_power_of_two(E)), BLOCK_R=max(16, next_power_of_two(bits)),
            ROUND_TO_INPUT=x_BHTE.dtype != torch.float32, **dot_options(x_BHTE.dtype), **cfg,
        ))  # fmt: skip
    return rank_BHT
