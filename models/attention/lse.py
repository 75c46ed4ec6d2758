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
from torch.autograd.function import once_differentiable

from kernels import chunked_attention, exact_attention
from kernels.reference import SELF_LOGIT

__all__ = ["SELF_LOGIT", "chunked_attention", "exact_attention", "merge_lse", "merge_lse_below", "merge_lse_many",
           "merge_lse_many_reference", "merge_lse_reference"]


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: fp32 for half types, fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _safe_max(lse_a: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    m = torch.maximum(lse_a, lse_b).detach()  # a shift, so its gradient is irrelevant
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alpha, beta, lse) of two parts: out = out_a alpha + out_b beta, as `merge_lse_reference` computes them."""
    m = _safe_max(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    has_keys = total > 0
    total_safe = torch.where(has_keys, total, torch.ones_like(total))
    lse = torch.where(has_keys, m + torch.log(total_safe), torch.full_like(total, float("-inf")))
    return w_a / total_safe, w_b / total_safe, lse


# IN_PLACE_UNDER_COMPILE: under torch.compile the forwards below accumulate out of place, the same operations in
# the same order (so the same values), and return their result without a no-op `.to()`. torch 2.11's dynamo gave
# every input of the Function a zero gradient when its forward added in place into a product it had made, or
# returned such a product through `.to()` of its own dtype (an alias of it); torch 2.13 does neither
# (tests/test_compile_families.py, run with torch 2.11). Under the compiler, the buffer the in-place form saves is
# the compiler's to plan.


def _in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, but `x` itself where it already has that dtype (IN_PLACE_UNDER_COMPILE)."""
    return x if x.dtype == dtype else x.to(dtype)


