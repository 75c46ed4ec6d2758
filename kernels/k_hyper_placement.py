"""Triton kernels of the index work of HyperAttention's stacked causal levels (models/attention/hyper_levels.py
`stacked_placement`): the levels' sort keys, each query's routed key block, and the token positions of the sorted
keys and of the grouped queries. About thirty small PyTorch ops for all levels together, most of them on [L, M]
index tensors, become three launches; on a GPU the host's time per launch, not the work, set what they cost.

Every program handles BLOCK indices i of one level l of one (batch, head). Level l stacks the first and second
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
    ORDER, QUERY, K_ROWS, Q_SLOTS,
    n_half, n_slots,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """K_ROWS [L, B, H, M]: the token of level l's sorted key i (ORDER [B, H, L, M], its index in the level's keys);
    Q_SLOTS [L, B, H, G * b]: the token of the query in slot i (QUERY [B, H, L, G * b], its index in the level's
    queries, -1 in an unused slot, which stays -1). Level-major, as the levels' kernels take them."""
    level = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    n_levels = tl.num_programs(1)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    half = n_half >> level
    live_k = i < n_half
    key_index = tl.load(ORDER + (bh * n_levels + level) * n_half + i, mask=live_k, other=0)
    out_row = (level * tl.num_programs(2) + bh) * n_half
    tl.store(K_ROWS + out_row + i, (key_index // half) * half + key_index, mask=live_k)
    live_q = i < n_slots
    query_index = tl.load(QUERY + (bh * n_levels + level) * n_slots + i, mask=live_q, other=-1)
    used = query_index >= 0
    safe = tl.where(used, query_index, 0)
    token = tl.where(used, (safe // half) * half + safe + half, -1)
    tl.store(Q_SLOTS + (level * tl.num_programs(2) + bh) * n_slots + i, token, mask=live_q)
