"""Joining attention parts through their log-sum-exp.

Reformer's hash rounds and HyperAttention's block-diagonal + sampled parts are each an exact softmax over a
subset of the keys. A part returns its normalised output and the row-wise natural-log sum of exponentials of
its scaled logits (as FlashAttention-2 keeps it: Dao, 2023, arXiv 2307.08691); parts over disjoint key sets then
combine exactly, which `merge_lse` does. Everything is differentiable, the LSE included (the official
HyperAttention code detaches it; we do not).

The parts themselves come from ONE exact-attention entry point, `kernels.exact_attention` (and its chunked
variant for sorted sequences, `kernels.chunked_attention`), re-exported here: Triton kernels on CUDA, the
PyTorch reference elsewhere, both returning (out, lse) with fully masked rows giving zeros and lse = -inf.
"""

from __future__ import annotations

import torch

from kernels import chunked_attention, exact_attention
from kernels.reference import SELF_LOGIT

__all__ = ["SELF_LOGIT", "chunked_attention", "exact_attention", "merge_lse", "merge_lse_many", "merge_lse_reference"]


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: fp32 for half types, fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _safe_max(lse_a: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    m = torch.maximum(lse_a, lse_b).detach()  # a shift, so its gradient is irrelevant
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


class _MergeLse(torch.autograd.Function):
    """`merge_lse` with its accumulator written in place and a backward of its own.

    The forward runs the same operations on the same values as the plain PyTorch expression (so its outputs are
    bitwise those of `merge_lse_reference`), but makes one accumulation-precision copy of each part instead of
    autograd's saved copies and products, and saves only the two parts and their [..., M] weights. The backward
    gives the parts' gradients bitwise as autograd does (g * weight, rounded to the part's dtype); the lse
    gradients come from the closed form d lse / d lse_a = alpha, d alpha / d lse_a = alpha (1 - alpha), whose
    float rounding differs from autograd's chain through exp, div and log by a few ulps.
    """

    @staticmethod
    def forward(ctx, out_a, lse_a, out_b, lse_b):  # type: ignore[override]
        m = _safe_max(lse_a, lse_b)
        w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
        total = w_a + w_b
        has_keys = total > 0
        total_safe = torch.where(has_keys, total, torch.ones_like(total))
        lse = torch.where(has_keys, m + torch.log(total_safe), torch.full_like(total, float("-inf")))
        alpha, beta = w_a / total_safe, w_b / total_safe
        acc = torch.promote_types(torch.promote_types(out_a.dtype, torch.float32), alpha.dtype)
        out = out_a.to(acc, copy=True).mul_(alpha[..., None])
        out.add_(out_b.to(acc, copy=True).mul_(beta[..., None]))
        ctx.save_for_backward(out_a, out_b, alpha, beta)
        return out.to(out_a.dtype), lse

    @staticmethod
    def backward(ctx, g_out, g_lse):  # type: ignore[override]
        out_a, out_b, alpha, beta = ctx.saved_tensors
        acc = torch.promote_types(torch.promote_types(out_a.dtype, torch.float32), alpha.dtype)
        g_acc = g_out.to(acc)
        g_out_a = (g_acc * alpha[..., None]).to(out_a.dtype)
        g_out_b = (g_acc * beta[..., None]).to(out_b.dtype)
        g_alpha = (g_acc * out_a.to(acc)).sum(-1)
        g_beta = (g_acc * out_b.to(acc)).sum(-1)
        g_lse = torch.zeros_like(alpha) if g_lse is None else g_lse.to(alpha.dtype)
        # out = A alpha + B beta, lse = log(e^lse_a + e^lse_b): d/d lse_a = alpha (g_alpha + g_lse - s), with
        # s = alpha g_alpha + beta g_beta; a part without keys has weight 0 and gets no gradient.
        shared = alpha * g_alpha + beta * g_beta
        g_lse_a = alpha * (g_alpha + g_lse - shared)
        g_lse_b = beta * (g_beta + g_lse - shared)
        return g_out_a, g_lse_a.to(alpha.dtype), g_out_b, g_lse_b.to(alpha.dtype)


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Join two attention parts over disjoint key sets: out [..., M, D], lse [..., M].

    out = (out_a e^lse_a + out_b e^lse_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b), which is exact
    attention over the union of the two key sets. A part with lse = -inf (no keys) has weight 0; when both have
    none the result is zeros and -inf, with finite gradients. Outputs bitwise those of `merge_lse_reference`, in
    fewer bytes (`_MergeLse`).
    """
    return _MergeLse.apply(out_a, lse_a, out_b, lse_b)


def merge_lse_reference(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse` as one autograd expression: the reference its tests compare against."""
    m = _safe_max(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    has_keys = total > 0
    total_safe = torch.where(has_keys, total, torch.ones_like(total))
    lse = torch.where(has_keys, m + torch.log(total_safe), torch.full_like(total, float("-inf")))
    out = _acc(out_a) * (w_a / total_safe)[..., None] + _acc(out_b) * (w_b / total_safe)[..., None]
    return out.to(out_a.dtype), lse


def merge_lse_many(out_RM: torch.Tensor, lse_R: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse` over a whole axis `dim` of lse (out has one more trailing feature axis): Reformer's rounds."""
    m = lse_R.detach().amax(dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_R - m)
    total = w.sum(dim, keepdim=True)
    has_keys = total > 0
    total_safe = torch.where(has_keys, total, torch.ones_like(total))
    out = (_acc(out_RM) * (w / total_safe).unsqueeze(-1)).sum(dim)
    lse = torch.where(has_keys, m + torch.log(total_safe), torch.full_like(total, float("-inf"))).squeeze(dim)
    return out.to(out_RM.dtype), lse
