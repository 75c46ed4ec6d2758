"""The index work of HyperAttention's stacked causal levels on the Triton kernels of k_hyper_placement.py, for
models/attention/hyper_levels.py `stacked_placement`. Integers only, nothing to differentiate: plain functions.
Under `kernels.dispatch.stand_in_kernels()` each launch is counted, not run, and its outputs allocated as the
kernel's (kernels/stand_in.py).
"""

from __future__ import annotations

import torch

from kernels import stand_in
from kernels.flash_attention import cdiv, interpreter_enabled, jit_module


def _launch(name: str, kernel_name: str, outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
            sizes: tuple[int, ...], grid_len: int, levels: int, batch_heads: int) -> None:
    from kernels import k_hyper_placement

    kern = jit_module(k_hyper_placement)
    cfg = kern.launch_config(interpreter_enabled())
    grid = (cdiv(grid_len, cfg["BLOCK"]), levels, batch_heads)
    stand_in.launch(name, lambda: getattr(kern, kernel_name)[grid](*inputs, *outputs, *sizes, **cfg))


def stacked_sort_keys(rank_k_BHN: torch.Tensor, rank_q_BHN: torch.Tensor, levels: int,
                      buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys' sort keys, queries' sort keys), each [B, H, L, N / 2] int64, of every level: segment * buckets + the
    bucket rank of the level's key (the first half of its segment's block) or query (the second half)."""
    B, H, N = rank_k_BHN.shape
    if rank_q_BHN.shape != rank_k_BHN.shape or N % (2 << max(levels - 1, 0)):
        raise ValueError(f"the ranks of keys and queries must both be [B, H, N] with N halving {levels} times; got "
                         f"{tuple(rank_k_BHN.shape)} and {tuple(rank_q_BHN.shape)}")
    M = N // 2
    log = stand_in.active()
    with stand_in.kernel_region(log):
        key_k, key_q = (torch.empty(B, H, levels, M, dtype=torch.int64, device=rank_k_BHN.device) for _ in "kq")
        _launch("hyper_level_keys", "_stacked_keys", (key_k, key_q),
                (rank_k_BHN.contiguous(), rank_q_BHN.contiguous()), (N, M, buckets), M, levels, B * H)
    return key_k, key_q


def routed_blocks(key_sorted_BHLM: torch.Tensor, key_q_BHLM: torch.Tensor, block: int) -> torch.Tensor:
    """[B, H, L, M] int64: each query's key block, the middle of its key's run among the sorted keys (or where that
    run would be), clamped to its segment's last key, as `placed` routes."""
    B, H, L, M = key_q_BHLM.shape
    log = stand_in.active()
    with stand_in.kernel_region(log):
        block_BHLM = torch.empty(B, H, L, M, dtype=torch.int64, device=key_q_BHLM.device)
        _launch("hyper_level_blocks", "_routed_blocks", (block_BHLM,),
                (key_sorted_BHLM.contiguous(), key_q_BHLM.contiguous()), (M, block, M.bit_length()), M, L, B * H)
    return block_BHLM


def level_positions(order_k_BHLM: torch.Tensor, query_BHLS: torch.Tensor, block_BHLM: torch.Tensor,
                    block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_rows [L, B, H, M], q_slots [L, B, H, S]) int64 tokens: of each level's sorted keys (`order_k`: indices
    into the level's keys), and of the query in each of its S slots (`query`, any integer dtype: indices into its
    queries, -1 for an unused slot, kept); and group_block [L, B, H, S / block], each group's key block: its first
    query's in `block_BHLM` (the routed blocks), M / block - 1 for an unused group."""
    B, H, L, M = order_k_BHLM.shape
    S = query_BHLS.shape[-1]
    log = stand_in.active()
    with stand_in.kernel_region(log):
        k_rows = torch.empty(L, B, H, M, dtype=torch.int64, device=order_k_BHLM.device)
        q_slots = torch.empty(L, B, H, S, dtype=torch.int64, device=order_k_BHLM.device)
        group_block = torch.empty(L, B, H, S // block, dtype=torch.int64, device=order_k_BHLM.device)
        _launch("hyper_level_positions", "_level_positions", (k_rows, q_slots, group_block),
                (order_k_BHLM.contiguous(), query_BHLS.contiguous(), block_BHLM.contiguous()),
                (M, S, block, M // block), max(M, S), L, B * H)
    return k_rows, q_slots, group_block


def level_tables(uniforms: torch.Tensor | None, group_block_LBHG: torch.Tensor, n_half: int, samples: int,
                 block: int, shared: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Each level's samples and tables for its blocks + samples kernels, in one launch (`_level_tables`):
    (sample rows [B, H, 2^l m] ascending, level l at l; each key block's first sample and first group, both
    [L, B, H, NB + 1]; the samples' log weights [B, 2^l]). `uniforms`: the draws, flat (training: level l's
    [2^l B, H, m] in the recursion's batch order, deepest level first; `shared`, evaluation: [L, H, m]); None
    without samples (then no rows, first samples 0, the weights unused)."""
    return _tables(uniforms, group_block_LBHG.contiguous(), n_half, samples, block, shared, diagonal=False)


def diagonal_tables(uniforms: torch.Tensor | None, batch: int, heads: int, n_keys: int, samples: int, block: int,
                    shared: bool, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor,
                                                             list[torch.Tensor], torch.Tensor]:
    """`level_tables` of one level of one piece whose group g sees key block g (the non-causal layer: n_keys keys
    in whole blocks, query block g against key block g), and that group_block [1, B, H, NB] too, written by the same
    launch, so no index tensor of it is made beforehand."""
    with stand_in.kernel_region(stand_in.active()):  # the kernel's output
        group_block = torch.empty(1, batch, heads, n_keys // block, dtype=torch.int64, device=device)
    return (*_tables(uniforms, group_block, n_keys, samples, block, shared, diagonal=True), group_block)


def _tables(uniforms: torch.Tensor | None, group_block_LBHG: torch.Tensor, n_half: int, samples: int, block: int,
            shared: bool, diagonal: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    from kernels import k_hyper_placement

    L, B, H, G = group_block_LBHG.shape
    m = samples if uniforms is not None else 0
    dev, n_blocks = group_block_LBHG.device, n_half // block
    log = stand_in.active()
    with stand_in.kernel_region(log):
        rows = torch.empty(B * H * m * ((1 << L) - 1), dtype=torch.int64, device=dev)
        first_sample, first_group = (torch.empty(L, B, H, n_blocks + 1, dtype=torch.int64, device=dev) for _ in "sg")
        log_w = (torch.empty if m else torch.zeros)(B * ((1 << L) - 1), dtype=torch.float32, device=dev)
        kern = jit_module(k_hyper_placement)
        unused = group_block_LBHG  # a pointer the kernel never reads without samples
        args = (uniforms if m else unused, group_block_LBHG, rows if m else unused, first_sample, first_group, log_w,
                B, H, n_half, m, block, G, L)
        cfg = kern.tables_config(interpreter_enabled(), m)
        grid = (1 << (L - 1), L, B * H)
        stand_in.launch("hyper_level_tables", lambda: kern._level_tables[grid](
            *args, SHARED=shared, HAS_SAMPLES=m > 0, DIAGONAL=diagonal, **cfg))
    level_rows = [rows[B * H * m * ((1 << l) - 1):B * H * m * ((2 << l) - 1)].view(B, H, m << l) for l in range(L)]
    level_log_w = [log_w[B * ((1 << l) - 1):B * ((2 << l) - 1)].view(B, 1 << l) for l in range(L)]
    return level_rows, first_sample, first_group, level_log_w
