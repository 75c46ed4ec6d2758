"""Reversible residual layers: activations are recomputed in the backward pass instead of stored per layer.

The Reversible Residual Network: Backpropagation Without Storing Activations. Gomez, Ren, Urtasun, Grosse
(NeurIPS 2017), arXiv 1707.04585; used for transformers by Reformer (Kitaev, Kaiser, Levskaya, ICLR 2020,
arXiv 2001.04451, Sec. 3):

    y1 = x1 + F(x2)        x2 = y2 - G(y1)
    y2 = x2 + G(y1)        x1 = y1 - F(x2)

with F = the attention branch and G = the feed-forward branch of a layer. `reversible_stack` runs the whole
stack under one autograd function that keeps only the last layer's outputs; in the backward pass each block's
inputs are rebuilt from its outputs, so the memory of saved activations does not grow with depth.

Three properties make the recomputation exact:
- Randomness replays: the CPU (and CUDA) RNG state before each branch is recorded in the forward pass and
  restored, inside `torch.random.fork_rng`, when the branch is recomputed, so dropout masks and
  HyperAttention's samples are the same. LSH rotations are a fixed function of the layer's seed anyway.
- Autocast replays: the forward's autocast mode is re-entered for the recomputation.
- Parameters are inputs of the autograd function and their gradients are returned from its backward, so
  they reach `.grad` through the normal accumulation path: `torch.autograd.grad` and DDP's gradient hooks
  see them (the RevTorch / lucidrains pattern writes `.grad` behind autograd's back, which breaks DDP).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

import torch
import torch.nn as nn


class ReversibleBlock(Protocol):
    """What a layer offers to run reversibly: its two residual branches, without the residual additions."""

    def attention_branch(
        self, x_BTD: torch.Tensor, key_padding_mask_BT: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def feed_forward_branch(self, x_BTD: torch.Tensor) -> torch.Tensor: ...


class _AutocastState:
    """The autocast mode of the forward pass; the backward runs outside it, so recomputation re-enters it
    (as torch.utils.checkpoint does), otherwise a bf16 forward would be recomputed in fp32 and the rebuilt
    inputs would be off by bf16 rounding."""

    def __init__(self, device: torch.device):
        self.device_type = device.type
        self.enabled = torch.is_autocast_enabled(self.device_type)
        self.dtype = torch.get_autocast_dtype(self.device_type)

    def replay(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class _RNGState:
    """The RNG state a branch started from, to replay its dropout and sampling in the backward pass."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextmanager
    def replay(self) -> Iterator[None]:
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1_BTD, x2_BTD, blocks, mask_BT, *params):  # type: ignore[override]
        rng: list[tuple[_RNGState, _RNGState]] = []
        for block in blocks:  # autograd is off inside Function.forward: nothing is saved per block
            f_state = _RNGState(x1_BTD.device)
            y1_BTD = x1_BTD + block.attention_branch(x2_BTD, key_padding_mask_BT=mask_BT)
            g_state = _RNGState(x1_BTD.device)
            y2_BTD = x2_BTD + block.feed_forward_branch(y1_BTD)
            x1_BTD, x2_BTD = y1_BTD, y2_BTD
            rng.append((f_state, g_state))
        ctx.blocks, ctx.mask_BT, ctx.rng, ctx.params = blocks, mask_BT, rng, params
        ctx.autocast = _AutocastState(x1_BTD.device)
        ctx.save_for_backward(x1_BTD, x2_BTD)
        return x1_BTD, x2_BTD

    @staticmethod
    def backward(ctx, dy1_BTD, dy2_BTD):  # type: ignore[override]
        y1_BTD, y2_BTD = ctx.saved_tensors
        params = ctx.params
        # dy1, dy2 are never None: autograd passes zeros for an output the loss does not use
        # (ctx.set_materialize_grads is on by default).
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        for block, (f_state, g_state) in zip(reversed(ctx.blocks), reversed(ctx.rng)):
            # G: y2 = x2 + G(y1)  ->  x2 = y2 - G(y1); dL/dy1 gains dL/dy2 * dG/dy1.
            with torch.enable_grad():
                y1_req = y1_BTD.detach().requires_grad_()
                with g_state.replay(), ctx.autocast.replay():
                    g_BTD = block.feed_forward_branch(y1_req)
                d_y1, *g_grads = torch.autograd.grad(g_BTD, (y1_req, *params), dy2_BTD, allow_unused=True)
            x2_BTD = y2_BTD - g_BTD.detach()
            dx1_BTD = dy1_BTD + d_y1
            # F: y1 = x1 + F(x2)  ->  x1 = y1 - F(x2); dL/dx2 = dL/dy2 + dL/dx1 * dF/dx2.
            with torch.enable_grad():
                x2_req = x2_BTD.detach().requires_grad_()
                with f_state.replay(), ctx.autocast.replay():
                    f_BTD = block.attention_branch(x2_req, key_padding_mask_BT=ctx.mask_BT)
                d_x2, *f_grads = torch.autograd.grad(f_BTD, (x2_req, *params), dx1_BTD, allow_unused=True)
            x1_BTD = y1_BTD - f_BTD.detach()
            dx2_BTD = dy2_BTD + d_x2
            param_grads = [_add(_add(acc, g), f) for acc, g, f in zip(param_grads, g_grads, f_grads)]
            y1_BTD, y2_BTD, dy1_BTD, dy2_BTD = x1_BTD, x2_BTD, dx1_BTD, dx2_BTD
        return (dy1_BTD, dy2_BTD, None, None, *param_grads)


def irreversible_stack(
    blocks: Sequence[ReversibleBlock], x1_BTD: torch.Tensor, x2_BTD: torch.Tensor,
    key_padding_mask_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same two-stream computation with ordinary autograd: for inference and as the reference in tests."""
    for block in blocks:
        x1_BTD = x1_BTD + block.attention_branch(x2_BTD, key_padding_mask_BT=key_padding_mask_BT)
        x2_BTD = x2_BTD + block.feed_forward_branch(x1_BTD)
    return x1_BTD, x2_BTD


def reversible_stack(
    blocks: Sequence[ReversibleBlock], x1_BTD: torch.Tensor, x2_BTD: torch.Tensor, params: Sequence[nn.Parameter],
    key_padding_mask_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `blocks` reversibly. `params` must hold every trainable tensor the blocks use (also parameters shared
    across layers that a block holds without registering), each once; others would get no gradient."""
    if not torch.is_grad_enabled() or not blocks:
        return irreversible_stack(blocks, x1_BTD, x2_BTD, key_padding_mask_BT)
    trainable = [p for p in params if p.requires_grad]
    y1_BTD, y2_BTD = _ReversibleFunction.apply(x1_BTD, x2_BTD, list(blocks), key_padding_mask_BT, *trainable)
    return y1_BTD, y2_BTD
