"""The index work of HyperAttention's stacked causal levels on its Triton kernels (kernels/k_hyper_placement.py,
under the interpreter at small shapes) against the same work written in PyTorch: the levels' sort keys, the
searchsorted routing to a key block, the token positions and the groups' blocks, and every level's samples and
tables, bitwise. The whole layer against the level-by-level recursion is tests/test_hyper_blocks_kernel.py's.

``KERNEL_TESTS_DEVICE=cuda`` runs them on the kernels compiled for a GPU, as tests/test_kernels.py does.
"""

from __future__ import annotations

# First: on the CPU it sets TRITON_INTERPRET=1 before the @triton.jit modules are imported.
from tests.kernel_device import DEVICE, needs_triton, one_gpu_launch_config  # noqa: F401 (an autouse fixture)

import pytest
import torch

from kernels.hyper_blocks import block_tables
from kernels.hyper_placement import diagonal_tables, level_positions, level_tables, routed_blocks, stacked_sort_keys
from models.attention.hyper import HyperMechanism, HyperMechanismConfig
from models.attention.hyper_groups import grouped_rows, slot_queries
from models.attention.hyper_levels import level_uniforms, stacked_levels, stacked_placement

pytestmark = needs_triton


def placement_in_pytorch(rank_k, rank_q, levels: int, bits: int, b: int):
    """The routing as PyTorch ops on [L, M] index tensors (what the kernels replace): keys are the first halves of
    each level's blocks, queries the second; sort keys (segment, bucket rank); a query's block is the middle of its
    key's run among the sorted keys, at most its segment's last key."""
    B, H, N = rank_k.shape
    M, L, dev = N // 2, levels, rank_k.device
    half_L1 = M >> torch.arange(L, device=dev)[:, None]
    i_M = torch.arange(M, device=dev)
    seg_LM = i_M // half_L1
    first_LM = seg_LM * half_L1
    pos_k_LM = first_LM + i_M
    pos_q_LM = pos_k_LM + half_L1
    seg_key_LM = seg_LM * ((1 << bits) + 1)
    key_k = seg_key_LM + rank_k[:, :, pos_k_LM]
    key_q = seg_key_LM + rank_q[:, :, pos_q_LM]
    order_k = torch.argsort(key_k, dim=-1, stable=True)
    key_sorted = torch.gather(key_k, -1, order_k)
    lo = torch.searchsorted(key_sorted, key_q, side="left")
    hi = torch.searchsorted(key_sorted, key_q, side="right")
    block = torch.minimum((lo + hi) // 2, first_LM + (half_L1 - 1)) // b
    query, group_block = grouped_rows(block, M // b, b)
    q_slots = pos_q_LM.expand(B, H, L, M).gather(-1, query.clamp(min=0)).masked_fill_(query < 0, -1)
    k_rows = torch.gather(pos_k_LM.expand(B, H, L, M), -1, order_k)
    return (key_k, key_q, block), tuple(x.movedim(2, 0).contiguous() for x in (q_slots, k_rows, group_block))


def tied_ranks(B: int, H: int, N: int, bits: int, gen: torch.Generator) -> torch.Tensor:
    """Ranks in 0 .. 2^bits - 1, few values: long runs of equal keys in every segment, and ranks absent from some."""
    return torch.randint(0, 1 << bits, (B, H, N), generator=gen)


@pytest.mark.parametrize("N,levels,bits,b", [(64, 2, 2, 4), (96, 1, 3, 8), (128, 3, 1, 4), (160, 2, 5, 4)])
def test_the_kernels_route_as_the_pytorch_ops(N: int, levels: int, bits: int, b: int) -> None:
    """Rows of 32-80 keys a level over tiles of 16 (segments of 8-80 crossing the tiles' edges); 1 bit (every
    query's run is half a segment), 2, 3 and 5 bits (runs of one key, and ranks with no key: routed to where
    their run would be)."""
    gen = torch.Generator().manual_seed(N + bits)
    rank_k, rank_q = (tied_ranks(2, 1, N, bits, gen) for _ in "kq")  # two (batch, head) rows
    (want_key_k, want_key_q, want_block), want = placement_in_pytorch(rank_k, rank_q, levels, bits, b)
    key_k, key_q = stacked_sort_keys(rank_k.to(DEVICE), rank_q.to(DEVICE), levels, (1 << bits) + 1)
    assert torch.equal(key_k.cpu(), want_key_k) and torch.equal(key_q.cpu(), want_key_q)
    order_k = torch.argsort(key_k, dim=-1, stable=True)
    block = routed_blocks(torch.gather(key_k, -1, order_k), key_q, b)
    assert block.dtype == torch.int64 and torch.equal(block.cpu(), want_block)
    query = slot_queries(block, N // 2 // b, b)
    k_rows, q_slots, group_block = level_positions(order_k, query, block, b)
    assert (query < 0).any()  # unused slots, which must stay -1, and unused groups
    assert torch.equal(q_slots.cpu(), want[0]) and torch.equal(k_rows.cpu(), want[1])
    assert torch.equal(group_block.cpu(), want[2])


def test_routing_takes_the_middle_of_the_run_or_where_it_would_be() -> None:
    """One level, one segment of 8 keys with sort keys 0 0 1 1 1 1 3 3 (blocks of 2): a query of key 1 goes to the
    middle of its run (rows 2-5: row 4, block 2); of key 2, absent, to where its run would start (row 6, block 3);
    of key 0 to row 1 (block 0); of key 3 to row 7 (block 3); of key 4, past every key, to the segment's last row
    (8 clamped to 7: block 3)."""
    key_sorted = torch.tensor([0, 0, 1, 1, 1, 1, 3, 3]).view(1, 1, 1, 8)
    key_q = torch.tensor([1, 2, 0, 3, 4, 1, 1, 0]).view(1, 1, 1, 8)
    block = routed_blocks(key_sorted.to(DEVICE), key_q.to(DEVICE), 2)
    assert block.view(-1).tolist() == [2, 3, 0, 3, 3, 2, 2, 0]


def test_positions_of_keys_and_queries_at_each_level() -> None:
    """N = 16, two levels: level 0's keys are tokens 0-7 and queries 8-15; level 1's keys 0-3 and 8-11, queries
    4-7 and 12-15. An unused slot (-1) stays -1. Groups of 2 slots take their first query's block; the group of
    an unused first slot, the last block (of 4)."""
    order = torch.arange(8).expand(1, 1, 2, 8).flip(-1)  # the sorted keys in reverse index order
    query = torch.tensor([[0, 3, -1, 7, 4, 5], [0, 3, -1, 7, 4, 5]], dtype=torch.int32).view(1, 1, 2, 6)
    block = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 3], [1, 1, 1, 1, 0, 0, 0, 0]]).view(1, 1, 2, 8)
    k_rows, q_slots, group_block = level_positions(order.to(DEVICE), query.to(DEVICE), block.to(DEVICE), 2)
    assert k_rows.shape == (2, 1, 1, 8) and q_slots.shape == (2, 1, 1, 6) and group_block.shape == (2, 1, 1, 3)
    assert k_rows[0].view(-1).tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    assert k_rows[1].view(-1).tolist() == [11, 10, 9, 8, 3, 2, 1, 0]
    assert q_slots[0].view(-1).tolist() == [8, 11, -1, 15, 12, 13]
    assert q_slots[1].view(-1).tolist() == [4, 7, -1, 15, 12, 13]
    assert group_block[0].view(-1).tolist() == [0, 3, 2] and group_block[1].view(-1).tolist() == [1, 3, 0]


