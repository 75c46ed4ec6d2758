"""Chunked attention over a sorted sequence with the Triton kernels of k_chunked_attention.py, through
kernels.flash_attention.LayoutKernelFunction (forward, and a FlashAttention-2 backward that also takes the gradient
of lse; Dao, 2023, arXiv 2307.08691). The semantics, and the oracle, are kernels.reference.chunked_attention_reference.

With `token_of_row` the kernels read the rows of q, k, v through the index and write out, lse and the per-round
gradients at the tokens' own rows (k_chunked_attention.py): the sorted layout exists only as that index.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from kernels import stand_in
from kernels.flash_attention import (
    LayoutKernelFunction,
    backward_delta,
    cdiv,
    check_triton_inputs,
    dot_options,
    interpreter_enabled,
    jit_module,
    next_power_of_two,
    strides,
)
from kernels.reference import check_chunked_inputs


def _kernels() -> ModuleType:
    from kernels import k_chunked_attention

    return jit_module(k_chunked_attention)


def round_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides (batch, head, round, token, feature) of a [B, H, R, T, D] tensor, or of a [B, H, T, D] one as a
    single round (round stride 0)."""
    if x.dim() == 5:
        return tuple(x.stride())
    sb, sh, st, sd = x.stride()
    return sb, sh, 0, st, sd


