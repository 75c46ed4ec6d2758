"""Angular LSH bucket ids on the Triton kernel of k_lsh_hash.py: the ids of models/attention/lsh.py
`angular_argmax` over the projections xR, with no projection written to memory.

The ids take no gradient, so there is no backward. Inside `kernels.dispatch.stand_in_kernels()` the launch is
counted and the ids buffer allocated as on a GPU (kernels/stand_in.py).
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


def angular_hash(k_BHTE: torch.Tensor, rot_HREN: torch.Tensor, half_B: torch.Tensor | None = None) -> torch.Tensor:
    """Bucket ids [B, H, R, T] (int64) of keys k [B, H, T, E] under rotations R [H, R, E, n_half]: per token and
    round, argmax over [k R; -k R] restricted to the row's first half_B[b] columns (column c of -kR is bucket
    half_B[b] + c); without half_B every row uses all n_half columns (no count tensor to make: a launch fewer).
    The products are rounded to k's dtype before they are compared, as a matmul in that dtype rounds its
    output."""
    check_triton_inputs(k_BHTE, k_BHTE, k_BHTE)  # what every kernel of the package takes: layout, dtype, head dim
    B, H, T, E = k_BHTE.shape
    if rot_HREN.dim() != 4 or rot_HREN.shape[0] != H or rot_HREN.shape[2] != E:
        raise ValueError(f"rotations must be [H, R, E, N] with k's {H} heads of {E} features; got "
                         f"{tuple(rot_HREN.shape)}")
    if half_B is not None and half_B.shape != (B,):
        raise ValueError(f"half_B must hold one half count per batch row ({B}); got {tuple(half_B.shape)}")
    n_rounds, n_half = rot_HREN.shape[1], rot_HREN.shape[3]
    rot_HREN = rot_HREN.to(k_BHTE.dtype)  # the rotation as the matmul would see it: [R, E, N] per head, small
    per_row = half_B is not None
    half_B = half_B.to(device=k_BHTE.device, dtype=torch.int32) if per_row else rot_HREN  # a pointer never read
    log = stand_in.active()
    with stand_in.kernel_region(log):  # the ids are the kernel's own output, not glue
        ids_BHRT = torch.empty(B, H, n_rounds, T, device=k_BHTE.device, dtype=torch.int64)
        from kernels import k_lsh_hash

        kern = jit_module(k_lsh_hash)
        cfg = kern.launch_config(interpreter_enabled())
        grid = (cdiv(T, cfg["BLOCK_T"]), B * H * n_rounds)
        stand_in.launch("lsh_hash", lambda: kern._angular_hash[grid](
            k_BHTE, rot_HREN, half_B, ids_BHRT,
            *strides(k_BHTE), *strides(rot_HREN), *strides(ids_BHRT),
            H, n_rounds, T, E, n_half,
            BLOCK_E=max(16, next_power_of_two(E)), HALF_PER_ROW=per_row, ROUND_TO_INPUT=k_BHTE.dtype != torch.float32,
            **dot_options(k_BHTE.dtype), **cfg,
        ))  # fmt: skip
    return ids_BHRT
