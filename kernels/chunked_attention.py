"""Chunked attention over a sorted sequence with the Triton kernels of k_chunked_attention.py, as an
autograd.Function (forward, and a FlashAttention-2 backward that also takes the gradient of lse; Dao, 2023,
arXiv 2307.08691). The semantics, and the oracle, are kernels.reference.chunked_attention_reference.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from kernels import stand_in
from kernels.flash_attention import (
    backward_delta,
    cdiv,
    check_triton_inputs,
    dot_options,
    interpreter_enabled,
    next_power_of_two,
    strides,
)
from kernels.interpreter_compat import repair_index
from kernels.reference import check_chunked_inputs


def _kernels() -> ModuleType:
    from kernels import k_chunked_attention

    if interpreter_enabled():
        repair_index()  # triton 3.6's interpreter under NumPy 2 (kernels/interpreter_compat.py)
    return k_chunked_attention


class _Layout:
    """Everything the three kernels share for one call: sizes, masks as kernel arguments, constexprs."""

    def __init__(
        self,
        q: torch.Tensor,
        chunk: int,
        lookback: int,
        pos_BHT: torch.Tensor | None,
        pad_BHT: torch.Tensor | None,
        causal: bool,
        self_mask: bool,
        wrap: bool,
        scale: float,
    ) -> None:
        batch, heads, seq, head_dim = q.shape
        self.batch_heads = batch * heads
        self.seq = seq
        self.chunk = chunk
        self.n_chunks = cdiv(seq, chunk)
        self.n_look = min(lookback, self.n_chunks - 1) + 1
        self.block_d = next_power_of_two(head_dim)
        self.cfg = _kernels().launch_config(self.block_d, q.element_size(), chunk, interpreter_enabled())
        needs_positions = causal or self_mask
        if needs_positions and pos_BHT is None:
            pos_BHT = torch.arange(seq, device=q.device).expand(batch, heads, seq)
        # Dummy pointers (never read: the constexpr flags are off) keep one kernel signature.
        self.pos = pos_BHT if needs_positions else q
        self.pos_strides = strides(pos_BHT) if needs_positions else (0, 0, 0)
        self.pad = pad_BHT.to(torch.uint8) if pad_BHT is not None else q
        self.pad_strides = strides(self.pad) if pad_BHT is not None else (0, 0, 0)
        self.scalars = (heads, seq, head_dim, chunk, self.n_chunks, self.n_look)
        self.scale = scale
        self.constexprs = dict(
            WRAP=wrap, CAUSAL=causal, SELF_MASK=self_mask, HAS_KPM=pad_BHT is not None, **dot_options(q.dtype),
            BLOCK_M=self.cfg["BLOCK_M"], BLOCK_N=self.cfg["BLOCK_N"], BLOCK_D=self.block_d,
            num_warps=self.cfg["num_warps"], num_stages=self.cfg["num_stages"],
        )  # fmt: skip

    def grid(self, block: int) -> tuple[tuple[int, int], int]:
        """One program per block of rows inside each chunk; a block never straddles two chunks."""
        blocks_per_chunk = cdiv(self.chunk, block)
        return (self.n_chunks * blocks_per_chunk, self.batch_heads), blocks_per_chunk

    @property
    def mask_args(self) -> tuple:
        return (*self.pos_strides, *self.pad_strides)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: _Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    kern = _kernels()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    grid, blocks_per_chunk = lay.grid(lay.cfg["BLOCK_M"])
    stand_in.launch("chunked_fwd", lambda: kern._chunked_fwd[grid](
        q, k, v, out, lse, lay.pos, lay.pad,
        *strides(q), *strides(k), *strides(v), *strides(out), *lay.mask_args,
        *lay.scalars, blocks_per_chunk, lay.scale * math.log2(math.e),
        **lay.constexprs,
    ))  # fmt: skip
    return out, lse


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    lay: _Layout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kern = _kernels()
    delta = backward_delta(out, dout, dlse)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    inputs_strides = (*strides(q), *strides(k), *strides(v), *strides(dout))
    scales = (lay.scale * math.log2(math.e), lay.scale)

    grid_n, blocks_per_chunk_n = lay.grid(lay.cfg["BLOCK_N"])
    stand_in.launch("chunked_bwd_dkdv", lambda: kern._chunked_bwd_dkdv[grid_n](
        q, k, v, dout, lse, delta, dk, dv, lay.pos, lay.pad,
        *inputs_strides, *strides(dk), *lay.mask_args,
        *lay.scalars, blocks_per_chunk_n, *scales,
        **lay.constexprs,
    ))  # fmt: skip
    grid_m, blocks_per_chunk_m = lay.grid(lay.cfg["BLOCK_M"])
    stand_in.launch("chunked_bwd_dq", lambda: kern._chunked_bwd_dq[grid_m](
        q, k, v, dout, lse, delta, dq, lay.pos, lay.pad,
        *inputs_strides, *strides(dq), *lay.mask_args,
        *lay.scalars, blocks_per_chunk_m, *scales,
        **lay.constexprs,
    ))  # fmt: skip
    return dq, dk, dv


class ChunkedAttentionFunction(torch.autograd.Function):
    """(q, k, v) -> (out, lse), differentiable in both outputs; the layout carries the non-tensor arguments."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lay: _Layout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.kernel_log = stand_in.active()
        with stand_in.kernel_region(ctx.kernel_log):
            out, lse = _forward(q, k, v, lay)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.lay = lay
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor | None, dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        with stand_in.kernel_region(ctx.kernel_log):
            dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.lay)
        return dq, dk, dv, None


def chunked_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: int,
    lookback: int = 1,
    positions: torch.Tensor | None = None,
    causal: bool = False,
    self_mask: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    wrap: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked attention on the Triton kernels; arguments and semantics as
    kernels.reference.chunked_attention_reference (q, k, v [B, H, T, D] -> out [B, H, T, D], lse [B, H, T])."""
    check_triton_inputs(q, k, v)
    pos_BHT, pad_BHT = check_chunked_inputs(q, k, chunk, lookback, positions, key_padding_mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    lay = _Layout(q, chunk, lookback, pos_BHT, pad_BHT, causal, self_mask, wrap, scale)
    return ChunkedAttentionFunction.apply(q, k, v, lay)
