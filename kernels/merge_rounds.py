"""Attention parts merged by their log-sum-exp on the Triton kernels of k_merge_rounds.py: the values of
models/attention/lse.py `merge_lse_many` (the rounds of Reformer's LSH attention) in one launch forward and one
backward instead of about 30 PyTorch ops.

`merge_rounds(out [P.., R, M, E], lse [P.., R, M], dim)` merges along `dim` of lse (out has one more trailing
feature axis), as `merge_lse_many`; inputs are made contiguous, lse is taken in fp32 (the kernels' lse dtype) and
the merged lse returned in lse's dtype. Inside `kernels.dispatch.stand_in_kernels()` the launches are counted and
the buffers allocated as on a GPU (kernels/stand_in.py).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from kernels import stand_in
from kernels.flash_attention import cdiv, interpreter_enabled, jit_module, next_power_of_two


def _launch(name: str, kernel_name: str, rows: int, slices: int, args: tuple, halves: int | None = None,
            **constexprs) -> None:
    from kernels import k_merge_rounds

    kern = jit_module(k_merge_rounds)
    cfg = kern.launch_config(interpreter_enabled())
    grid = (cdiv(rows, cfg["BLOCK_M"]), slices) + ((halves,) if halves else ())
    stand_in.launch(name, lambda: getattr(kern, kernel_name)[grid](*args, **constexprs, **cfg))


class _MergeRounds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_PRME, lse_PRM):  # type: ignore[override]
        P, R, M, E = out_PRME.shape
        log = stand_in.active()
        with stand_in.kernel_region(log):
            merged_PME = torch.empty(P, M, E, device=out_PRME.device, dtype=out_PRME.dtype)
            lse_PM = torch.empty(P, M, device=out_PRME.device, dtype=torch.float32)
            weight_PRM = torch.empty(P, R, M, device=out_PRME.device, dtype=torch.float32)
            _launch("merge_rounds_fwd", "_merge_rounds_fwd", M, P,
                    (out_PRME, lse_PRM, merged_PME, lse_PM, weight_PRM, M, E),
                    R=R, BLOCK_E=max(16, next_power_of_two(E)))
        ctx.save_for_backward(out_PRME, weight_PRM)
        ctx.set_materialize_grads(False)  # an unused merged lse (LSH's layer) takes no gradient: no zeros made
        return merged_PME, lse_PM

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out_PME, g_lse_PM):  # type: ignore[override]
        out_PRME, weight_PRM = ctx.saved_tensors
        P, R, M, E = out_PRME.shape
        if g_out_PME is None:  # only the merged lse was used
            g_out_PME = torch.zeros(P, M, E, device=out_PRME.device, dtype=out_PRME.dtype)
        log = stand_in.active()
        with stand_in.kernel_region(log):
            g_out_PRME = torch.empty_like(out_PRME)
            g_lse_PRM = torch.empty(P, R, M, device=out_PRME.device, dtype=torch.float32)
            has_g_lse = g_lse_PM is not None
            _launch("merge_rounds_bwd", "_merge_rounds_bwd", M, P,
                    (g_out_PME.contiguous(), g_lse_PM.contiguous() if has_g_lse else g_out_PME, out_PRME,
                     weight_PRM, g_out_PRME, g_lse_PRM, M, E),
                    HAS_G_LSE=has_g_lse, R=R, BLOCK_E=max(16, next_power_of_two(E)))
        return g_out_PRME, g_lse_PRM


def merge_rounds(out_RM: torch.Tensor, lse_R: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse_many(out_RM, lse_R, dim)` on the kernels: (merged out, merged lse), `dim` dropped."""
    dim = dim % lse_R.dim()
    if out_RM.shape[:-1] != lse_R.shape:
        raise ValueError(f"out must be lse's shape with a feature axis after it; got {tuple(out_RM.shape)} and "
                         f"{tuple(lse_R.shape)}")
    lead, R, rest = lse_R.shape[:dim], lse_R.shape[dim], lse_R.shape[dim + 1:]
    P, M, E = math.prod(lead), math.prod(rest), out_RM.shape[-1]
    merged_PME, lse_PM = _MergeRounds.apply(out_RM.contiguous().view(P, R, M, E),
                                            lse_R.to(torch.float32).contiguous().view(P, R, M))
    return merged_PME.view(*lead, *rest, E), lse_PM.view(*lead, *rest).to(lse_R.dtype)


class _MergeBelow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_a, lse_a, out_b, lse_b):  # type: ignore[override]
        B, H, h, E = out_b.shape
        log = stand_in.active()
        with stand_in.kernel_region(log):
            out = torch.empty(B, H, 2 * h, E, device=out_b.device, dtype=out_a.dtype)
            lse = torch.empty(B, H, 2 * h, device=out_b.device, dtype=torch.float32)
            alpha, beta = (torch.empty(B, H, h, device=out_b.device, dtype=torch.float32) for _ in range(2))
            _launch("merge_below_fwd", "_merge_below_fwd", h, B * H,
                    (out_a, lse_a, out_b, lse_b, out, lse, alpha, beta, B * H, h, E),
                    halves=2, BLOCK_E=max(16, next_power_of_two(E)))
        ctx.save_for_backward(out_a, out_b, alpha, beta)
        ctx.set_materialize_grads(False)  # an unused output takes no gradient: no zeros made
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out, g_lse):  # type: ignore[override]
        out_a, out_b, alpha, beta = ctx.saved_tensors
        B, H, h, E = out_b.shape
        if g_out is None:  # only the joined lse was used
            g_out = torch.zeros(B, H, 2 * h, E, device=out_b.device, dtype=out_a.dtype)
        log = stand_in.active()
        with stand_in.kernel_region(log):
            g_out_a, g_out_b = torch.empty_like(out_a), torch.empty_like(out_b)
            g_lse_a = torch.empty(2 * B, H, h, device=out_b.device, dtype=torch.float32)
            g_lse_b = torch.empty(B, H, h, device=out_b.device, dtype=torch.float32)
            has_g_lse = g_lse is not None
            _launch("merge_below_bwd", "_merge_below_bwd", h, B * H,
                    (g_out.contiguous(), g_lse.contiguous() if has_g_lse else g_out, out_a, out_b, alpha, beta,
                     g_out_a, g_lse_a, g_out_b, g_lse_b, B * H, h, E),
                    halves=2, HAS_G_LSE=has_g_lse, BLOCK_E=max(16, next_power_of_two(E)))
        return g_out_a, g_lse_a, g_out_b, g_lse_b


def merge_below(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse_below(out_a [2B, H, h, E], lse_a [2B, H, h], out_b [B, H, h, E], lse_b [B, H, h])` on the kernels:
    (out [B, H, 2h, E], lse [B, H, 2h]), HyperAttention's causal level in one launch each way."""
    B, H, h, E = out_b.shape
    if out_a.shape != (2 * B, H, h, E) or lse_a.shape != (2 * B, H, h) or lse_b.shape != (B, H, h):
        raise ValueError(f"merge_below takes out_a [2B, H, h, E], lse_a [2B, H, h], out_b [B, H, h, E], lse_b "
                         f"[B, H, h]; got {tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, "
                         f"{tuple(lse_b.shape)}")
    out, lse = _MergeBelow.apply(out_a.contiguous(), lse_a.to(torch.float32).contiguous(), out_b.contiguous(),
                                 lse_b.to(torch.float32).contiguous())
    return out, lse.to(lse_a.dtype)
