"""HyperAttention's approximate step (sortLSH blocks + uniform samples, one softmax) on the Triton kernels of
k_hyper_blocks.py, through kernels.flash_attention.LayoutKernelFunction, with a FlashAttention-2 backward that also
takes the gradient of lse (Dao, 2023, arXiv 2307.08691). The semantics, and the oracle:
kernels/hyper_blocks_reference.py.

The kernels read q, k, v through the layout's indices and store out, lse, dq, dk, dv at the tokens' own rows: no
sorted copy, no per-group copy of the samples and no merge of two parts exist (models/attention/hyper.py builds
the layout). Besides: the samples sorted by row and two [NB + 1] tables (each key block's first group and first
sample), made here in PyTorch or given already (kernels/hyper_placement.py `level_tables`, one launch), and in the
backward one fp32 buffer of the samples' gradient splits.
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
from kernels.hyper_blocks_reference import check_hyper_block_inputs

# Programs the samples' backward aims for per launch: it splits the groups among this many programs over every
# (batch, head, sample tile), so that a GPU's SMs are busy while each split's fp32 partial stays small.
SAMPLE_PROGRAMS = 512


def _kernels() -> ModuleType:
    from kernels import k_hyper_blocks

    return jit_module(k_hyper_blocks)


def block_tables(group_block: torch.Tensor, n_blocks: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first group of each key block and one past the last, [..., NB + 1]; each key block's first row, the same
    shape) for group_block [..., G]."""
    bounds = torch.arange(n_blocks + 1, device=group_block.device).expand(*group_block.shape[:-1], -1)
    return torch.searchsorted(group_block, bounds.contiguous()), (bounds * block).contiguous()