class _Layout:
    """Everything the three kernels share for one call: sizes, masks as kernel arguments, constexprs."""

    def __init__(
        self,
        q: torch.Tensor,
        chunk: int,
        lookback: int,
        pos: torch.Tensor | None,
        pad_BHT: torch.Tensor | None,
        tok_BHRL: torch.Tensor | None,
        causal: bool,
        self_mask: bool,
        wrap: bool,
        scale: float,
    ) -> None:
        batch, heads, n_tokens, head_dim = q.shape
        self.indexed = tok_BHRL is not None
        rounds, seq = (tok_BHRL.shape[2], tok_BHRL.shape[3]) if self.indexed else (1, n_tokens)
        self.rows_shape = (batch, heads, rounds, n_tokens) if self.indexed else (batch, heads, n_tokens)
        """Shape of lse; out and the per-round gradients add the head dim."""
        self.programs = batch * heads * rounds
        self.seq = seq
        self.chunk = chunk
        self.n_chunks = cdiv(seq, chunk)
        self.n_look = min(lookback, self.n_chunks - 1) + 1
        self.block_d = next_power_of_two(head_dim)
        self.cfg = _kernels().launch_config(self.block_d, q.element_size(), chunk, interpreter_enabled())
        # Without positions the kernels take the token index (the row index when not indexed): no arange.
        has_pos = (causal or self_mask) and pos is not None
        # Dummy pointers (never read: the constexpr flags are off) keep one kernel signature.
        self.pos = pos if has_pos else q
        pos_strides = tuple(pos.stride()) if has_pos else (0, 0, 0, 0)
        self.pos_strides = pos_strides if len(pos_strides) == 4 else (*pos_strides[:2], 0, pos_strides[2])
        self.pad = pad_BHT.to(torch.uint8) if pad_BHT is not None else q
        self.pad_strides = strides(self.pad) if pad_BHT is not None else (0, 0, 0)
        self.tok = tok_BHRL.contiguous() if self.indexed else q
        self.scalars = (heads, rounds, n_tokens, seq, head_dim, chunk, self.n_chunks, self.n_look)
        self.scale = scale
        self.constexprs = dict(
            WRAP=wrap, CAUSAL=causal, SELF_MASK=self_mask, HAS_KPM=pad_BHT is not None, HAS_POS=has_pos,
            INDEXED=self.indexed, **dot_options(q.dtype),
            BLOCK_M=self.cfg["BLOCK_M"], BLOCK_N=self.cfg["BLOCK_N"], BLOCK_D=self.block_d,
            num_warps=self.cfg["num_warps"], num_stages=self.cfg["num_stages"],
        )  # fmt: skip

    def grid(self, block: int) -> tuple[tuple[int, int], int]:
        """One program per block of rows inside each chunk; a block never straddles two chunks."""
        blocks_per_chunk = cdiv(self.chunk, block)
        return (self.n_chunks * blocks_per_chunk, self.programs), blocks_per_chunk

    def rows_like(self, x: torch.Tensor) -> torch.Tensor:
        """An uninitialised [B, H, (R,) T, D] tensor in x's dtype, for out or a per-round gradient."""
        return torch.empty(*self.rows_shape, x.shape[-1], device=x.device, dtype=x.dtype)

    @property
    def mask_args(self) -> tuple:
        return (*self.pos_strides, *self.pad_strides)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward(q, k, v, self)

    def backward(self, q, k, v, out, lse, dout, dlse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward(q, k, v, out, lse, dout, dlse, self)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: _Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    kern = _kernels()
    out = lay.rows_like(q)
    lse = torch.empty(lay.rows_shape, device=q.device, dtype=torch.float32)
    grid, blocks_per_chunk = lay.grid(lay.cfg["BLOCK_M"])
    stand_in.launch("chunked_fwd", lambda: kern._chunked_fwd[grid](
        q, k, v, out, lse, lay.pos, lay.pad, lay.tok,
        *strides(q), *strides(k), *strides(v), *round_strides(out), *lay.mask_args,
        *lay.scalars, blocks_per_chunk, lay.scale * math.log2(math.e),
        **lay.constexprs,
    ))  # fmt: skip
    return out, lse


def _stacked_like(x: torch.Tensor, count: int) -> torch.Tensor:
    """An empty [count, *x.shape] whose every slice is laid out as x (its dims in x's order of strides)."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost first
    base = x.new_empty(count, *(x.shape[d] for d in order))
    return base.permute(0, *(1 + order.index(d) for d in range(x.dim())))


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
    """dq, dk, dv of the inputs; indexed, the kernels write them per round (each token has one row per round, so
    no two programs write one place and no atomics are needed) and the rounds are summed here."""
    kern = _kernels()
    if lay.indexed:  # delta per (batch, head x round, token): rounds folded into heads
        delta = backward_delta(out.flatten(1, 2), dout.flatten(1, 2), None if dlse is None else dlse.flatten(1, 2))
    else:
        delta = backward_delta(out, dout, dlse)
    if lay.indexed and q.shape[-1] == k.shape[-1] == v.shape[-1] and q.dtype == k.dtype == v.dtype:
        # The three per-round gradients in one buffer, summed over the rounds in one launch (three before).
        grads = torch.empty(3, *lay.rows_shape, q.shape[-1], device=q.device, dtype=q.dtype)
        dq, dk, dv = grads.unbind(0)
    else:
        grads = None
        dq, dk, dv = lay.rows_like(q), lay.rows_like(k), lay.rows_like(v)
    inputs_strides = (*strides(q), *strides(k), *strides(v), *round_strides(dout))
    scales = (lay.scale * math.log2(math.e), lay.scale)

    grid_n, blocks_per_chunk_n = lay.grid(lay.cfg["BLOCK_N"])
    stand_in.launch("chunked_bwd_dkdv", lambda: kern._chunked_bwd_dkdv[grid_n](
        q, k, v, dout, lse, delta, dk, dv, lay.pos, lay.pad, lay.tok,
        *inputs_strides, *round_strides(dk), *lay.mask_args,
        *lay.scalars, blocks_per_chunk_n, *scales,
        **lay.constexprs,
    ))  # fmt: skip
    grid_m, blocks_per_chunk_m = lay.grid(lay.cfg["BLOCK_M"])
    stand_in.launch("chunked_bwd_dq", lambda: kern._chunked_bwd_dq[grid_m](
        q, k, v, dout, lse, delta, dq, lay.pos, lay.pad, lay.tok,
        *inputs_strides, *round_strides(dq), *lay.mask_args,
        *lay.scalars, blocks_per_chunk_m, *scales,
        **lay.constexprs,
    ))  # fmt: skip
    if grads is not None:
        # Summed into q's layout (a layer's heads are views of [B, T, H, E]): the projections' backward then
        # reads the gradients as they are, where contiguous [B, H, T, E] sums each took a copy there.
        with stand_in.glue_inside_kernel():
            summed = _stacked_like(q, 3)
            if torch.compiler.is_compiling():
                # dynamo breaks the graph at an out= that is not contiguous (4 breaks in a compiled LSH layer);
                # inductor fuses the sum and the copy into one kernel that writes the strided buffer.
                return summed.copy_(torch.sum(grads, dim=3)).unbind(0)
            return torch.sum(grads, dim=3, out=summed).unbind(0)
    if lay.indexed:
        return dq.sum(2), dk.sum(2), dv.sum(2)
    return dq, dk, dv


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
    token_of_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked attention on the Triton kernels; arguments and semantics as
    kernels.reference.chunked_attention_reference (q, k, v [B, H, T, D] -> out [B, H, T, D], lse [B, H, T]; with
    `token_of_row` [B, H, R, L], out [B, H, R, T, D] and lse [B, H, R, T], loaded and stored through the index)."""
    check_triton_inputs(q, k, v)
    pos, pad_BHT = check_chunked_inputs(q, k, chunk, lookback, positions, key_padding_mask, token_of_row)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    lay = _Layout(q, chunk, lookback, pos, pad_BHT, token_of_row, causal, self_mask, wrap, scale)
    return LayoutKernelFunction.apply(q, k, v, lay)