class _MergeLse(torch.autograd.Function):
    """`merge_lse` with its accumulator written in place and a backward of its own; with `stacked`, out_a holds
    2B rows (B passed through, then the B rows merged with out_b) and the result is the two along the row axis.

    The forward runs the same operations on the same values as `merge_lse_reference` (outputs bitwise equal; a
    bf16 x fp32 product computes in fp32, as the reference's fp32 copy does), with one fp32 buffer and saves only
    the parts and their [..., M] weights, where autograd saves fp32 copies and products. The backward gives the
    parts' gradients bitwise as autograd (g * weight, rounded to the part's dtype); the lse gradients come from the
    closed form d lse / d lse_a = alpha, d alpha / d lse_a = alpha (1 - alpha), whose float rounding differs from
    autograd's chain through exp, div and log by a few ulps.
    """

    @staticmethod
    def forward(ctx, out_a, lse_a, out_b, lse_b, stacked: bool):  # type: ignore[override]
        B = out_b.shape[0]
        a, la = (out_a[B:], lse_a[B:]) if stacked else (out_a, lse_a)
        alpha, beta, lse = _weights(la, lse_b)
        acc = torch.promote_types(torch.promote_types(out_a.dtype, torch.float32), alpha.dtype)
        alpha_acc, beta_acc = alpha.to(acc), beta.to(acc)
        merged = a * alpha_acc[..., None]  # [..., M, D] in acc
        if torch.compiler.is_compiling():  # the same sum out of place: IN_PLACE_UNDER_COMPILE
            merged = merged + out_b * beta_acc[..., None]
        else:
            merged.add_(out_b * beta_acc[..., None])
        ctx.save_for_backward(a, out_b, alpha_acc, beta_acc)
        ctx.stacked, ctx.lse_dtype = stacked, alpha.dtype
        if not stacked:
            return _in_dtype(merged, out_a.dtype), lse
        M = a.shape[-2]
        out = out_a.new_empty(*a.shape[:-2], 2 * M, a.shape[-1])
        out[..., :M, :].copy_(out_a[:B])
        out[..., M:, :].copy_(merged)  # the cast .to(out_a.dtype) would make, written in place
        return out, torch.cat([lse_a[:B], lse], dim=-1)

    @staticmethod
    @once_differentiable  # the backward writes into out= buffers: a second derivative raises instead of being wrong
    def backward(ctx, g_out, g_lse):  # type: ignore[override]
        a, b, alpha, beta = ctx.saved_tensors
        M = a.shape[-2]
        if ctx.stacked:
            g_top, g_out, g_lse_top, g_lse = g_out[..., :M, :], g_out[..., M:, :], g_lse[..., :M], g_lse[..., M:]
        g_acc = g_out.to(alpha.dtype)
        product = g_acc * a  # one buffer for both products: the weights' gradients are row sums of them
        g_alpha = product.sum(-1)
        g_beta = torch.mul(g_acc, b, out=product).sum(-1)
        # out = A alpha + B beta, lse = log(e^lse_a + e^lse_b): d/d lse_a = alpha (g_alpha + g_lse - s), with
        # s = alpha g_alpha + beta g_beta; a part without keys has weight 0 and gets no gradient.
        g_lse = g_lse.to(alpha.dtype)
        shared = alpha * g_alpha + beta * g_beta
        g_lse_a = (alpha * (g_alpha + g_lse - shared)).to(ctx.lse_dtype)
        g_lse_b = (beta * (g_beta + g_lse - shared)).to(ctx.lse_dtype)
        # g * weight computed in acc and rounded once into the part's dtype, as (g * weight).to(dtype) would.
        g_b = torch.mul(g_acc, beta[..., None], out=torch.empty_like(b))
        B = a.shape[0]
        g_out_a = a.new_empty(2 * B, *a.shape[1:]) if ctx.stacked else torch.empty_like(a)
        torch.mul(g_acc, alpha[..., None], out=g_out_a[B:] if ctx.stacked else g_out_a)
        if not ctx.stacked:
            return g_out_a, g_lse_a, g_b, g_lse_b, None
        g_out_a[:B].copy_(g_top)
        return g_out_a, torch.cat([g_lse_top.to(ctx.lse_dtype), g_lse_a]), g_b, g_lse_b, None


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Join two attention parts over disjoint key sets: out [..., M, D], lse [..., M].

    out = (out_a e^lse_a + out_b e^lse_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b), which is exact
    attention over the union of the two key sets. A part with lse = -inf (no keys) has weight 0; when both have
    none the result is zeros and -inf, with finite gradients. Outputs bitwise those of `merge_lse_reference`, in
    fewer bytes (`_MergeLse`).
    """
    return _MergeLse.apply(out_a, lse_a, out_b, lse_b, False)


def merge_lse_below(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out_a [2B, ..., M, D], lse_a [2B, ..., M]: rows :B, then `merge_lse` of rows B: with out_b [B, ..., M, D],
    joined along the row axis: ([B, ..., 2M, D], [B, ..., 2M]). HyperAttention's causal level (the diagonal halves
    batched as 2B rows, the second half merged with the off-diagonal block) in one output buffer, without the
    slices, cat and gradient stacks the same expression makes through autograd."""
    return _MergeLse.apply(out_a, lse_a, out_b, lse_b, True)