class _Layout:
    """The indices and sizes the four kernels share for one call. With `segments` S > 1 the key blocks and the
    samples fall into S equal runs, and a group sees its own run's samples only, weighted by sample_log_weight
    [B, S] (k_hyper_blocks.py, "Segments"). `tables`: each key block's first group and first sample, [B, H, NB + 1]
    both, when made already, with `sample_rows` ascending; else made here."""

    def __init__(self, q, k, q_slots, k_rows, group_block, sample_rows, sample_log_weight, block, pad_BN, scale,
                 segments: int = 1, tables: tuple[torch.Tensor, torch.Tensor] | None = None):
        B, H, M, D = q.shape
        self.heads, self.n_q, self.n_k = H, M, k.shape[2]
        self.block, self.n_groups, self.n_samples = block, group_block.shape[-1], sample_rows.shape[-1]
        self.n_blocks = k_rows.shape[-1] // block
        self.segments = segments
        self.seg_blocks, self.seg_samples = self.n_blocks // segments, self.n_samples // segments
        self.block_d = next_power_of_two(D)
        self.cfg = _kernels().launch_config(self.block_d, q.element_size(), block, interpreter_enabled())
        dev = q.device
        self.q_slots, self.k_rows = q_slots.contiguous(), k_rows.contiguous()
        self.group_block = group_block.contiguous()
        if tables is None:
            # Ascending rows: the block kernel finds a key block's samples as one range (their order is irrelevant
            # to the softmax, a sum over them).
            self.sample_rows = torch.sort(sample_rows, dim=-1).values if self.n_samples else q_slots[..., :1]
            self.first_group, first_row = block_tables(self.group_block, self.n_blocks, block)
            self.sample_start = (torch.searchsorted(self.sample_rows, first_row) if self.n_samples
                                 else torch.zeros(B, H, self.n_blocks + 1, dtype=torch.int64, device=dev))
        else:  # made by the caller (kernels/hyper_placement.py level_tables), the rows ascending already
            self.sample_rows = sample_rows if self.n_samples else q_slots[..., :1]
            self.first_group, self.sample_start = tables
        self.log_w = sample_log_weight.to(device=dev, dtype=torch.float32).reshape(B, segments).contiguous()
        self.pad = pad_BN.to(torch.uint8).contiguous() if pad_BN is not None else q_slots
        self.scale = scale
        self.constexprs = dict(
            HAS_KPM=pad_BN is not None, **dot_options(q.dtype), BLOCK_M=self.cfg["BLOCK_M"],
            BLOCK_N=self.cfg["BLOCK_N"], BLOCK_D=self.block_d, num_warps=self.cfg["num_warps"],
            num_stages=self.cfg["num_stages"],
        )  # fmt: skip

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.heads, self.n_q, self.n_k, self.n_groups, self.n_blocks, self.block, self.n_samples)

    @property
    def segment_sizes(self) -> tuple[int, int, int]:
        return (self.seg_blocks, self.seg_samples, self.segments)

    def query_grid(self, batch_heads: int) -> tuple[tuple[int, int], int]:
        tiles = cdiv(self.block, self.cfg["BLOCK_M"])
        return (self.n_groups * tiles, batch_heads), tiles

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hyper_forward(q, k, v, self)

    def backward(self, q, k, v, out, lse, dout, dlse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hyper_backward(q, k, v, out, lse, dout, self, delta=backward_delta(out, dout, dlse))


def hyper_forward(q, k, v, lay: _Layout, merge_into: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(out, lse) of the blocks + samples; with `merge_into` (out, lse at the query tokens, q's shape) the result is
    merged into those buffers in place and they are returned."""
    kern = _kernels()
    B, H, M, D = q.shape
    if merge_into is None:
        out = torch.empty_like(q)  # q's strides: a layer's [B, T, H, E] view back to [B, T, D] then copies nothing
        lse = torch.empty(B, H, M, device=q.device, dtype=torch.float32)
    else:
        out, lse = merge_into
    grid, tiles = lay.query_grid(B * H)
    stand_in.launch("hyper_fwd", lambda: kern._hyper_fwd[grid](
        q, k, v, out, lse, lay.q_slots, lay.k_rows, lay.group_block, lay.sample_rows, lay.log_w, lay.pad,
        *strides(q), *strides(k), *strides(v), *strides(out),
        *lay.sizes, D, tiles, lay.scale * math.log2(math.e), *lay.segment_sizes,
        MERGE=merge_into is not None, **lay.constexprs,
    ))  # fmt: skip
    return out, lse


def hyper_backward(q, k, v, out, lse, dout, lay: _Layout, delta: torch.Tensor,
                   add_to: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """(dq, dk, dv) of the blocks + samples from the final out's lse and delta (backward_delta); with `add_to` the
    gradients are added to those buffers in place and they are returned."""
    kern = _kernels()
    B, H, M, D = q.shape
    accumulate = add_to is not None
    # The inputs' strides, so that the gradients of a layer's views of its projections need no copy.
    dq, dk, dv = add_to if accumulate else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    inputs = (*strides(q), *strides(k), *strides(v), *strides(dout))
    scales = (lay.scale * math.log2(math.e), lay.scale)
    indices = (lay.q_slots, lay.k_rows, lay.group_block)

    m, block_n = lay.n_samples, lay.cfg["BLOCK_N"]
    dks_part = dvs_part = lse  # never read without samples (the block kernel's sample ranges are empty)
    splits = 0
    if m:
        sample_tiles = cdiv(lay.seg_samples, block_n)  # per segment
        # Under the interpreter two splits, so that the tests take the sum over splits.
        programs = B * H * lay.segments * sample_tiles
        splits = min(max(1, lay.n_groups // lay.segments),
                     2 if interpreter_enabled() else max(1, SAMPLE_PROGRAMS // programs))
        # Every split's rows are written (a split past a segment's last group writes zeros).
        # dK and dV of the samples in one buffer (each half contiguous, as the kernels index them); the dK/dV
        # kernel sums the splits as it reads them.
        parts = torch.empty(2, splits, B * H, m, lay.block_d, device=q.device, dtype=torch.float32)
        dks_part, dvs_part = parts.unbind(0)
        grid = (splits * lay.segments * sample_tiles, B * H)
        stand_in.launch("hyper_bwd_samples", lambda: kern._hyper_bwd_samples[grid](
            q, k, v, dout, lse, delta, dks_part, dvs_part, *indices, lay.first_group, lay.sample_rows, lay.log_w,
            lay.pad, *inputs, *lay.sizes, D, sample_tiles, splits, scales[0], *lay.segment_sizes,
            **lay.constexprs,
        ))  # fmt: skip
    tiles_per_block = cdiv(lay.block, block_n)
    stand_in.launch("hyper_bwd_dkdv", lambda: kern._hyper_bwd_dkdv[(lay.n_blocks * tiles_per_block, B * H)](
        q, k, v, dout, lse, delta, dk, dv, dks_part, dvs_part, *indices, lay.first_group, lay.sample_rows,
        lay.sample_start, lay.pad, *inputs, *strides(dk), *strides(dv), *lay.sizes, D, tiles_per_block, splits, *scales,
        BLOCK_S=lay.cfg["BLOCK_S"], ACCUMULATE=accumulate, **lay.constexprs,
    ))  # fmt: skip
    grid, tiles = lay.query_grid(B * H)
    stand_in.launch("hyper_bwd_dq", lambda: kern._hyper_bwd_dq[grid](
        q, k, v, dout, lse, delta, dq, *indices, lay.sample_rows, lay.log_w, lay.pad,
        *inputs, *strides(dq), *lay.sizes, D, tiles, *scales, *lay.segment_sizes,
        ACCUMULATE=accumulate, **lay.constexprs,
    ))  # fmt: skip
    return dq, dk, dv


def hyper_block_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_slots: torch.Tensor,
    k_rows: torch.Tensor,
    group_block: torch.Tensor,
    sample_rows: torch.Tensor,
    sample_log_weight: torch.Tensor,
    block: int,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HyperAttention's blocks + samples on the Triton kernels; arguments and semantics as
    kernels.hyper_blocks_reference.hyper_block_attention_reference (out [B, H, M, D], lse [B, H, M] at the query
    tokens). `tables`: each key block's first group and first sample, made already with `sample_rows` ascending
    (kernels/hyper_placement.py `level_tables`)."""
    check_triton_inputs(q, k, v)
    check_hyper_block_inputs(q, k, q_slots, k_rows, group_block, sample_rows, sample_log_weight, block,
                             key_padding_mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    lay = _Layout(q, k, q_slots, k_rows, group_block, sample_rows, sample_log_weight, block, key_padding_mask, scale,
                  tables=tables)
    return LayoutKernelFunction.apply(q, k, v, lay)
