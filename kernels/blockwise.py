"""Exact attention with (out, lse) in PyTorch, a block of query rows at a time: the fallback where the Triton
kernels do not run (CPU, or a GPU input they reject), in O(rows x N) memory instead of the reference's M x N.

Each block of query rows sees every key, so its softmax is the ordinary one (no online rescaling); what makes
it memory-efficient is the backward, which saves only q, k, v and lse and recomputes each block's
probabilities, as FlashAttention does (Dao et al., 2022, arXiv 2205.14135, sec. 3.1):

    P = exp(S - lse)           dV += P^T dO          dP = dO V^T
    dS = P * (dP - delta)      delta_i = sum_j P_ij dP_ij - dlse_i
    dQ = scale * dS K          dK += scale * dS^T Q

The ``- dlse_i`` term is the gradient that arrives through lse (d lse_i / d S_ij = P_ij), which HyperAttention
and LSH hash rounds need when they merge parts by their log-sum-exp. Computing delta from the recomputed P
rather than from the stored output keeps it in fp32 for fp16/bf16 inputs.

Semantics are those of ``kernels.reference.exact_attention_reference`` (the test oracle): causal aligned
top-left, key padding, fully masked rows giving zeros and lse = -inf, softmax in fp32 (fp64 for fp64 inputs).
No dropout: calls with dropout go to the reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kernels.block_setting import BlockSetting
from kernels.reference import (
    autocast_off,
    check_attention_inputs,
    check_key_padding_mask,
    fp32_softmax,
)

# Elements of one block's logits across batch and heads: 2^22 fp32 values are 16 MiB per [rows, N] buffer,
# and the backward holds four of them (S, P, dP, dS) at once.
BLOCK_ELEMENTS = 1 << 22
_MAX_BLOCKS: BlockSetting[int | None] = BlockSetting(None)
"""The enclosing `at_most_blocks` block's limit."""


@contextmanager
def at_most_blocks(blocks: int) -> Iterator[None]:
    """Inside, a call takes at most `blocks` blocks of query rows, each as large as that needs. For `orchestrator
    plan`, which runs attention on fake tensors, where an op costs the same at any size: a 16k sequence in blocks
    of BLOCK_ELEMENTS is 512 blocks per call, and HyperAttention's 16k plan took tens of minutes. The FLOPs are
    the same; the peak holds one larger block of logits."""
    with _MAX_BLOCKS.set_to(blocks):
        yield


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def block_rows(batch: int, heads: int, seq_k: int, block_elements: int) -> int:
    """Query rows per block so that one [B, H, rows, N] buffer holds about `block_elements` values."""
    return max(1, block_elements // max(1, batch * heads * seq_k))


def _masked(rows: range, seq_k: int, causal: bool, kpm_B11N: torch.Tensor | None,
            device: torch.device) -> torch.Tensor | None:
    """[B or 1, 1, rows, N] bool, True where a (query, key) pair is masked; None when nothing is."""
    masked = None
    if causal:
        rows_R = torch.arange(rows.start, rows.stop, device=device)
        masked = (torch.arange(seq_k, device=device)[None, :] > rows_R[:, None])[None, None]
    if kpm_B11N is not None:
        masked = kpm_B11N if masked is None else masked | kpm_B11N
    return masked


def _probabilities(q_blk: torch.Tensor, k_up: torch.Tensor, masked: torch.Tensor | None, scale: float,
                   lse_blk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, lse) of one block of rows; with `lse_blk` given (backward), P is recomputed from it."""
    s = torch.matmul(_upcast(q_blk), k_up.transpose(-1, -2)) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    if lse_blk is None:
        lse_blk = torch.logsumexp(s, dim=-1)
    lse_safe = torch.where(torch.isinf(lse_blk), torch.zeros_like(lse_blk), lse_blk)
    return torch.exp(s - lse_safe[..., None]), lse_blk  # exp(-inf - 0) = 0 on masked entries and empty rows


class BlockwiseAttentionFunction(torch.autograd.Function):
    """(q, k, v) -> (out, lse), differentiable in both outputs, saving no M x N tensor."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, key_padding_mask, scale: float, rows_per_block: int):
        batch, heads, seq_q, _ = q.shape
        seq_k = k.shape[2]
        k_up, v_up = _upcast(k), _upcast(v)
        kpm_B11N = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seq_q, dtype=k_up.dtype, device=q.device)
        for start in range(0, seq_q, rows_per_block):
            rows = range(start, min(start + rows_per_block, seq_q))
            masked = _masked(rows, seq_k, causal, kpm_B11N, q.device)
            p, lse_blk = _probabilities(q[:, :, start : rows.stop], k_up, masked, scale)
            out[:, :, start : rows.stop] = torch.matmul(p, v_up).to(q.dtype)
            lse[:, :, start : rows.stop] = lse_blk
        ctx.save_for_backward(q, k, v, lse)
        ctx.key_padding_mask, ctx.causal, ctx.scale, ctx.rows_per_block = key_padding_mask, causal, scale, rows_per_block
        # An unused output's gradient arrives as None: no work for a dropped lse (or a dropped out).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        # A backward run inside the caller's autocast (loss.backward() in the autocast block) would recompute P
        # from bf16 logits; the recomputation follows the forward's fp32.
        with autocast_off(ctx.saved_tensors[0].device.type):
            q, k, v, lse = ctx.saved_tensors
            seq_q, seq_k = q.shape[2], k.shape[2]
            k_up, v_up = _upcast(k), _upcast(v)
            kpm = ctx.key_padding_mask
            kpm_B11N = None if kpm is None else kpm[:, None, None, :]
            dq = torch.zeros_like(q, dtype=k_up.dtype)
            dk = torch.zeros_like(k_up)
            dv = torch.zeros_like(v_up)
            for start in range(0, seq_q, ctx.rows_per_block):
                stop = min(start + ctx.rows_per_block, seq_q)
                masked = _masked(range(start, stop), seq_k, ctx.causal, kpm_B11N, q.device)
                q_blk = _upcast(q[:, :, start:stop])
                p, _ = _probabilities(q_blk, k_up, masked, ctx.scale, lse[:, :, start:stop])
                ds = torch.zeros_like(p)
                if dout is not None:
                    do_blk = _upcast(dout[:, :, start:stop])
                    dv += torch.matmul(p.transpose(-1, -2), do_blk)
                    dp = torch.matmul(do_blk, v_up.transpose(-1, -2))
                    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
                if dlse is not None:
                    ds = ds + p * dlse[:, :, start:stop, None].to(p.dtype)
                dq[:, :, start:stop] = torch.matmul(ds, k_up) * ctx.scale
                dk += torch.matmul(ds.transpose(-1, -2), q_blk) * ctx.scale
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


@fp32_softmax  # the forward's logits in fp32 under any autocast (kernels/reference.py)
def exact_attention_blockwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    block_elements: int = BLOCK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention, q [B, H, M, D], k and v [B, H, N, D] -> out [B, H, M, D], lse [B, H, M], computed
    `block_rows(...)` query rows at a time; same semantics as kernels.reference.exact_attention_reference."""
    check_attention_inputs(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    rows = block_rows(q.shape[0], q.shape[1], k.shape[2], block_elements)
    if (max_blocks := _MAX_BLOCKS.value) is not None:
        rows = max(rows, math.ceil(q.shape[2] / max_blocks))
    return BlockwiseAttentionFunction.apply(q, k, v, causal, key_padding_mask, scale, rows)
