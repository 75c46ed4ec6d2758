"""HyperAttention: exact attention on sortLSH diagonal blocks plus a uniformly sampled residual.

HyperAttention: Long-context Attention in Near-Linear Time. Han, Jayaram, Karbasi, Mirrokni, Woodruff, Zandieh
(ICLR 2024), arXiv 2310.05869. Algorithm 1 (sortLSH) finds the heavy entries: queries and keys are hashed with
`lsh_bits` SimHash hyperplanes, sorted by bucket, and attend exactly within diagonal blocks of `block_size`.
The rest of the row (Algorithms 2-3, "practical" version of Sec. 4) is estimated from `sample_size` keys drawn
uniformly with replacement, keys of the query's own block excluded, weighted by n / m. The parts merge through
their log-sum-exp. Causal masking follows Algorithm 4: two causal diagonal halves recurse, the off-diagonal
block (all keys before all queries) is the non-causal algorithm; exact causal attention once a piece is no
longer than `min_seq_len`. Inputs shorter than `min_seq_len` are exact.

Causal routing (`causal_routing`). In the off-diagonal block every key is earlier than every query, but the
paper's sortLSH sorts the block's QUERIES together, so a query's block of keys depends on how many later
queries hash below it: the output leaks the future in value. `past_only` (the default) places each query in
the sorted key order by its own hash (a search into the sorted key buckets, the middle of its bucket's run)
and gives it the key block found there; queries are then grouped per key block (ceil(count / b) groups of b
each, at most n/b + n_blocks groups), so the cost stays O(n b) and every piece is one batched exact attention.

Differences from the official code (insuhan/hyper-attn), all deliberate (see docs/long_attention.md):
- Buckets are ordered by the inverse Gray code, so neighbouring buckets differ in exactly one bit (the
  official `perm[code]` breaks this for 31 of 127 neighbours at r = 7).
- The LSE is not detached: gradients flow through the merge weights.
- Padding to a multiple of `block_size` uses masked keys sorted after every real key (the official zero
  padding adds keys with logit 0); key-padding masks are honoured, padded keys never sampled into a result.
- Samples are drawn among real keys only, weighted by the real count n / m, independently per batch row, head
  and call (so per recursion level) in training, from the global torch RNG (which reversible layers save and
  replay). Evaluation draws from a per-(layer, level) generator shared by the rows of a batch, so validation
  numbers repeat and do not depend on the batch. Hyperplanes are a fixed function of (seed, layer).
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import model_validator

from kernels.dispatch import fused_kernels
from kernels.hyper_blocks import hyper_block_flash_attention
from kernels.hyper_placement import diagonal_tables, level_tables
from kernels.merge_rounds import merge_below
from kernels.simhash import MAX_BITS, simhash_rank
from models.attention.base import _AttentionConfig, _MechanismConfig, _MechanismKindConfig
from models.attention.device_copies import DeviceCopies
from models.attention.exact import ExactMechanism
from models.attention.hyper_groups import group_queries, grouped_rows
from models.attention.hyper_levels import causal_levels, level_uniforms, stacked_levels
from models.attention.hyper_rows import causal_rows
from models.attention.lengths import hyper_dropout, hyper_length, hyper_model
from models.attention.lse import exact_attention, merge_lse, merge_lse_below

_LAYER_SEED_STRIDE = 1_000_003
_LEVEL_SEED_STRIDE = 7919  # evaluation samples: one generator seed per (layer, recursion level)

PAPER_ROUTING_LEAK = (
    "hyper with causal_routing=paper under a causal mask leaks the future: sortLSH sorts the queries of an "
    "off-diagonal block together, so a query's keys depend on later queries and its output changes when later "
    "inputs change; set model.attention.causal_routing=past_only for a causal model"
)

MAX_LSH_BITS = MAX_BITS
"""A code's bits are weighted in int32 (`bucket_rank`; its kernel's bound, kernels/simhash.py), so 2^30 buckets is a
safe ceiling."""
RANK_TABLE_BITS = 16
"""Up to 2^16 buckets the Gray rank of a code is read from a table (one gather; the prefix XOR is 2 log2(r) launches
per hash, which on a GPU cost more than their bytes); above, the table would outgrow the tokens it ranks."""


class HyperMechanismConfig(_MechanismConfig):
    """HyperAttention (Han, Jayaram, Karbasi, Mirrokni, Woodruff, Zandieh, 2023, arXiv 2310.05869)."""

    kind: Literal["hyper"] = "hyper"
    block_size: int = 256
    """Size of the exact diagonal blocks in sortLSH order (the paper's b); inputs are padded internally."""
    sample_size: int = 256
    """Uniformly sampled keys per (batch, head) for the residual part (the paper's m); 0 = blocks only."""
    min_seq_len: int = 4096
    """Shorter inputs run exact attention; also the base case of the causal recursion."""
    lsh_bits: int = 7
    """SimHash hyperplanes r (2^r buckets ordered along a Gray code); the official code uses 7."""
    seed: int = 0
    """Seed of the hyperplanes; each layer derives its own from it, fixed for the model's life."""
    causal_routing: Literal["past_only", "paper"] = "past_only"
    """Under causal: past_only places each query in the key order by its own hash (a function of the past
    only); paper sorts the queries of a block together, which LEAKS THE FUTURE."""
    check_length, check_model = hyper_length, hyper_model

    @model_validator(mode="after")
    def _check(self) -> "HyperMechanismConfig":
        if self.block_size < 1:
            raise ValueError(f"model.attention.block_size must be >= 1 (got {self.block_size}); the paper uses 256")
        if self.sample_size < 0:
            raise ValueError(f"model.attention.sample_size must be >= 0 (got {self.sample_size}); "
                             "0 keeps only the diagonal blocks, the paper uses 256")
        if self.min_seq_len < 2:
            raise ValueError(f"model.attention.min_seq_len must be >= 2 (got {self.min_seq_len}); the causal "
                             "recursion halves the sequence until it is at most min_seq_len long")
        if not 1 <= self.lsh_bits <= MAX_LSH_BITS:
            raise ValueError(f"model.attention.lsh_bits must be in [1, {MAX_LSH_BITS}] (got {self.lsh_bits}); "
                             "it is the number of hash hyperplanes (2^lsh_bits buckets), the official code uses 7")
        return self


class HyperConfig(HyperMechanismConfig, _MechanismKindConfig):
    """`mha` projections with the HyperAttention mechanism; the knobs sit at the top level of the block."""

    kind: Literal["hyper"] = "hyper"  # type: ignore[assignment]

    tiny_knobs = {"block_size": 4, "sample_size": 4, "min_seq_len": 8, "lsh_bits": 2}
    bench_knobs = {"block_size": 16, "sample_size": 16, "min_seq_len": 32}


def gray_rank(code: torch.Tensor, bits: int) -> torch.Tensor:
    """Position of each code along the reflected Gray sequence 0, 1, 3, 2, 6, ... (the inverse Gray map).

    Sorting by this rank puts codes that differ in one bit next to each other: the Hamming-ordered LSH of
    HyperAttention's Definition 1. The inverse of g = s ^ (s >> 1) is the prefix XOR of g's bits.
    """
    rank, shift = code.clone(), 1
    while shift < bits:
        rank ^= rank >> shift
        shift <<= 1
    return rank


def real_keys(key_padding_BN: torch.Tensor | None, B: int, N: int, device: torch.device) -> torch.Tensor:
    """Real (unpadded) keys of each of the B batch rows, [B] int64 (N each without a mask)."""
    return torch.full((B,), N, device=device) if key_padding_BN is None else (~key_padding_BN).sum(-1)


def longest_real_row(key_padding_BN: torch.Tensor | None, N: int) -> int:
    """Real (unpadded) keys of the batch's longest row."""
    return N if key_padding_BN is None else int((~key_padding_BN).sum(-1).max().item())


class HyperMechanism(nn.Module):
    """HyperAttention over per-head q [B, H, T, E], k, v [B, H, S, E]."""

    supports_causal = True
    config_cls = HyperMechanismConfig

    def __init__(self, cfg: HyperMechanismConfig, head_dim: int, layer_index: int, dropout: float = 0.0):
        super().__init__()
        hyper_dropout(dropout)
        self.exact = ExactMechanism()
        self.block_size, self.sample_size = cfg.block_size, cfg.sample_size
        self.min_seq_len, self.bits = cfg.min_seq_len, cfg.lsh_bits
        self.past_only = cfg.causal_routing == "past_only"
        layer_seed = cfg.seed + _LAYER_SEED_STRIDE * layer_index
        self.eval_seed = layer_seed + 1
        gen = torch.Generator().manual_seed(layer_seed)
        # Fixed per layer, not a parameter: a buffer follows .to(device) but is not trained or saved.
        self.register_buffer("hyperplanes", torch.randn(head_dim, self.bits, generator=gen), persistent=False)
        table = gray_rank(torch.arange(1 << self.bits), self.bits) if self.bits <= RANK_TABLE_BITS else None
        self.register_buffer("rank_of_code", table, persistent=False)
        # The bits' weights, made once: two launches fewer per hash than an arange and a shift at each call.
        self.register_buffer("bit_weights", 1 << torch.arange(self.bits, dtype=torch.int32), persistent=False)
        self._eval_draws = DeviceCopies()

    @classmethod
    def from_config(
        cls, cfg: HyperMechanismConfig, attention: _AttentionConfig, layer_index: int, shared_state: nn.ModuleDict
    ) -> HyperMechanism:
        """The registry's builder (models/attention/registry.py)."""
        return cls(cfg, attention.head_dim, layer_index, attention.dropout)

    def bucket_rank(self, x_BHTE: torch.Tensor, padding_BT: torch.Tensor | None) -> torch.Tensor:
        """Gray-ordered bucket [B, H, T]; padded rows get 2^bits, after every real bucket."""
        if fused_kernels(x_BHTE):  # the same ranks in one launch (kernels/k_simhash.py)
            rank_BHT = simhash_rank(x_BHTE.detach(), self.hyperplanes)
        else:
            bits_BHTR = (x_BHTE.detach() @ self.hyperplanes.to(x_BHTE.dtype)) > 0
            # Weighted in int32 and summed into int64: no int64 copy of the [B, H, T, r] bits (8x the bool tensor).
            code_BHT = (bits_BHTR * self.bit_weights).sum(-1, dtype=torch.long)
            rank_BHT = gray_rank(code_BHT, self.bits) if self.rank_of_code is None else self.rank_of_code[code_BHT]
        if padding_BT is not None:
            rank_BHT = rank_BHT.masked_fill(padding_BT[:, None, :], 1 << self.bits)
        return rank_BHT

    def forward(self, q_BHTE, k_BHSE, v_BHSE, *, key_padding_mask_BS=None, causal=False):
        T, S = q_BHTE.shape[2], k_BHSE.shape[2]
        if T != S:
            raise ValueError(f"hyper attention needs queries and keys of the same length (got {T} and {S}); "
                             "cross-attention is built with cross=True, which mixes exactly")
        # An input that is exact all through (the thresholds of causal() and non_causal()) has no lse to merge at
        # the top level: torch's fused SDPA (a flash kernel on CPU and GPU) is faster than the lse-returning
        # path and never holds the T x T scores.
        if causal:
            if T <= self.min_seq_len:
                return self.exact(q_BHTE, k_BHSE, v_BHSE, key_padding_mask_BS=key_padding_mask_BS, causal=True)
            if not self.past_only:
                warnings.warn(PAPER_ROUTING_LEAK, UserWarning, stacklevel=2)
            return self.causal(q_BHTE, k_BHSE, v_BHSE, key_padding_mask_BS)[0]
        if longest_real_row(key_padding_mask_BS, T) < self.min_seq_len:
            return self.exact(q_BHTE, k_BHSE, v_BHSE, key_padding_mask_BS=key_padding_mask_BS)
        return self.non_causal(q_BHTE, k_BHSE, v_BHSE, key_padding_mask_BS, key_padding_mask_BS)[0]

    def non_causal(self, q_BHNE, k_BHNE, v_BHNE, key_padding_BN, query_padding_BN, level: int = 0):
        """(out [B, H, N, E], lse [B, H, N]); `query_padding_BN` only moves padded queries to the end."""
        B, H, N, E = q_BHNE.shape
        # The longest real row decides, so appending padding never switches a batch to the approximation.
        if longest_real_row(key_padding_BN, N) < self.min_seq_len:
            return exact_attention(q_BHNE, k_BHNE, v_BHNE, key_padding_mask=key_padding_BN)
        b = self.block_size
        nb = -(-N // b)
        extra = nb * b - N  # internal padding: masked keys (and unused queries) after every real row
        # (bucket, position) order: a stable sort keeps positions ascending within a bucket.
        order_q_BHN = torch.argsort(self.bucket_rank(q_BHNE, query_padding_BN), dim=-1, stable=True)
        order_k_BHN = torch.argsort(self.bucket_rank(k_BHNE, key_padding_BN), dim=-1, stable=True)

        def sort(x_BHNE: torch.Tensor, order_BHN: torch.Tensor) -> torch.Tensor:
            x = torch.gather(x_BHNE, 2, order_BHN[..., None].expand(B, H, N, x_BHNE.shape[-1]))
            return F.pad(x, (0, 0, 0, extra)) if extra else x  # a pad of width 0 would still copy

        if fused_kernels(q_BHNE):  # (1) and (2) in one softmax, read through the orders (kernels/k_hyper_blocks.py)
            # Fillers -1 after the order; none (and no copy) when the length is a multiple of the block.
            rows = lambda order_BHN: F.pad(order_BHN, (0, extra), value=-1) if extra else order_BHN  # noqa: E731
            return self.blocks_and_samples(q_BHNE, k_BHNE, v_BHNE, rows(order_q_BHN), rows(order_k_BHN), None,
                                           key_padding_BN, level)  # query block g against key block g
        q_s, k_s, v_s = sort(q_BHNE, order_q_BHN), sort(k_BHNE, order_k_BHN), sort(v_BHNE, order_k_BHN)
        kpad_BHN = torch.zeros(B, H, N, dtype=torch.bool, device=q_BHNE.device)
        if key_padding_BN is not None:
            kpad_BHN = torch.gather(key_padding_BN[:, None, :].expand(B, H, N), 2, order_k_BHN)
        kpad_s = F.pad(kpad_BHN, (0, extra), value=True)  # B, H, nb*b

        # (1) heavy part: exact attention inside each diagonal block of the sorted order.
        q_XbE = q_s.reshape(B * H * nb, 1, b, E)
        o_XbE, lse_Xb = exact_attention(
            q_XbE, k_s.reshape(B * H * nb, 1, b, E), v_s.reshape(B * H * nb, 1, b, E),
            key_padding_mask=kpad_s.reshape(B * H * nb, b),
        )
        out_s, lse_s = o_XbE.reshape(B, H, nb * b, E), lse_Xb.reshape(B, H, nb * b)

        # (2) light part, merged through the LSE; query block t sits next to key block t.
        if self.sample_size > 0:
            o_res, lse_res = self.residual(q_s.view(B, H, nb, b, E), torch.arange(nb, device=q_BHNE.device)
                                           .expand(B, H, nb), k_s, v_s, kpad_s, level)
            out_s, lse_s = merge_lse(out_s, lse_s, o_res, lse_res)

        undo_BHN = torch.argsort(order_q_BHN, dim=-1)
        out = torch.gather(out_s[:, :, :N], 2, undo_BHN[..., None].expand(B, H, N, E))
        return out, torch.gather(lse_s[:, :, :N], 2, undo_BHN)

    def residual(self, q_BHGbE, block_BHG, k_s, v_s, kpad_s, level: int):
        """The sampled part (out [B, H, G*b, E], lse [B, H, G*b]) of query groups; group g saw key block
        block_BHG[g] exactly. m keys drawn uniformly, with replacement, from the real keys (sorted first), per
        (batch row, head); a sample inside the group's own key block is already counted there, so it is masked.
        E[exp(lse)] = the row's sum of exp(logit) over the keys outside its block (importance weight n / m)."""
        B, H, G, b, E = q_BHGbE.shape
        m, n_keys = self.sample_size, k_s.shape[2]
        n_real_B = n_keys - kpad_s[:, 0].sum(-1)  # real keys per row (all heads share the mask)
        j_BHM = self.sample_rows(B, H, n_real_B, n_keys, q_BHGbE.device, level)
        k_J = torch.gather(k_s, 2, j_BHM[..., None].expand(B, H, m, E))
        v_J = torch.gather(v_s, 2, j_BHM[..., None].expand(B, H, m, E))
        drop_BHGM = (j_BHM // b)[:, :, None, :] == block_BHG[..., None]
        drop_BHGM = drop_BHGM | torch.gather(kpad_s, 2, j_BHM)[:, :, None, :]
        o_res, lse_res = exact_attention(
            q_BHGbE.reshape(B * H * G, 1, b, E),
            k_J[:, :, None].expand(B, H, G, m, E).reshape(B * H * G, 1, m, E),
            v_J[:, :, None].expand(B, H, G, m, E).reshape(B * H * G, 1, m, E),
            key_padding_mask=drop_BHGM.reshape(B * H * G, m),
        )
        log_w_B11 = self.sample_log_weight(n_real_B, lse_res.dtype)[:, None, None]
        return o_res.reshape(B, H, G * b, E), lse_res.reshape(B, H, G * b) + log_w_B11

    def sample_rows(self, B: int, H: int, n_real_B: torch.Tensor | int, n_rows: int, device: torch.device,
                    level: int):
        """[B, H, m] rows of the sorted keys drawn uniformly, with replacement, among each batch row's n_real_B real
        keys (sorted first; an int: the same count for every row): the one draw both ways of computing the sampled
        part take."""
        n_real = n_real_B[:, None, None] if isinstance(n_real_B, torch.Tensor) else n_real_B
        j_BHM = (self._uniform(B, H, self.sample_size, device, level) * n_real).long()
        return j_BHM.clamp(max=n_rows - 1)

    def sample_log_weight(self, n_real_B: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B] log(n / m): the importance weight of uniform sampling (n real keys of the row), in log space."""
        return torch.log(n_real_B.clamp(min=1).to(dtype) / self.sample_size)

    def count_log_weight(self, n_real: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """`sample_log_weight` of a count every row shares, as one fp32 fill (four launches fewer): log(n / m) on the
        host in float64, rounded once, where the tensor's fp32 division and log round twice; the two differ by
        at most one fp32 ulp, and for 1 <= n < 300,000 at m = 256 in 2 counts of 300,000."""
        return torch.full(shape, math.log(max(n_real, 1) / self.sample_size), device=device, dtype=torch.float32)

    def blocks_and_samples(self, q_BHME, k_BHNE, v_BHNE, q_slots, k_rows, group_block_BHG, key_padding_BN, level):
        """(out, lse) of the block part and the sampled part in one softmax on the Triton kernels
        (kernels/hyper_blocks.py): the queries at `q_slots`, the sorted keys at `k_rows` (-1: filler), group g
        against key block group_block_BHG[g] (None: block g) and the samples, drawn as `residual` draws them."""
        B, H, N = k_BHNE.shape[:3]
        dev = q_BHME.device
        tables = None  # each key block's first group and first sample, when made on the kernel
        if key_padding_BN is None and k_rows.shape[-1] == N:  # N real keys a row in whole blocks: one piece's
            # samples and tables in one launch (kernels/hyper_placement.py), the same integers as below
            uniforms = level_uniforms(self, B, H, 1, dev, first_level=level)
            if group_block_BHG is None:  # the groups' blocks come from the same launch
                rows, first_sample, first_group, log_w, group_block_LBHG = diagonal_tables(
                    uniforms, B, H, N, self.sample_size, self.block_size, not self.training, dev)
                group_block_BHG = group_block_LBHG[0]
            else:
                group_block_BHG = group_block_BHG.contiguous()  # once, for the tables and the kernels
                rows, first_sample, first_group, log_w = level_tables(
                    uniforms, group_block_BHG[None], N, self.sample_size, self.block_size, shared=not self.training)
            samples_BHm, log_w_B, tables = rows[0], log_w[0].view(B), (first_group[0], first_sample[0])
        elif self.sample_size > 0:
            # Without padding every row has N keys: a count on the host, no [B] tensor of it.
            n_real = N if key_padding_BN is None else real_keys(key_padding_BN, B, N, dev)
            samples_BHm = self.sample_rows(B, H, n_real, k_rows.shape[-1], dev, level)
            log_w_B = (self.count_log_weight(N, (B,), dev) if key_padding_BN is None
                       else self.sample_log_weight(n_real, torch.float32))
        else:  # blocks only: no samples, their weight unused
            samples_BHm, log_w_B = torch.zeros(B, H, 0, dtype=torch.long, device=dev), torch.zeros(B, device=dev)
        if group_block_BHG is None:  # padded keys, or keys short of whole blocks: block g's index made here
            nb = k_rows.shape[-1] // self.block_size
            group_block_BHG = torch.arange(nb, device=dev).expand(B, H, nb)
        return hyper_block_flash_attention(q_BHME, k_BHNE, v_BHNE, q_slots, k_rows, group_block_BHG, samples_BHm,
                                           log_w_B, self.block_size, key_padding_mask=key_padding_BN, tables=tables)

    def _uniform(self, B: int, H: int, m: int, device: torch.device, level: int) -> torch.Tensor:
        if self.training:
            return torch.rand(B, H, m, device=device)
        return self.eval_draws(H, m, level + 1, device)[level].expand(B, H, m)

    def eval_draws(self, H: int, m: int, levels: int, device: torch.device) -> torch.Tensor:
        """[at least `levels`, H, m]: evaluation's fixed draws, level l at l from its own generator (a seed per
        layer and level), on the device once."""
        seed = lambda level: self.eval_seed + _LEVEL_SEED_STRIDE * level  # noqa: E731
        return self._eval_draws.get(device, torch.float32, (H, m), lambda _kept: torch.cat([torch.rand(
            1, H, m, generator=torch.Generator().manual_seed(seed(level))) for level in range(levels)]),
            large_enough=lambda kept: kept.shape[0] >= levels)

    def placed(self, q_BHME, k_BHNE, v_BHNE, key_padding_BN, level: int):
        """Past-only routing of an off-diagonal block: (out [B, H, M, E], lse [B, H, M]). Keys are sorted by
        bucket; a query goes to the key block holding the middle of its own bucket's run in that order (or
        where its bucket would be), so what it sees depends on its own hash and on the keys only."""
        B, H, M, E = q_BHME.shape
        N = k_BHNE.shape[2]
        if longest_real_row(key_padding_BN, N) < self.min_seq_len:
            return exact_attention(q_BHME, k_BHNE, v_BHNE, key_padding_mask=key_padding_BN)
        b, dev = self.block_size, q_BHME.device
        nb = -(-N // b)
        rank_k_BHN = self.bucket_rank(k_BHNE, key_padding_BN)
        order_k_BHN = torch.argsort(rank_k_BHN, dim=-1, stable=True)  # by bucket, then position
        rank_ks_BHN = torch.gather(rank_k_BHN, 2, order_k_BHN)
        n_real_B11 = real_keys(key_padding_BN, B, N, dev)[:, None, None]

        rank_q_BHM = self.bucket_rank(q_BHME, None)
        lo = torch.searchsorted(rank_ks_BHN, rank_q_BHM, side="left")
        hi = torch.searchsorted(rank_ks_BHN, rank_q_BHM, side="right")
        block_BHM = torch.minimum((lo + hi) // 2, (n_real_B11 - 1).clamp(min=0)) // b
        if fused_kernels(q_BHME):  # one softmax read through the slots and the key order (kernels/k_hyper_blocks.py)
            q_slots, block_BHG = grouped_rows(block_BHM, nb, b)
            return self.blocks_and_samples(q_BHME, k_BHNE, v_BHNE, q_slots, F.pad(order_k_BHN, (0, nb * b - N),
                                           value=-1), block_BHG, key_padding_BN, level)
        slot_BHM, block_BHG = group_queries(block_BHM, nb, b)
        G = block_BHG.shape[-1]
        k_s, v_s = (torch.gather(x, 2, order_k_BHN[..., None].expand(B, H, N, E)) for x in (k_BHNE, v_BHNE))
        if nb * b > N:  # a pad of width 0 would still copy
            k_s, v_s = (F.pad(x, (0, 0, 0, nb * b - N)) for x in (k_s, v_s))
        kpad_BHN = torch.zeros(B, H, N, dtype=torch.bool, device=dev)
        if key_padding_BN is not None:
            kpad_BHN = torch.gather(key_padding_BN[:, None, :].expand(B, H, N), 2, order_k_BHN)
        kpad_s = F.pad(kpad_BHN, (0, nb * b - N), value=True)

        q_slots = torch.zeros(B, H, G * b, E, dtype=q_BHME.dtype, device=dev).scatter(
            2, slot_BHM[..., None].expand(B, H, M, E), q_BHME)
        blocks = lambda x: torch.gather(  # noqa: E731  [B, H, nb*b, ...] -> the key block of every group
            x.view(B, H, nb, b, *x.shape[3:]), 2, block_BHG.view(B, H, G, 1, *(1,) * (x.dim() - 3))
            .expand(B, H, G, b, *x.shape[3:]))
        out_s, lse_s = exact_attention(
            q_slots.view(B * H * G, 1, b, E), blocks(k_s).reshape(B * H * G, 1, b, E),
            blocks(v_s).reshape(B * H * G, 1, b, E), key_padding_mask=blocks(kpad_s).reshape(B * H * G, b))
        # Back from the G*b slots (about 2M) to the M queries before the merge, which is row by row: the same
        # values as merging every slot and gathering after, with the merge's fp32 buffers half as long.
        out = torch.gather(out_s.reshape(B, H, G * b, E), 2, slot_BHM[..., None].expand(B, H, M, E))
        lse = torch.gather(lse_s.reshape(B, H, G * b), 2, slot_BHM)
        if self.sample_size > 0:
            o_res, lse_res = self.residual(q_slots.view(B, H, G, b, E), block_BHG, k_s, v_s, kpad_s, level)
            out, lse = merge_lse(out, lse, torch.gather(o_res, 2, slot_BHM[..., None].expand(B, H, M, E)),
                                 torch.gather(lse_res, 2, slot_BHM))
        return out, lse

    def causal(self, q_BHNE, k_BHNE, v_BHNE, key_padding_BN, level: int = 0):
        """Algorithm 4: (out, lse) of causal attention by recursive halving."""
        B, H, N, E = q_BHNE.shape
        if N <= self.min_seq_len:
            return exact_attention(q_BHNE, k_BHNE, v_BHNE, causal=True, key_padding_mask=key_padding_BN)
        if level == 0 and key_padding_BN is None and self.past_only and fused_kernels(q_BHNE):
            levels = stacked_levels(N, self.min_seq_len, self.block_size, self.bits)
            if levels:  # every level's layout in one batch, one pass on the kernels (models/attention/hyper_levels.py)
                return causal_levels(self, q_BHNE, k_BHNE, v_BHNE, levels)
        odd = N % 2
        if odd:
            # One padded row at the end: under the causal mask only itself could see it, and it is dropped.
            q_BHNE, k_BHNE, v_BHNE = (F.pad(x, (0, 0, 0, 1)) for x in (q_BHNE, k_BHNE, v_BHNE))
            if key_padding_BN is None:
                key_padding_BN = torch.zeros(B, N, dtype=torch.bool, device=q_BHNE.device)
            key_padding_BN = F.pad(key_padding_BN, (0, 1), value=True)
        h = (N + odd) // 2
        # The halves as views through one unbind each (its backward stacks the two gradients into one tensor):
        # slices would each allocate a zero-filled gradient of the whole input in the backward, then add them.
        (q_top, q_bot), (k_top, k_bot), (v_top, v_bot) = (x.unflatten(2, (2, h)).unbind(2)  # 2 x (B, H, h, E)
                                                           for x in (q_BHNE, k_BHNE, v_BHNE))
        first_pad, second_pad = (None, None) if key_padding_BN is None else key_padding_BN.unflatten(1, (2, h)).unbind(1)
        pad_halves = None if key_padding_BN is None else torch.cat([first_pad, second_pad])
        out_d, lse_d = self.causal(torch.cat([q_top, q_bot]), torch.cat([k_top, k_bot]), torch.cat([v_top, v_bot]),
                                   pad_halves, level + 1)  # (2B, H, h, E): every piece of a level in one batch
        # Off-diagonal block: queries of the second half see every key of the first half, unmasked.
        if self.past_only:
            out_off, lse_off = self.placed(q_bot, k_top, v_top, first_pad, level)
        else:
            out_off, lse_off = self.non_causal(q_bot, k_top, v_top, first_pad, second_pad, level)
        merge = merge_below if fused_kernels(q_BHNE) else merge_lse_below  # one kernel each way on the kernels
        out, lse = merge(out_d, lse_d, out_off, lse_off)  # (B, H, 2h, E): first half, merged second
        return (out[:, :, :N], lse[:, :, :N]) if odd else (out, lse)

    def causal_last_rows(self, q_BHTE: torch.Tensor, k_BHSE: torch.Tensor, v_BHSE: torch.Tensor) -> torch.Tensor:
        """Rows S-T .. S-1 of `forward(causal=True)` over S positions, from those rows' queries and every key: a
        cached decoding step, one past-only placement per level (models/attention/hyper_rows.py: why these are the
        full pass's rows)."""
        T, S = q_BHTE.shape[2], k_BHSE.shape[2]
        if S <= self.min_seq_len:
            return self.exact.causal_last_rows(q_BHTE, k_BHSE, v_BHSE)
        if not self.past_only:
            raise ValueError("hyper with causal_routing=paper cannot decode from a cache: the key block of a query "
                             "depends on the later queries of its block; use causal_routing=past_only")
        if self.training and self.sample_size > 0:
            raise ValueError("hyper draws fresh samples on every training call, so a cached step cannot repeat the "
                             "full pass's; decode in evaluation mode (model.eval())")
        return causal_rows(self, q_BHTE, S - T, k_BHSE, v_BHSE, None)[0]

    length_dependence = "Algorithm 4 halves the whole sequence, so its split points move as tokens are appended"
    """Why appending tokens changes earlier outputs beyond `prefix_stable_length` (models/hf_patching.py says it)."""

    def prefix_stable_length(self) -> float:
        """Up to min_seq_len tokens every output is exact, so appending tokens changes no earlier output; beyond it
        the recursion's halves depend on the whole length, and keys cached at a shorter length are stale."""
        return self.min_seq_len

    def attention_parameters(self) -> int:
        return 0