def merge_lse_reference(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse` as one autograd expression: the reference its tests compare against (autograd's chain through
    the weights, where `merge_lse`'s backward has a closed form)."""
    alpha, beta, lse = _weights(lse_a, lse_b)
    out = _acc(out_a) * alpha[..., None] + _acc(out_b) * beta[..., None]
    return out.to(out_a.dtype), lse


def _round_weights(lse_R: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [.. R ..], lse with `dim` dropped) of parts along `dim`: weight_r = e^(lse_r - lse), lse = log sum_r
    e^lse_r, shifted by the largest finite lse; a row whose parts all have lse = -inf gets weights 0 and -inf."""
    m = lse_R.detach().amax(dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_R - m)
    total = w.sum(dim, keepdim=True)
    has_keys = total > 0
    total_safe = torch.where(has_keys, total, torch.ones_like(total))
    lse = torch.where(has_keys, m + torch.log(total_safe), torch.full_like(total, float("-inf"))).squeeze(dim)
    return w / total_safe, lse


class _MergeLseMany(torch.autograd.Function):
    """`merge_lse_many` with one accumulator of the merged rows written in place, saving the parts and their [..]
    weights: `merge_lse_many_reference` makes an fp32 copy of every part and of every weighted part ([.., R, .., M,
    D] each, Reformer's rounds at 4 rounds: 5.2 GiB of a 64k-token layer's glue) and autograd keeps them.

    The forward sums the weighted parts in order, r = 0, 1, ... (the reference's sum over the axis, in the float
    rounding of that order: within an ulp of fp32 per term of it, bitwise where the reduction adds in order). The
    backward is the closed form of `_MergeLse` for R parts: d out / d out_r = weight_r, and d / d lse_r =
    weight_r (g_r + g_lse - sum_s weight_s g_s) with g_r = <g_out, out_r> over the feature axis; one fp32 buffer
    of a part's size serves every product."""

    @staticmethod
    def forward(ctx, out_RM, lse_R, dim: int):  # type: ignore[override]
        weight, lse = _round_weights(lse_R, dim)
        acc = torch.promote_types(torch.promote_types(out_RM.dtype, torch.float32), weight.dtype)
        weight = weight.to(acc)
        parts, part_weights = out_RM.unbind(dim), weight.unbind(dim)
        merged = parts[0] * part_weights[0][..., None]  # a new buffer in acc
        for part, w in zip(parts[1:], part_weights[1:], strict=True):
            if torch.compiler.is_compiling():  # the same sum out of place: IN_PLACE_UNDER_COMPILE
                merged = merged.addcmul(part, w[..., None])
            else:
                merged.addcmul_(part, w[..., None])
        ctx.save_for_backward(out_RM, weight)
        ctx.dim, ctx.lse_dtype = dim, lse_R.dtype
        return _in_dtype(merged, out_RM.dtype), lse

    @staticmethod
    @once_differentiable  # the backward writes into out= buffers: a second derivative raises instead of being wrong
    def backward(ctx, g_out, g_lse):  # type: ignore[override]
        out_RM, weight = ctx.saved_tensors
        dim = ctx.dim
        g_acc = g_out.to(weight.dtype)
        product = torch.empty_like(g_acc)
        g_w = torch.stack([torch.mul(g_acc, part, out=product).sum(-1) for part in out_RM.unbind(dim)], dim)
        shared = (weight * g_w).sum(dim, keepdim=True)
        g_lse_R = (weight * (g_w + g_lse.to(weight.dtype).unsqueeze(dim) - shared)).to(ctx.lse_dtype)
        # Every round's g * weight in one broadcast product, rounded once into the parts' dtype and layout: no
        # fp32 copy, and a whole out= buffer (dynamo breaks the graph at a strided slice of one).
        g_out_RM = torch.mul(g_acc.unsqueeze(dim), weight[..., None], out=torch.empty_like(out_RM))
        return g_out_RM, g_lse_R, None


def merge_lse_many(out_RM: torch.Tensor, lse_R: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse` over a whole axis `dim` of lse (out has one more trailing feature axis): Reformer's rounds.
    Values as `merge_lse_many_reference` within float rounding, in fewer bytes (`_MergeLseMany`)."""
    return _MergeLseMany.apply(out_RM, lse_R, dim % lse_R.dim())


def merge_lse_many_reference(out_RM: torch.Tensor, lse_R: torch.Tensor,
                             dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse_many` as one autograd expression: the reference its tests compare against."""
    weight, lse = _round_weights(lse_R, dim)
    out = (_acc(out_RM) * weight.unsqueeze(-1)).sum(dim)
    return out.to(out_RM.dtype), lse
