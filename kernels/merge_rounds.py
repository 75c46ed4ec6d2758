"""Attention parts merged by their log-sum-exp on the Triton kernels of k_merge_rounds.py: the values of
models/attention/lse.py `merge_lse_many` (the rounds of Reformer's LSH attention) in one launch forward and one
backward instead of about 30 PyTorch ops.

`merge_rounds(out [P.., R, M, E], lse [P.., R, M], dim)` merges along `dim` of lse (out has one more trailing
feature axis), as `merge_lse_many`; inputs are made contiguous, lse is taken in fp32 (the kernels' lse dtype) and
the merged lse returned in lse's dtype; merged heads come out token-major (`merge_rounds`). Inside
`kernels.dispatch.stand_in_kernels()` the launches are counted and the buffers allocated as on a GPU
(kernels/stand_in.py).
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


def _slice_strides(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """x [Po, Pi, M, E] with its feature axis contiguous (else a contiguous copy), and the kernels' (n_inner,
    stride_po, stride_pi, stride_pm) of it."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, (x.shape[1], x.stride(0), x.stride(1), x.stride(2))


class _MergeRounds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_PRME, lse_PRM, inner):  # type: ignore[override]
        P, R, M, E = out_PRME.shape
        log = stand_in.active()
        with stand_in.kernel_region(log):
            # [P / inner, inner, M, E] laid out [P / inner, M, inner, E]: with inner = H, a layer's token-major heads.
            merged = torch.empty(P // inner, M, inner, E, device=out_PRME.device, dtype=out_PRME.dtype).transpose(1, 2)
            lse_PM = torch.empty(P, M, device=out_PRME.device, dtype=torch.float32)
            weight_PRM = torch.empty(P, R, M, device=out_PRME.device, dtype=torch.float32)
            _, layout = _slice_strides(merged)
            _launch("merge_rounds_fwd", "_merge_rounds_fwd", M, P,
                    (out_PRME, lse_PRM, merged, lse_PM, weight_PRM, M, E, *layout),
                    R=R, BLOCK_E=max(16, next_power_of_two(E)))
        ctx.save_for_backward(out_PRME, weight_PRM)
        ctx.inner = inner
        ctx.set_materialize_grads(False)  # an unused merged lse (LSH's layer) takes no gradient: no zeros made
        return merged, lse_PM

    @staticmethod
    @once_differentiable
    def backward(ctx, g_merged, g_lse_PM):  # type: ignore[override]
        out_PRME, weight_PRM = ctx.saved_tensors
        P, R, M, E = out_PRME.shape
        if g_merged is None:  # only the merged lse was used
            g_merged = torch.zeros(P // ctx.inner, ctx.inner, M, E, device=out_PRME.device, dtype=out_PRME.dtype)
        g_merged, layout = _slice_strides(g_merged)  # read in its own layout (the output projection's: no copy)
        log = stand_in.active()
        with stand_in.kernel_region(log):
            g_out_PRME = torch.empty_like(out_PRME)
            g_lse_PRM = torch.empty(P, R, M, device=out_PRME.device, dtype=torch.float32)
            has_g_lse = g_lse_PM is not None
            _launch("merge_rounds_bwd", "_merge_rounds_bwd", M, P,
                    (g_merged, g_lse_PM.contiguous() if has_g_lse else g_merged, out_PRME,
                     weight_PRM, g_out_PRME, g_lse_PRM, M, E, *layout),
                    HAS_G_LSE=has_g_lse, R=R, BLOCK_E=max(16, next_power_of_two(E)))
        return g_out_PRME, g_lse_PRM, None


def merge_rounds(out_RM: torch.Tensor, lse_R: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse_many(out_RM, lse_R, dim)` on the kernels: (merged out, merged lse), `dim` dropped. With two dims
    before `dim` and one after (LSH's [B, H, R, T]) the merged out [B, H, T, E] is laid out [B, T, H, E], the
    layout of a layer's projections, which the output projection then reads as it is."""
    dim = dim % lse_R.dim()
    if out_RM.shape[:-1] != lse_R.shape:
        raise ValueError(f"out must be lse's shape with a feature axis after it; got {tuple(out_RM.shape)} and "
                         f"{tuple(lse_R.shape)}")
    lead, R, rest = lse_R.shape[:dim], lse_R.shape[dim], lse_R.shape[dim + 1:]
    P, M, E = math.prod(lead), math.prod(rest), out_RM.shape[-1]
    inner = lead[1] if len(lead) == 2 and len(rest) == 1 else 1  # heads: token-major
    merged, lse_PM = _MergeRounds.apply(out_RM.contiguous().view(P, R, M, E),
                                        lse_R.to(torch.float32).contiguous().view(P, R, M), inner)
    return merged.view(*lead, *rest, E), lse_PM.view(*lead, *rest).to(lse_R.dtype)


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
