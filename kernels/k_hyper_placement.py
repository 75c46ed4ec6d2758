"""Triton kernels of the index work of HyperAttention's stacked causal levels (models/attention/hyper_levels.py
`stacked_placement`, `causal_levels`): the levels' sort keys, each query's routed key block, the token positions
of the sorted keys and of the grouped queries with each group's key block, and every level's sorted samples and
tables (`_level_tables`). About forty small PyTorch ops for all levels together, most of them on [L, M] index
tensors, and ten more a level, become four launches; on a GPU the host's time per launch, not the work, set what
they cost.

The first three programs handle BLOCK indices i of one level l of one (batch, head). Level l stacks the first and second
halves of its 2^l blocks: with half = M >> l (M = N / 2), index i lies in segment s = i // half, its key is token
2 s half + (i - s half) = s half + i and its query that token + half. Keys sort by (segment, bucket rank,
position): the key s * buckets + rank, then a stable sort.
"""

from __future__ import annotations

import triton
import triton.language as tl


def launch_config(interpret: bool) -> dict[str, int]:
    """1024 indices a program on a GPU; the interpreter's tiles of 16, so that the tests' short rows span several
    programs and a level's segments cross tile edges."""
    if interpret:
        return {"BLOCK": 16, "num_warps": 1}
    return {"BLOCK": 1024, "num_warps": 4}


def tables_config(interpret: bool, samples: int) -> dict[str, int]:
    """`_level_tables`' tiles: all of a piece's samples in one (sorted there), key blocks and groups in tiles of
    16 and 128 on a GPU (a [16, m] comparison per tile), of 4 under the interpreter (several tiles a piece)."""
    block_m = max(triton.next_power_of_2(samples), 2)
    if interpret:
        return {"BLOCK_M": block_m, "BLOCK_J": 4, "BLOCK_G": 4, "num_warps": 1}
    return {"BLOCK_M": block_m, "BLOCK_J": 16, "BLOCK_G": 128, "num_warps": 4}