def test_the_models_stacked_placement_is_the_pytorch_routing_of_its_hashes() -> None:
    """`stacked_placement` on a layer's own SimHash ranks (3 bits, 128 tokens, three levels), every output."""
    cfg = HyperMechanismConfig(block_size=4, sample_size=4, min_seq_len=16, lsh_bits=3)
    mech = HyperMechanism(cfg, head_dim=16, layer_index=0).to(DEVICE)
    levels = stacked_levels(128, cfg.min_seq_len, cfg.block_size, cfg.lsh_bits)
    assert levels == 3
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 2, 128, 16, generator=gen).to(DEVICE) for _ in "qk")
    _, want = placement_in_pytorch(mech.bucket_rank(k, None).cpu(), mech.bucket_rank(q, None).cpu(), levels,
                                   cfg.lsh_bits, cfg.block_size)
    got = stacked_placement(mech, q, k, levels)
    for name, g, w in zip(("q_slots", "k_rows", "group_block"), got, want):
        assert torch.equal(g.cpu(), w), name


def test_ranks_that_do_not_halve_are_refused() -> None:
    rank = torch.zeros(1, 1, 20, dtype=torch.long)  # 20 -> 10 -> 5 -> 2.5
    with pytest.raises(ValueError, match="halving 3 times"):
        stacked_sort_keys(rank.to(DEVICE), rank.to(DEVICE), 3, 3)


