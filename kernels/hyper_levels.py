"""HyperAttention's causal recursion (Han et al., 2023, arXiv 2310.05869, Algorithm 4) as one pass on the kernels:
the exact causal pieces on the flash kernel, then every level's off-diagonal blocks merged into them, forward and
backward, with no per-level copy, merge or gradient of the recursion's own.

Algorithm 4 halves the sequence until pieces are at most `min_seq_len` long, attends exactly and causally inside
each piece, and at every level lets the second half of each block attend (approximately) to its first half, merging
the two through their log-sum-exp on the way back up. Each query's result is therefore one softmax over the union of
its piece's earlier keys and the keys each level chose for it, and a softmax over a union is its parts merged in any
order. So: `pieces` exact causal pieces (the flash kernel on a view of q, k, v with the pieces as batch rows), then
one blocks + samples launch per level (kernels/k_hyper_blocks.py with `MERGE`, the level's blocks as segments),
deepest level first, as the recursion merges. The backward of a merged softmax needs only the final lse and delta:
each part's gradient is its own FlashAttention-2 backward with them (Dao, 2023, arXiv 2307.08691), added into one
dq, dk, dv (`ACCUMULATE`). The layouts come from models/attention/hyper_levels.py.
"""

from __future__ import annotations

import torch

from kernels.flash_attention import LayoutKernelFunction, _current_fixed_config, backward_delta
from kernels.flash_attention import _backward as flash_backward
from kernels.flash_attention import _forward as flash_forward
from kernels.hyper_blocks import _Layout, hyper_backward, hyper_forward


def token_major_like(x: torch.Tensor) -> torch.Tensor:
    """An empty [B, H, N, E] buffer laid out [B, N, H, E] (a layer's projections' layout), whose pieces are a view."""
    B, H, N, E = x.shape
    return torch.empty(B, N, H, E, dtype=x.dtype, device=x.device).transpose(1, 2)


def as_pieces(x: torch.Tensor, pieces: int, view: bool = False) -> torch.Tensor:
    """[B, H, N, ...] -> [B * pieces, H, N / pieces, ...]: consecutive pieces of the sequence as batch rows. A view
    where x's strides allow it (token-major buffers), else a copy; `view=True` (a buffer to write into) refuses to
    copy."""
    B, H, N = x.shape[:3]
    x = x.unflatten(2, (pieces, N // pieces)).transpose(1, 2)
    shape = (B * pieces, H, N // pieces, *x.shape[4:])
    return x.view(shape) if view else x.reshape(shape)


class CausalLevels:
    """The layout of Algorithm 4 in one pass for kernels.flash_attention.LayoutKernelFunction: `pieces` exact causal
    pieces, then each level's blocks + samples (`levels`, deepest first) merged in."""

    def __init__(self, pieces: int, levels: list[_Layout], scale: float):
        self.pieces, self.levels, self.scale = pieces, levels, scale
        self.cfg = _current_fixed_config()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        P = self.pieces
        out = token_major_like(q)
        # The pieces' lse is written straight into the sequences' [B, H, N] rows (`stat_pieces`).
        _, lse = flash_forward(as_pieces(q, P), as_pieces(k, P), as_pieces(v, P), True, None, self.scale, self.cfg,
                               out=as_pieces(out, P, view=True), stat_pieces=P)
        for lay in self.levels:  # deepest level first, as the recursion merges on its way back up
            hyper_forward(q, k, v, lay, merge_into=(out, lse))
        return out, lse

    def backward(self, q, k, v, out, lse, dout, dlse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        P = self.pieces
        grads = tuple(token_major_like(x) for x in (q, k, v))
        delta = backward_delta(out, dout, dlse)  # of the final out: every part's backward takes it
        # The pieces' backward reads only lse and delta of the rows (out and dlse enter through delta).
        flash_backward(as_pieces(q, P), as_pieces(k, P), as_pieces(v, P), as_pieces(out, P), lse,
                       as_pieces(dout, P), None, True, None, self.scale, self.cfg,
                       grads=tuple(as_pieces(g, P, view=True) for g in grads), delta=delta, stat_pieces=P)
        for lay in self.levels:
            hyper_backward(q, k, v, out, lse, dout, lay, delta, add_to=grads)
        return grads


def hyper_causal_levels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: int, levels: list[_Layout],
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, H, N, E] (token-major) and lse [B, H, N] of Algorithm 4 over `pieces` exact causal pieces and the
    levels' blocks + samples (`levels`: their layouts, deepest level first)."""
    return LayoutKernelFunction.apply(q, k, v, CausalLevels(pieces, levels, scale))
