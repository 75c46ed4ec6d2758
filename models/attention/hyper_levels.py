"""The layouts of every level of HyperAttention's causal recursion at once, for kernels/hyper_levels.py.

`HyperMechanism.causal` (models/attention/hyper.py) recurses: each level halves its blocks, routes the second half's
queries to key blocks of the first half (`placed`, past-only routing), draws samples, and merges. On a GPU that was
about 90 launches a level, most of them small index ops, and the host's time per launch set the causal layer's
time (benchmarks/RESULTS.md, the second H200 window). Here the index work of all L levels is one batch: at every
level the keys are the first halves of its 2^l blocks and the queries the second halves, N / 2 tokens each, so the
levels stack as [B, H, L, N / 2], and a level's blocks are segments of that row. Sorting by (segment, bucket rank,
position) and searching with the segment in the key keeps every query inside its own block's keys; key blocks of b
rows never straddle segments because b divides every half.

The result equals the recursion's (same routing, same samples, the same merge order); values differ only by the
rounding of the merges (the recursion rounds each level's part to q's dtype before merging it; here the kernel
merges the level's unrounded part). The recursion's samples are drawn level by level, deepest first, for its
batch of 2^l pieces in the order its concatenations made (bit-reversed piece index); here they are drawn in that
order into one buffer, and one launch (kernels/hyper_placement.py `level_tables`) puts them back in position
order, sorts them and makes every level's tables.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kernels.hyper_blocks import _Layout
from kernels.hyper_levels import hyper_causal_levels
from kernels.hyper_placement import level_positions, level_tables, routed_blocks, stacked_sort_keys
from models.attention.hyper_groups import slot_queries

if TYPE_CHECKING:
    from models.attention.hyper import HyperMechanism


def stacked_levels(n: int, min_seq_len: int, block_size: int, bits: int) -> int:
    """The recursion's level count L when n halves exactly down to pieces of at most min_seq_len, every level's
    half holds whole blocks of block_size and takes the approximate path (at least min_seq_len keys), and the sort
    keys fit int64; 0 otherwise (the recursion then runs level by level)."""
    levels = 0
    while n > min_seq_len:
        half = n // 2
        if n % 2 or half % block_size or half < min_seq_len:
            return 0
        n, levels = half, levels + 1
    max_key = (1 << levels) * ((1 << bits) + 1)  # segment * buckets + bucket rank
    return levels if max_key < 2**62 else 0


def stacked_placement(mech: HyperMechanism, q_BHNE, k_BHNE, levels: int):
    """Past-only routing of every level's off-diagonal blocks at once, as `HyperMechanism.placed` routes one level:
    (q_slots [L, B, H, G * b], k_rows [L, B, H, N / 2], group_block [L, B, H, G]) holding token positions, level l
    at index l, its 2^l blocks as segments of the row. The index work on the kernels of kernels/hyper_placement.py
    (three launches where PyTorch took about thirty), with the sort and the groups' layout between them."""
    M, b = q_BHNE.shape[2] // 2, mech.block_size
    buckets = (1 << mech.bits) + 1  # ranks 0 .. 2^bits (padding's rank, unused here)
    key_k, key_q = stacked_sort_keys(mech.bucket_rank(k_BHNE, None), mech.bucket_rank(q_BHNE, None), levels, buckets)
    key_sorted, order_k = torch.sort(key_k, dim=-1, stable=True)  # by segment, bucket, then position
    block = routed_blocks(key_sorted, key_q, b)
    k_rows, q_slots, group_block = level_positions(order_k, slot_queries(block, M // b, b), block, b)
    return q_slots, k_rows, group_block


def level_uniforms(mech: HyperMechanism, B: int, H: int, levels: int, device: torch.device,
                   first_level: int = 0) -> torch.Tensor | None:
    """The uniform draws of `levels` levels for `level_tables`, flat; None without samples. In training level l's
    [2^l B, H, m], deepest level first, each drawn by one `uniform_` on its slice: the recursion's draws
    (`torch.rand` of that shape is `uniform_` on a new tensor of it: the same numbers from the same generator
    state, on a CPU or a GPU). In evaluation the fixed draws [L, H, m] of recursion levels first_level ..
    first_level + L - 1 (`mech.eval_draws`): one call's own level alone takes levels=1 and its level there."""
    m = mech.sample_size
    if m == 0:
        return None
    if not mech.training:
        return mech.eval_draws(H, m, first_level + levels, device)[first_level:first_level + levels]
    sizes = [(B << level) * H * m for level in range(levels)]
    uniforms = torch.empty(sum(sizes), device=device)
    for part in uniforms.split(sizes[::-1]):  # deepest level first
        part.uniform_()
    return uniforms


def causal_levels(mech: HyperMechanism, q_BHNE, k_BHNE, v_BHNE, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `mech.causal` without key padding under past-only routing, on the kernels, for a length whose
    recursion has `levels` levels (`stacked_levels`)."""
    B, H, N, E = q_BHNE.shape
    q_slots, k_rows, group_block = stacked_placement(mech, q_BHNE, k_BHNE, levels)
    uniforms = level_uniforms(mech, B, H, levels, q_BHNE.device)
    rows, first_sample, first_group, log_w = level_tables(uniforms, group_block, N // 2, mech.sample_size,
                                                          mech.block_size, shared=not mech.training)
    scale = 1.0 / math.sqrt(E)
    layouts = [_Layout(q_BHNE, k_BHNE, q_slots[level], k_rows[level], group_block[level], rows[level], log_w[level],
                       mech.block_size, None, scale, segments=1 << level,
                       tables=(first_group[level], first_sample[level]))
               for level in reversed(range(levels))]  # the recursion's order of merges: deepest first
    return hyper_causal_levels(q_BHNE, k_BHNE, v_BHNE, 1 << levels, layouts, scale)