def piece_order(samples_SB: torch.Tensor, levels: int) -> torch.Tensor:
    """[2^l * B, ...] rows in the recursion's batch order -> [2^l, B, ...] in position order: the recursion's batch
    index of piece s is s with its l bits reversed (each level concatenates [first halves, second halves])."""
    if levels == 0:
        return samples_SB[None]
    rest = samples_SB.shape[1:]
    bits = samples_SB.view(*([2] * levels), -1, *rest)
    return bits.permute(*reversed(range(levels)), *range(levels, bits.dim())).reshape(1 << levels, -1, *rest)


def test_piece_order_undoes_the_recursions_concatenations():
    """The recursion's batch at level l lists its pieces as each level's cat([first halves, second halves]) left
    them; piece_order puts the rows of that batch back in position order."""
    for levels in range(4):
        batch = [0]  # position index of the piece in each batch row, built as the recursion concatenates
        for _ in range(levels):
            batch = [2 * p for p in batch] + [2 * p + 1 for p in batch]
        B = 2
        rows = torch.tensor(batch).repeat_interleave(B)[:, None] * 10 + torch.arange(B).repeat(len(batch))[:, None]
        placed = piece_order(rows, levels)  # [2^l, B, 1]
        assert placed.shape == (1 << levels, B, 1)
        assert placed[..., 0].tolist() == [[10 * p + b for b in range(B)] for p in range(1 << levels)]


