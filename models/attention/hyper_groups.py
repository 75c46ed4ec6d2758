"""Past-only routing's query groups (HyperAttention's causal off-diagonal blocks, models/attention/hyper.py
`placed` and the stacked levels of models/attention/hyper_levels.py): each query has a key block; a block's queries,
in position order, fill ceil(count / b) groups of b slots, so every group reads one key block. G = ceil(M / b) + nb
groups bound their sum; unused groups read block nb - 1.

`group_queries` builds the slots in PyTorch (about twenty launches); `slot_queries` lays the same groups out on LSH's
past-only layout kernel (kernels/lsh_layout.py), key blocks for buckets and chunks of b, in one, and `grouped_rows`
adds each group's block (the stacked levels find it on their positions kernel instead).
"""

from __future__ import annotations

import torch

from kernels.lsh_layout import bucket_layout


def group_queries(block_XM: torch.Tensor, nb: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups for queries [..., M] given their key blocks (of nb), groups of b: (slot [..., M], the query's slot
    among G groups of b; the key block of each group [..., G]). Any leading dims: `placed`'s [B, H] and every
    level's at once."""
    M, dev = block_XM.shape[-1], block_XM.device
    i_M = torch.arange(M, device=dev)
    count = torch.zeros(*block_XM.shape[:-1], nb, dtype=torch.long, device=dev).scatter_add_(
        -1, block_XM, torch.ones_like(block_XM))
    groups = -(-count // b)
    G = -(-M // b) + nb
    order = torch.argsort(block_XM, dim=-1, stable=True)  # by block, then position
    block_sorted = torch.gather(block_XM, -1, order)
    first_query = torch.cumsum(count, -1) - count
    first_group = torch.cumsum(groups, -1) - groups
    rank_in_block = i_M - torch.gather(first_query, -1, block_sorted)
    slot_sorted = torch.gather(first_group, -1, block_sorted) * b + rank_in_block
    slot_XM = torch.empty_like(slot_sorted).scatter_(-1, order, slot_sorted)
    block_XG = torch.searchsorted(torch.cumsum(groups, -1), torch.arange(G, device=dev)
                                  .expand(*block_XM.shape[:-1], G).contiguous(), right=True)
    return slot_XM, block_XG.clamp(max=nb - 1)


def slot_queries(block_XM: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """The query in each of the G * b slots of `group_queries`' groups, on the kernel: [..., G * b] int32 query
    indices, -1 in an unused slot; leading dims [B, H] or [B, H, L]."""
    M = block_XM.shape[-1]
    G = -(-M // b) + nb
    block_BHRM = block_XM if block_XM.dim() == 4 else block_XM.unsqueeze(2)
    order = torch.argsort(block_BHRM, dim=-1, stable=True)  # by block, then position
    query_BHRL, _ = bucket_layout(block_BHRM, order, b, G * b)  # (the shifted positions are LSH's, unused)
    return query_BHRL.view(*block_XM.shape[:-1], G * b)


def grouped_rows(block_XM: torch.Tensor, nb: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_queries` on the kernels, as rows: (query [..., G * b], the query index in each slot, -1 in an unused
    one; the key block of each group [..., G]), leading dims [B, H] or [B, H, L]. A group's block is its first
    query's (every used group has one); unused groups read block nb - 1, as there."""
    query_XL = slot_queries(block_XM, nb, b).long()
    first_XG = query_XL[..., ::b]
    block_XG = block_XM.gather(-1, first_XG.clamp(min=0)).masked_fill_(first_XG < 0, nb - 1)
    return query_XL, block_XG