@triton.jit
def _stacked_keys(
    RANK_K, RANK_Q, KEY_K, KEY_Q,
    n_tokens, n_half, buckets,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """KEY_K, KEY_Q [B, H, L, M]: segment * buckets + the bucket rank of level l's key (RANK_K) and query (RANK_Q)
    at index i; RANK_* [B, H, N] contiguous."""
    level = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n_half
    half = n_half >> level
    seg = i // half
    pos_k = seg * half + i
    rank_k = tl.load(RANK_K + bh * n_tokens + pos_k, mask=live, other=0)
    rank_q = tl.load(RANK_Q + bh * n_tokens + pos_k + half, mask=live, other=0)
    row = (bh * tl.num_programs(1) + level) * n_half
    seg_key = seg.to(tl.int64) * buckets
    tl.store(KEY_K + row + i, seg_key + rank_k, mask=live)
    tl.store(KEY_Q + row + i, seg_key + rank_q, mask=live)


@triton.jit
def _routed_blocks(
    KEY_SORTED, KEY_Q, BLOCK_OUT,
    n_half, block, n_steps,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """BLOCK_OUT [B, H, L, M]: the key block of level l's query i, the block holding the middle of the run of keys
    equal to its key in KEY_SORTED (its segment's keys in (bucket, position) order), or of where that run would
    be, and at most the segment's last key: `placed`'s routing. The run's ends are the left and right insertion
    points of torch.searchsorted, by binary search over the row in `n_steps` halvings (M's bit length)."""
    level = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n_half
    row = (bh * tl.num_programs(1) + level) * n_half
    key = tl.load(KEY_Q + row + i, mask=live, other=0)
    lo_left = tl.zeros([BLOCK], dtype=tl.int32)
    hi_left = tl.zeros([BLOCK], dtype=tl.int32) + n_half
    lo_right = tl.zeros([BLOCK], dtype=tl.int32)
    hi_right = tl.zeros([BLOCK], dtype=tl.int32) + n_half
    for _ in range(n_steps):
        # The first index whose key is >= the query's (left) and > it (right): [lo, hi) holds it.
        mid = (lo_left + hi_left) // 2
        open_ = lo_left < hi_left
        below = open_ & (tl.load(KEY_SORTED + row + mid, mask=live & open_, other=0) < key)
        lo_left = tl.where(below, mid + 1, lo_left)
        hi_left = tl.where(open_ & ~below, mid, hi_left)
        mid = (lo_right + hi_right) // 2
        open_ = lo_right < hi_right
        at_most = open_ & (tl.load(KEY_SORTED + row + mid, mask=live & open_, other=0) <= key)
        lo_right = tl.where(at_most, mid + 1, lo_right)
        hi_right = tl.where(open_ & ~at_most, mid, hi_right)
    half = n_half >> level
    last_key = (i // half) * half + half - 1  # the segment's last key
    chosen = tl.minimum((lo_left + lo_right) // 2, last_key) // block
    tl.store(BLOCK_OUT + row + i, chosen.to(tl.int64), mask=live)


@triton.jit
def _level_positions(
    ORDER, QUERY, BLOCK_IN, K_ROWS, Q_SLOTS, GROUP_BLOCK,
    n_half, n_slots, block, n_blocks,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """K_ROWS [L, B, H, M]: the token of level l's sorted key i (ORDER [B, H, L, M], its index in the level's keys);
    Q_SLOTS [L, B, H, G * b]: the token of the query in slot i (QUERY [B, H, L, G * b], its index in the level's
    queries, -1 in an unused slot, which stays -1); GROUP_BLOCK [L, B, H, G]: group g's key block, its first
    query's (BLOCK_IN [B, H, L, M], every used group has one), n_blocks - 1 for an unused group. Level-major, as
    the levels' kernels take them."""
    level = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    n_levels = tl.num_programs(1)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    half = n_half >> level
    in_row = (bh * n_levels + level) * n_half
    out_row = level * tl.num_programs(2) + bh
    live_k = i < n_half
    key_index = tl.load(ORDER + in_row + i, mask=live_k, other=0)
    tl.store(K_ROWS + out_row * n_half + i, (key_index // half) * half + key_index, mask=live_k)
    live_q = i < n_slots
    query_index = tl.load(QUERY + (bh * n_levels + level) * n_slots + i, mask=live_q, other=-1).to(tl.int64)
    used = query_index >= 0
    safe = tl.where(used, query_index, 0)
    token = tl.where(used, (safe // half) * half + safe + half, -1)
    tl.store(Q_SLOTS + out_row * n_slots + i, token, mask=live_q)
    n_groups = n_slots // block
    live_g = i < n_groups
    first = tl.load(QUERY + (bh * n_levels + level) * n_slots + i * block, mask=live_g, other=-1).to(tl.int64)
    first_block = tl.load(BLOCK_IN + in_row + tl.where(first >= 0, first, 0), mask=live_g & (first >= 0), other=0)
    tl.store(GROUP_BLOCK + out_row * n_groups + i, tl.where(first >= 0, first_block, n_blocks - 1), mask=live_g)


@triton.jit
def _level_tables(
    U, GROUP_BLOCK, SROW, SSTART, FIRST_GROUP, LOGW,
    batch, heads, n_half, m, block, n_groups, n_levels,
    SHARED: tl.constexpr, HAS_SAMPLES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_G: tl.constexpr, DIAGONAL: tl.constexpr = False,
):  # fmt: skip
    """The tables of piece s of level l, one (batch, head) a program, for the level's blocks + samples kernels
    (kernels/k_hyper_blocks.py, one segment a piece): with half = M >> l keys a piece and nbp = half / block blocks,
    - SROW: the piece's m samples as rows of the level's sorted keys, ascending (the kernels find a block's samples
      as one range): s * half + min(floor(u * half), half - 1), `sample_rows`' draw; level l's [B, H, 2^l m] at
      offset B H m (2^l - 1).
    - SSTART [L, B, H, NB + 1]: each key block's first sample (searchsorted(SROW, j * block)); the last piece also
      writes NB's entry, the end.
    - FIRST_GROUP [L, B, H, NB + 1]: each key block's first group (searchsorted(GROUP_BLOCK [L, B, H, G], j)).
    - LOGW: level l's [B, 2^l] at offset B (2^l - 1): the samples' weight log(half / m), in float64 then rounded
      (`count_log_weight`'s value).
    U: in training level l's uniforms [2^l B, H, m], levels deepest first (their order of draws), in the
    recursion's batch order (piece s at row rev_l(s) B + b: each level concatenates first halves, then second);
    SHARED (evaluation): [L, H, m], one draw a level for every piece and batch row.
    DIAGONAL (one level of one piece, G = NB: the non-causal layer, whose group g is query block g): group g sees
    key block g, written into GROUP_BLOCK here rather than read, and block j's first group is j."""
    s = tl.program_id(0)
    level = tl.program_id(1)
    bh = tl.program_id(2)
    pieces = 1 << level
    if s < pieces:
        half = n_half >> level
        nbp = half // block
        n_blocks = n_half // block
        batch_heads = tl.num_programs(2)
        table_row = (level * batch_heads + bh).to(tl.int64) * (n_blocks + 1)
        n_j = nbp + (s == pieces - 1).to(tl.int32)  # the last piece writes the end too
        if HAS_SAMPLES:
            i = tl.arange(0, BLOCK_M)
            live = i < m
            if SHARED:
                u_row = level * heads + bh % heads
            else:
                rev = s * 0
                for bit in range(level):
                    rev = rev * 2 + ((s >> bit) & 1)
                drawn_before = batch * heads * ((1 << n_levels) - (2 << level))  # the deeper levels' rows
                u_row = drawn_before + (rev * batch + bh // heads) * heads + bh % heads
            u = tl.load(U + u_row.to(tl.int64) * m + i, mask=live, other=0.0)
            local = tl.minimum((u * half.to(tl.float32)).to(tl.int64), half - 1)
            local = tl.sort(tl.where(live, local, half))  # the unused lanes after every sample
            srow = (batch * heads * (pieces - 1) + bh * pieces + s).to(tl.int64) * m
            tl.store(SROW + srow + i, s * half + local, mask=live)
            log_w = tl.log(half.to(tl.float64) / m).to(tl.float32)
            tl.store(LOGW + batch * (pieces - 1) + (bh // heads) * pieces + s, log_w, mask=bh % heads == 0)
        for j0 in range(0, n_j, BLOCK_J):
            t = j0 + tl.arange(0, BLOCK_J)
            j = s * nbp + t
            first_sample = s * m + tl.zeros([BLOCK_J], dtype=tl.int64)
            if HAS_SAMPLES:
                first_sample += tl.sum((local[None, :] < (t * block)[:, None]).to(tl.int64), axis=1)
            tl.store(SSTART + table_row + j, first_sample, mask=t < n_j)
            if DIAGONAL:
                first_group = j.to(tl.int64)  # the groups before block j are blocks 0 .. j - 1
            else:
                first_group = tl.zeros([BLOCK_J], dtype=tl.int64)
                for g0 in range(0, n_groups, BLOCK_G):
                    g = g0 + tl.arange(0, BLOCK_G)
                    group_block = tl.load(GROUP_BLOCK + (level * batch_heads + bh).to(tl.int64) * n_groups + g,
                                          mask=g < n_groups, other=n_blocks + 1)
                    first_group += tl.sum((group_block[None, :] < j[:, None]).to(tl.int64), axis=1)
            tl.store(FIRST_GROUP + table_row + j, first_group, mask=t < n_j)
        if DIAGONAL:  # no tensor of the groups' blocks exists before: this program writes its (batch, head)'s
            for g0 in range(0, n_groups, BLOCK_G):
                g = g0 + tl.arange(0, BLOCK_G)
                tl.store(GROUP_BLOCK + bh.to(tl.int64) * n_groups + g, g.to(tl.int64), mask=g < n_groups)