def tables_in_pytorch(mech: HyperMechanism, B: int, H: int, N: int, levels: int, group_block: torch.Tensor):
    """Each level's samples and tables as PyTorch ops made them, level by level, deepest first (what `level_tables`
    replaces): `sample_rows`' draw for the level's 2^l B pieces in the recursion's batch order, put in position
    order and offset to each piece's keys, sorted; `block_tables` and a searchsorted; `count_log_weight`."""
    m, b = mech.sample_size, mech.block_size
    rows, first_sample, first_group, log_w = {}, {}, {}, {}
    for level in reversed(range(levels)):
        pieces, half = 1 << level, N >> (level + 1)
        drawn = mech.sample_rows(pieces * B, H, half, half, torch.device("cpu"), level)
        drawn = piece_order(drawn, level) + torch.arange(0, pieces * half, half)[:, None, None, None]
        rows[level] = torch.sort(drawn.permute(1, 2, 0, 3).reshape(B, H, pieces * m), dim=-1).values
        first_group[level], first_row = block_tables(group_block[level], N // 2 // b, b)
        first_sample[level] = torch.searchsorted(rows[level], first_row)
        log_w[level] = mech.count_log_weight(half, (B, pieces), torch.device("cpu"))
    return rows, first_sample, first_group, log_w


def sorted_group_blocks(levels: int, B: int, H: int, G: int, n_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """[L, B, H, G] ascending key blocks of the groups, as `grouped_rows` gives them: several groups on some blocks,
    none on others, unused groups on the last."""
    return torch.randint(0, n_blocks, (levels, B, H, G), generator=gen).sort(dim=-1).values


@pytest.mark.parametrize("training", [True, False], ids=["training", "evaluation"])
@pytest.mark.parametrize("N, levels, b, m", [
    (64, 3, 4, 8),    # pieces of 8 keys at the deepest level: as many samples as keys
    (64, 2, 2, 5),    # 5 samples in a tile of 8; 16 key blocks a piece at level 0, in tiles of 4
    (96, 1, 4, 1),    # one level, one sample a piece
    (128, 4, 4, 3),   # four levels: pieces 0..7 at the deepest, their batch order 3 bits reversed
])
def test_the_level_tables_are_the_recursions_samples_and_tables(training: bool, N: int, levels: int, b: int,
                                                                 m: int) -> None:
    """Two batch rows and three heads (the batch order interleaves pieces and rows); the draws the recursion makes
    from one seed in training, and each level's own evaluation draw: rows, first samples, first groups and
    weights equal the level-by-level PyTorch ops bitwise (the weights: log(half / m) in float64, rounded once, as
    `count_log_weight`; a float32 log differs from it at half / m = 16 / 3, 8 / 3, 32 / 5, ...)."""
    B, H = 2, 3
    cfg = HyperMechanismConfig(block_size=b, sample_size=m, min_seq_len=4, lsh_bits=3)
    mech = HyperMechanism(cfg, head_dim=8, layer_index=2).train(training)
    n_blocks = N // 2 // b
    group_block = sorted_group_blocks(levels, B, H, n_blocks + 3, n_blocks, torch.Generator().manual_seed(N + m))
    torch.manual_seed(17)
    want = tables_in_pytorch(mech, B, H, N, levels, group_block)
    torch.manual_seed(17)
    uniforms = level_uniforms(mech, B, H, levels, torch.device("cpu"))
    rows, first_sample, first_group, log_w = level_tables(uniforms.to(DEVICE), group_block.to(DEVICE), N // 2, m,
                                                          b, shared=not training)
    for level in range(levels):
        for name, got, expected in zip(("rows", "first_sample", "first_group", "log_w"),
                                       (rows[level], first_sample[level], first_group[level], log_w[level]),
                                       (table[level] for table in want)):
            assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected), (level, name)


def test_without_samples_the_tables_are_the_groups_alone() -> None:
    """sample_size 0: no rows, every key block's first sample 0, its first group as `block_tables` finds it."""
    L, B, H, N, b = 2, 1, 2, 32, 4
    group_block = sorted_group_blocks(L, B, H, 6, N // 2 // b, torch.Generator().manual_seed(3))
    rows, first_sample, first_group, _ = level_tables(None, group_block.to(DEVICE), N // 2, 4, b, shared=False)
    assert all(r.numel() == 0 for r in rows) and not first_sample.any()
    for level in range(L):
        assert torch.equal(first_group[level].cpu(), block_tables(group_block[level], N // 2 // b, b)[0])


@pytest.mark.parametrize("training, m", [(True, 5), (False, 5), (True, 0)],
                         ids=["training", "evaluation", "no-samples"])
def test_diagonal_tables_are_the_tables_of_query_block_g_against_key_block_g(training: bool, m: int) -> None:
    """The non-causal layer's one piece (20 key blocks of 4 keys, in tiles of 4 blocks and of 4 groups): the group
    blocks the kernel writes are 0 .. NB - 1 for every batch row and head, and the samples and tables are
    `level_tables`' from that index, bitwise, from the same draws."""
    B, H, N, b = 2, 3, 80, 4
    cfg = HyperMechanismConfig(block_size=b, sample_size=m, min_seq_len=4, lsh_bits=3)
    mech = HyperMechanism(cfg, head_dim=8, layer_index=1).train(training)
    torch.manual_seed(23)
    uniforms = level_uniforms(mech, B, H, 1, torch.device("cpu"))
    uniforms = None if uniforms is None else uniforms.to(DEVICE)
    *got, group_block = diagonal_tables(uniforms, B, H, N, m, b, not training, DEVICE)
    assert torch.equal(group_block.cpu(), torch.arange(N // b).expand(1, B, H, N // b))
    want = level_tables(uniforms, torch.arange(N // b).expand(1, B, H, N // b).to(DEVICE), N, m, b, not training)
    for name, got_table, want_table in zip(("rows", "first_sample", "first_group", "log_w"), got, want):
        got_table, want_table = (t if isinstance(t, torch.Tensor) else t[0] for t in (got_table, want_table))
        assert torch.equal(got_table.cpu(), want_table.cpu()), name
