"""Reformer LSH attention: hash, sort by bucket, attend within chunks of the sorted sequence.

Reformer: The Efficient Transformer. Kitaev, Kaiser, Levskaya (ICLR 2020), arXiv 2001.04451, Sec. 2.
Angular LSH h(x) = argmax([xR; -xR]) with a random rotation R of shape [d_k, n_buckets / 2]; tokens are sorted
by (bucket, position), the sorted sequence is cut into chunks of `bucket_size` and each chunk attends to itself
and the previous chunk; `n_hashes` rounds are combined by their log-sum-exp (a softmax over rounds). Queries and
keys come from the shared-QK projection (keys unit-normalised); a token attends to itself only when nothing
else is available, and causal masking compares original positions.

Conventions of the authors' code (trax `efficient_attention.py`, Hugging Face `modeling_reformer.py`; cited in
docs/long_attention.md): logits are q.k with k unit-normalised and no further 1/sqrt(d) (`logit_scale`), and
training draws new rotations on every forward pass (`rotations`), replayed exactly by a reversible backward
because they come from the global RNG, whose state models/reversible.py restores.

Causal routing (`causal_routing`). The paper's chunks are cut from the sorted order of the WHOLE sequence, so
which earlier keys a query sees depends on how many later tokens fall in lower buckets: the output leaks the
future in value (not in gradient). `past_only` (the default under causal) lays the sorted sequence out so that
every bucket starts a new chunk (its run padded with masked rows to a multiple of bucket_size); a query of
bucket-rank r then sees the earlier tokens of its own bucket with rank >= bucket_size * (r // bucket_size - 1):
its own chunk and the previous chunk of the same bucket, the paper's rule inside one bucket. The rank counts
earlier tokens only, so the keys, and their place relative to the query in the layout (hence the rounding),
depend on positions <= i only: the output is bit-for-bit a function of the past. The same chunked kernel runs
on a layout about twice as long at the default n_buckets (a bucket holds ~bucket_size / 2 tokens).

Other differences from the reference implementations, all deliberate (see docs/long_attention.md):
- Evaluation uses rotations fixed per (seed, layer), so validation repeats (trax and HF redraw them there too).
- Padded keys go to an extra last bucket and the first chunk does not look back cyclically, so appending
  padding leaves the outputs of real tokens unchanged; the default n_buckets counts each row's real tokens,
  and rotation column c does not depend on the row's bucket count, so a row hashes the same alone or batched.
- Any length works: the last chunk may be short; a sequence shorter than one chunk is one chunk (exact
  shared-QK attention with the self-mask).
- Keys found by several rounds are counted once per round (lucidrains' default allow_duplicate_attention).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn as nn
from pydantic import model_validator

from kernels.block_setting import BlockSetting
from kernels.dispatch import fused_kernels
from kernels.lsh_hash import angular_hash
from kernels.lsh_layout import bucket_layout
from kernels.merge_rounds import merge_rounds
from models.attention.base import _AttentionConfig, _MechanismConfig, _MechanismKindConfig
from models.attention.device_copies import DeviceCopies
from models.attention.lengths import lsh_length
from models.attention.lse import chunked_attention, exact_attention, merge_lse_many

_LAYER_SEED_STRIDE = 1_000_003  # a prime, so (seed, layer) pairs do not collide for realistic depths
_BOUNDED_LAYOUT = BlockSetting(False)
"""True inside `bounded_layout()`."""


@contextmanager
def bounded_layout() -> Iterator[None]:
    """Inside, the sizes that depend on where the hashes fell take their upper bounds instead of being read back
    from the device: the bucket count of the longest possible row, and a `past_only` layout long enough for any
    distribution of tokens over buckets (`layout_length_bound`). The extra rows of the layout are masked padding,
    so the outputs are the same, except for a padded row under the default n_buckets, which is hashed into the
    buckets of a full row. The cost is that of the worst case. For `orchestrator plan`, which runs models on fake
    tensors, whose values cannot be read."""
    with _BOUNDED_LAYOUT.set_to(True):
        yield


def layout_length_bound(seq_len: int, n_ids: int, bucket_size: int) -> int:
    """The longest `past_only` layout of `seq_len` tokens in at most `n_ids` buckets: each of m non-empty buckets
    takes ceil(c_b / C) chunks = floor((c_b - 1) / C) + 1, and sum_b floor((c_b - 1) / C) <= floor((T - m) / C),
    so the chunks are at most m + floor((T - m) / C), largest at m = min(n_ids, T) (one token in every bucket but
    one). Random keys fill about 2 T / C buckets with C / 2 tokens each: a layout near 2 T against this 3 T."""
    m = min(n_ids, seq_len)
    return (m + (seq_len - m) // bucket_size) * bucket_size

PAPER_ROUTING_LEAK = (
    "lsh with causal_routing=paper under a causal mask leaks the future: the chunks of the sorted sequence "
    "depend on how many later tokens fall in lower buckets, so an output changes when later inputs change; "
    "set model.attention.causal_routing=past_only for a causal model"
)


class LSHMechanismConfig(_MechanismConfig):
    """Reformer LSH attention (Kitaev, Kaiser, Levskaya, 2020, arXiv 2001.04451).

    Not offered as a `mechanism:` on other projection schemes: hashing sorts queries and keys together, which
    is only meaningful with the shared-QK projection of kind `lsh`.
    """

    kind: Literal["lsh"] = "lsh"
    crossable = False
    bucket_size: int = 64
    """Chunk length of the sorted sequence; each chunk attends to itself and the previous chunk."""
    n_hashes: int = 4
    """Hash rounds, combined through their log-sum-exp; more rounds approach full attention."""
    n_buckets: int | list[int] | None = None
    """Buckets per round (even); default 2 * seq_len / bucket_size rounded to an even number >= 2. Or a list of even
    factors [f1, f2, ...]: f1 * f2 * ... buckets hashed with f1/2 + f2/2 + ... rotation columns instead of their
    product's half (trax's and Hugging Face's factorized hashing; google/reformer-crime-and-punishment hashes
    524,288 tokens into [64, 128]), the hash's cost no longer growing with the bucket count."""
    seed: int = 0
    """Seed of the fixed rotations (evaluation, and training with rotations=fixed); each layer derives its own."""
    rotations: Literal["redraw", "fixed"] = "redraw"
    """redraw: new rotations every training forward (trax, Hugging Face), replayed in a reversible backward;
    fixed: one per layer from `seed` for the model's life. Evaluation always uses the fixed ones."""
    logit_scale: Literal["none", "rsqrt_head_dim"] = "none"
    """none: logits q.k/|k| (trax, Hugging Face); rsqrt_head_dim: q.k/|k|/sqrt(head_dim) (lucidrains)."""
    causal_routing: Literal["past_only", "paper"] = "past_only"
    """Under causal: past_only attends to the last bucket_size earlier keys of the query's own bucket (a
    function of the past only); paper sorts and chunks the whole sequence, which LEAKS THE FUTURE."""
    check_length = lsh_length

    @model_validator(mode="after")
    def _check(self) -> "LSHMechanismConfig":
        if self.bucket_size < 1:
            raise ValueError(f"model.attention.bucket_size must be >= 1 (got {self.bucket_size}); "
                             "typical values are 32 or 64")
        if self.n_hashes < 1:
            raise ValueError(f"model.attention.n_hashes must be >= 1 (got {self.n_hashes}); the paper uses 1-8")
        counts = self.n_buckets if isinstance(self.n_buckets, list) else [self.n_buckets]
        if self.n_buckets is not None and (not counts or any(n < 2 or n % 2 for n in counts)):
            raise ValueError(f"model.attention.n_buckets must be an even number >= 2, or a list of them (factors; "
                             f"got {self.n_buckets}): angular LSH takes the argmax over [xR; -xR]; leave it unset "
                             "for 2 * seq_len / bucket_size")
        return self


class LSHConfig(LSHMechanismConfig, _MechanismKindConfig):
    """Reformer: shared-QK projections (keys unit-normalised) with LSH attention; knobs at the top level."""

    kind: Literal["lsh"] = "lsh"  # type: ignore[assignment]

    tiny_knobs = {"bucket_size": 4, "n_hashes": 2}
    bench_knobs = {"bucket_size": 16, "n_hashes": 2}


def default_n_buckets(seq_len: int, bucket_size: int) -> int:
    """2 * seq_len / bucket_size rounded to an even number >= 2 (Reformer, Sec. 2: ~ n_buckets = L / chunk * 2)."""
    n = round(2 * seq_len / bucket_size)
    return max(2, n + (n % 2))


def default_n_buckets_of(seq_len_B: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """`default_n_buckets` of every row's length [B], on the rows' device (nothing read back): the same float64
    division, and rounding half to even as Python's `round`. An empty row counts as one token."""
    n_B = torch.round(2 * seq_len_B.clamp(min=1).double() / bucket_size).long()
    return (n_B + n_B % 2).clamp(min=2)


def hash_slice_rows(seq_len: int, head_dim: int, n_half: int) -> int:
    """Tokens hashed at once: a slice's projections [.., rows, n_half] hold at most as many entries as the keys
    [.., T, head_dim] (and at least one token), so hashing never holds more than the keys' size again, at any T;
    with the default n_buckets that is bucket_size * head_dim tokens per slice (4096 at 64 and 64)."""
    return max(1, min(seq_len, seq_len * head_dim // max(n_half, 1)))


def angular_argmax(
    xr_BHRTN: torch.Tensor, unused_B1111N: torch.Tensor | None, half_B111: torch.Tensor | int
) -> torch.Tensor:
    """Bucket ids [B, H, R, T] of angular LSH, argmax([xR; -xR]) (Reformer, Sec. 2), without the concatenation.

    torch's argmax returns the FIRST maximal index, so over [xR; -xR] the positive half wins a tie with the
    negative half, and inside a half the lower column wins. The same ids from the two halves apart: the first
    maximum of xR (max) and the first minimum of xR (min, the first maximum of -xR, negation being exact); the
    positive one is taken when max >= -min. Columns a row does not use (`unused`) can win in neither half (the
    concatenation gives them -inf in both). Column c of -xR is bucket half + c, half being the row's own count.
    NaN projections (only from NaN keys) are outside this equivalence.
    """
    if unused_B1111N is None:
        top_BHRT, top_idx_BHRT = xr_BHRTN.max(-1)
        low_BHRT, low_idx_BHRT = xr_BHRTN.min(-1)
    else:
        top_BHRT, top_idx_BHRT = xr_BHRTN.masked_fill(unused_B1111N, float("-inf")).max(-1)
        low_BHRT, low_idx_BHRT = xr_BHRTN.masked_fill(unused_B1111N, float("inf")).min(-1)
    return torch.where(top_BHRT >= -low_BHRT, top_idx_BHRT, low_idx_BHRT + half_B111)


def round_merge(fused: bool):
    """The merge of the rounds by their lse: one Triton kernel each way where the layer's attention runs on the
    kernels (`fused`; kernels/merge_rounds.py: about 30 launches fewer a layer), else `merge_lse_many` in PyTorch."""
    return merge_rounds if fused else merge_lse_many


class LSHMechanism(nn.Module):
    """LSH attention over per-head q, k (= normalised q), v of shape [B, H, T, E]."""

    supports_causal = True
    config_cls = LSHMechanismConfig

    def __init__(self, cfg: LSHMechanismConfig, head_dim: int, layer_index: int, dropout: float = 0.0):
        super().__init__()
        self.bucket_size, self.n_hashes = cfg.bucket_size, cfg.n_hashes
        # A list of factors hashes each over its own columns (`_factorized_buckets`); n_buckets is their product.
        self.bucket_factors = tuple(cfg.n_buckets) if isinstance(cfg.n_buckets, list) else None
        self.n_buckets = math.prod(self.bucket_factors) if self.bucket_factors else cfg.n_buckets
        self.head_dim, self.dropout = head_dim, dropout
        self.redraw, self.causal_routing = cfg.rotations == "redraw", cfg.causal_routing
        # trax/HF: the key is unit-normalised and the logit is q.k with no further scale; None = 1/sqrt(d).
        self.scale = 1.0 if cfg.logit_scale == "none" else None
        self.layer_seed = cfg.seed + _LAYER_SEED_STRIDE * layer_index
        # Reformer's rule for shared QK, where q.k of a token with itself dominates; models/dropin.py turns it off
        # for a trained model's separate q and k, where a token's own key is an ordinary key.
        self.self_mask = True
        # The fixed rotations' columns on each device (evaluation, cached decoding): a cache, not state, rebuilt from
        # the seed on demand.
        self._device_rotations = DeviceCopies()

    @classmethod
    def from_config(
        cls, cfg: LSHMechanismConfig, attention: _AttentionConfig, layer_index: int, shared_state: nn.ModuleDict
    ) -> LSHMechanism:
        """The registry's builder (models/attention/registry.py)."""
        return cls(cfg, attention.head_dim, layer_index, attention.dropout)

    def rotations(self, heads: int, n_half: int, device: torch.device,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """R [H, n_hashes, E, n_half] in `dtype`. Training with rotations=redraw draws them from the global RNG
        (one per head and round, as HF), which a reversible backward replays; otherwise they are fixed: column c
        depends only on (seed, layer, c), so a row with fewer buckets uses a prefix of the same rotation, and the
        columns go to the device once (models/attention/device_copies.py), not at every evaluation or decoding
        step. A longer row doubles the columns kept, so a length that grows token by token copies them rarely."""
        if self.training and self.redraw:  # drawn in `dtype`, as HF's `_hash_vectors` and reformer_pytorch draw
            return torch.randn(heads, self.n_hashes, self.head_dim, n_half, device=device, dtype=dtype)

        def seeded_columns(kept: torch.Tensor | None) -> torch.Tensor:
            width = n_half if kept is None else max(n_half, 2 * kept.shape[-1])
            return torch.stack([torch.randn(self.n_hashes, self.head_dim, generator=torch.Generator().manual_seed(
                self.layer_seed * 7919 + c)) for c in range(width)], dim=-1)

        rot_REN = self._device_rotations.get(device, dtype, "columns", seeded_columns,
                                             large_enough=lambda kept: kept.shape[-1] >= n_half)[..., :n_half]
        return rot_REN.expand(heads, *rot_REN.shape)

    def buckets(self, k_BHTE: torch.Tensor, key_padding_mask_BT: torch.Tensor | None,
                fused: bool | None = None) -> torch.Tensor:
        """Bucket ids [B, H, R, T]; padded tokens get an id after every real bucket so they sort last.

        Without a fixed n_buckets each row gets 2 * (its real length) / bucket_size buckets. The projections
        xR [B, H, R, T, n_half] grow as T^2 (n_half ~ T / bucket_size: at 128k, 16 heads and 4 rounds, 34 GB in
        bf16). Where the Triton kernels run, one kernel hashes without writing them (kernels/k_lsh_hash.py);
        elsewhere they are made `hash_slice_rows` tokens at a time, each slice no larger than k repeated over the
        rounds: memory linear in T, the ids those of one argmax over the whole row (`angular_argmax`).
        """
        H, T = k_BHTE.shape[1:3]
        fused = fused_kernels(k_BHTE) if fused is None else fused  # the caller's choice, when it made it
        if self.bucket_factors:
            bucket_BHRT = self._factorized_buckets(k_BHTE, fused)
            if key_padding_mask_BT is not None:
                bucket_BHRT = bucket_BHRT.masked_fill(key_padding_mask_BT[:, None, None, :], self.n_buckets)
            return bucket_BHRT
        n_half = self.n_half_bound(T)  # the shapes': no row has more, so no count is read back from the device
        # One count for every row, n_half (None; bounded: as if every row were T tokens long), or each row's own
        # count from its real length, the columns past it masked (int32: the hash kernel's dtype).
        half_B = None
        if self.n_buckets is None and key_padding_mask_BT is not None and not _BOUNDED_LAYOUT.value:
            half_B = (default_n_buckets_of((~key_padding_mask_BT).sum(-1), self.bucket_size) // 2).int()
        rot_HREN = self.rotations(H, n_half, k_BHTE.device, k_BHTE.dtype)
        if fused:  # the projections never written (kernels/k_lsh_hash.py)
            bucket_BHRT = angular_hash(k_BHTE, rot_HREN, half_B)
        else:
            bucket_BHRT = self._hash_in_slices(k_BHTE, rot_HREN, half_B, n_half)
        if key_padding_mask_BT is not None:
            bucket_BHRT = bucket_BHRT.masked_fill(key_padding_mask_BT[:, None, None, :], 2 * n_half)
        return bucket_BHRT

    def _factorized_buckets(self, k_BHTE: torch.Tensor, fused: bool) -> torch.Tensor:
        """Bucket ids of factorized hashing (trax `hash_vecs` with a list of n_buckets; Hugging Face
        `LSHSelfAttention._hash_vectors`): factor i takes the next f_i / 2 rotation columns, its own angular
        argmax b_i over them, and the id is b_1 + f_1 * b_2 + f_1 * f_2 * b_3 + ..."""
        H = k_BHTE.shape[1]
        rot_HREN = self.rotations(H, sum(f // 2 for f in self.bucket_factors), k_BHTE.device, k_BHTE.dtype)
        bucket_BHRT, first_column, stride = None, 0, 1
        for factor in self.bucket_factors:
            half = factor // 2
            rot_factor_HREN = rot_HREN[..., first_column:first_column + half]
            ids_BHRT = (angular_hash(k_BHTE, rot_factor_HREN) if fused
                        else self._hash_in_slices(k_BHTE, rot_factor_HREN, None, half))
            bucket_BHRT = ids_BHRT if bucket_BHRT is None else bucket_BHRT + stride * ids_BHRT
            first_column, stride = first_column + half, stride * factor
        return bucket_BHRT

    @staticmethod
    def _hash_in_slices(k_BHTE: torch.Tensor, rot_HREN: torch.Tensor, half_B: torch.Tensor | None,
                        n_half: int) -> torch.Tensor:
        """`buckets`' ids in PyTorch: the projections of `hash_slice_rows` tokens at a time, argmax'd; each row's
        half count is half_B's, or n_half for every row without it."""
        T, E = k_BHTE.shape[2:]
        # Columns c >= this row's half count are not its buckets (none when every row has the same count).
        unused_B1111N = None if half_B is None else (
            torch.arange(n_half, device=k_BHTE.device) >= half_B[:, None])[:, None, None, None, :]
        half_B111 = n_half if half_B is None else half_B[:, None, None, None]
        rows = hash_slice_rows(T, E, n_half)
        slices_BHRS = [
            # The same product per token as over the whole row: each entry is one dot over E.
            angular_argmax(torch.einsum("bhte,hren->bhrtn", k_BHTE[:, :, t0:t0 + rows], rot_HREN), unused_B1111N,
                           half_B111)
            for t0 in range(0, T, rows)
        ]
        return slices_BHRS[0] if len(slices_BHRS) == 1 else torch.cat(slices_BHRS, dim=-1)

    def forward(self, q_BHTE, k_BHSE, v_BHSE, *, key_padding_mask_BS=None, causal=False):
        B, H, T, E = q_BHTE.shape
        if k_BHSE.shape[2] != T:
            raise ValueError("lsh attention is self-attention: queries and keys must have the same length "
                             f"(got {T} and {k_BHSE.shape[2]})")
        R = self.n_hashes
        past_only = causal and self.causal_routing == "past_only"
        if causal and not past_only:
            warnings.warn(PAPER_ROUTING_LEAK, UserWarning, stacklevel=2)
        fused = fused_kernels(q_BHTE)  # the hash, the chunks and the merge on the Triton kernels
        bucket_BHRT = self.buckets(k_BHSE.detach(), key_padding_mask_BS, fused=fused)
        # Sorted by (bucket, position): a stable sort by bucket keeps each bucket's tokens in position order.
        order_BHRT = torch.argsort(bucket_BHRT, dim=-1, stable=True)
        # The layout is given to the kernels as an index, token_of_row: row l of round r holds that token (-1: a
        # filler row). They load q, k, v through it and write each round's out and lse at the tokens' places, so no
        # sorted copy of q, k, v, out or their gradients exists.
        if past_only and fused:
            # One kernel lays out the rows at the layout's bound: no length read back from the device, so nothing
            # in the layer's forward or backward waits for it (a CUDA graph can hold the whole layer); the chunks
            # past the real layout are filler rows only, whose programs the kernels end at once.
            token_BHRL, positions_BHRT = bucket_layout(bucket_BHRT, order_BHRT, self.bucket_size,
                                                       self.bounded_layout_length(T))
        elif past_only:
            slot_BHRT, L = self.bucket_aligned_slots(bucket_BHRT, order_BHRT)
            # Shifting positions by -bucket * T makes the causal test (key <= query) also drop the keys of the
            # lower bucket that may fill the previous chunk; inside a bucket it is the plain causal test.
            positions_BHRT = torch.arange(T, device=q_BHTE.device) - bucket_BHRT * T
            tokens_BHRT = torch.arange(T, device=q_BHTE.device, dtype=torch.int32).expand(B, H, R, T)
            token_BHRL = torch.full((B, H, R, L), -1, dtype=torch.int32, device=q_BHTE.device)
            token_BHRL = token_BHRL.scatter_(3, slot_BHRT, tokens_BHRT)
        else:
            # The sorted order is the layout, with no filler rows; positions default to the token index (the plain
            # causal test, and Reformer's self-mask).
            token_BHRL, positions_BHRT = order_BHRT, None
        out_BHRTE, lse_BHRT = chunked_attention(
            q_BHTE, k_BHSE, v_BHSE, self.bucket_size, lookback=1, positions=positions_BHRT, causal=causal,
            self_mask=self.self_mask, key_padding_mask=key_padding_mask_BS, wrap=False,
            dropout_p=self.dropout if self.training else 0.0, scale=self.scale, token_of_row=token_BHRL,
        )
        out_BHTE, _ = round_merge(fused)(out_BHRTE, lse_BHRT, dim=2)
        return out_BHTE

    def bucket_aligned_slots(self, bucket_BHRT: torch.Tensor, order_BHRT: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Row of each token [B, H, R, T] in the (bucket, position) order with every bucket's run starting a new
        chunk, and the layout's length L: the longest over rows, heads and rounds (one host sync), or, inside
        `bounded_layout` and under torch.compile, `layout_length_bound`'s for any hashes. The PyTorch path's layout:
        on the kernels, kernels/lsh_layout.py `bucket_layout` makes it at the bound. Compiled, the read would be a
        graph break inside the model's loop over its layers, where dynamo gives up on the whole frame and runs it
        eagerly; the bound's extra rows are fillers, so the outputs are the same."""
        C, T = self.bucket_size, bucket_BHRT.shape[-1]
        # Ids run below 2 * n_half, padding's is 2 * n_half (`buckets`), and no row's n_half exceeds the bound: the
        # counts take the bound's columns, those of ids no token has staying zero (no chunk, no row), so the count
        # needs no host sync (reading the largest id was one, besides L's below).
        n_ids = self.n_ids_bound(T)
        count_BHRN = torch.zeros(*bucket_BHRT.shape[:3], n_ids, dtype=torch.long, device=bucket_BHRT.device)
        count_BHRN.scatter_add_(3, bucket_BHRT, torch.ones_like(bucket_BHRT))
        chunks_BHRN = -(-count_BHRN // C)
        first_row_BHRN = (torch.cumsum(chunks_BHRN, -1) - chunks_BHRN) * C
        first_sorted_BHRN = torch.cumsum(count_BHRN, -1) - count_BHRN
        sorted_bucket_BHRT = torch.gather(bucket_BHRT, 3, order_BHRT)
        rank_BHRT = torch.arange(T, device=bucket_BHRT.device) - torch.gather(first_sorted_BHRN, 3, sorted_bucket_BHRT)
        slot_sorted_BHRT = torch.gather(first_row_BHRN, 3, sorted_bucket_BHRT) + rank_BHRT
        slot_BHRT = torch.empty_like(slot_sorted_BHRT).scatter_(3, order_BHRT, slot_sorted_BHRT)
        if _BOUNDED_LAYOUT.value or torch.compiler.is_compiling():
            return slot_BHRT, self.bounded_layout_length(T)
        return slot_BHRT, int(chunks_BHRN.sum(-1).max()) * C

    def causal_last_rows(self, q_BHTE: torch.Tensor, k_BHSE: torch.Tensor, v_BHSE: torch.Tensor) -> torch.Tensor:
        """Rows S-T .. S-1 of `forward(causal=True)` (past-only routing) over S tokens, from those rows' queries and
        every key: a cached decoding step. Every key is hashed as the full pass hashes it (same rotations, and the
        bucket count of S tokens, which the default n_buckets takes from the length). In the past-only layout a
        token of bucket-rank r (earlier tokens of its bucket) sits in chunk r // C of its bucket's run, and the chunk
        kernel shows it its own chunk and the previous one, later keys masked: the ranks C * (r // C - 1) .. r of
        its bucket (a previous chunk of a lower bucket is masked by the shifted positions of `forward`). That window
        of at most 2C keys, laid out as the kernel lays it (own chunk, then the previous), is gathered per round."""
        B, H, T, E = q_BHTE.shape
        S, C, R, dev = k_BHSE.shape[2], self.bucket_size, self.n_hashes, q_BHTE.device
        if self.causal_routing != "past_only":
            raise ValueError("lsh with causal_routing=paper cannot decode from a cache: its chunks depend on the "
                             "later tokens; use causal_routing=past_only")
        if self.training and self.redraw:
            raise ValueError("lsh with rotations=redraw draws new rotations on every training call, so a cached step "
                             "cannot repeat the full pass's; decode in evaluation mode (model.eval())")
        if self.self_mask:
            raise ValueError("cached lsh decoding is for separate query and key projections (models/dropin.py); "
                             "Reformer's shared-QK self-mask is not reproduced here")
        bucket_BHRS = self.buckets(k_BHSE.detach(), None)
        order_BHRS = torch.argsort(bucket_BHRS, dim=-1, stable=True)  # (bucket, position) order
        count_BHRN = torch.zeros(B, H, R, 2 * self.n_half_bound(S), dtype=torch.long, device=dev)
        count_BHRN.scatter_add_(3, bucket_BHRS, torch.ones_like(bucket_BHRS))
        first_sorted_BHRN = torch.cumsum(count_BHRN, -1) - count_BHRN
        # A token's bucket-rank = its index in the (bucket, position) order minus where its bucket's run starts.
        rank_BHRS = torch.empty_like(order_BHRS).scatter_(
            3, order_BHRS, torch.arange(S, device=dev) - torch.gather(first_sorted_BHRN, 3,
                                                                        torch.gather(bucket_BHRS, 3, order_BHRS)))
        bucket_BHRT, rank_BHRT = bucket_BHRS[..., S - T:], rank_BHRS[..., S - T:]
        own_chunk_start_BHRT = (rank_BHRT // C) * C
        offsets_W = torch.cat([torch.arange(C, device=dev), torch.arange(C, device=dev) - C])  # own, then previous
        rank_BHRTW = own_chunk_start_BHRT[..., None] + offsets_W
        seen_BHRTW = (rank_BHRTW >= 0) & (rank_BHRTW <= rank_BHRT[..., None])
        sorted_BHRTW = (torch.gather(first_sorted_BHRN, 3, bucket_BHRT)[..., None] + rank_BHRTW).clamp(0, S - 1)
        token_BHX = torch.gather(order_BHRS, 3, sorted_BHRTW.view(B, H, R, T * 2 * C)).view(B, H, -1)
        window = lambda x: torch.gather(x, 2, token_BHX[..., None].expand(-1, -1, -1, E))  # noqa: E731
        X = B * H * R * T
        q_X11E = q_BHTE[:, :, None].expand(B, H, R, T, E).reshape(X, 1, 1, E)
        out_X11E, lse_X11 = exact_attention(
            q_X11E, window(k_BHSE).view(X, 1, 2 * C, E), window(v_BHSE).view(X, 1, 2 * C, E),
            key_padding_mask=~seen_BHRTW.reshape(X, 2 * C), scale=self.scale)
        out_BHTE, _ = merge_lse_many(out_X11E.view(B, H, R, T, E), lse_X11.view(B, H, R, T), dim=2)
        return out_BHTE

    length_dependence = "the default n_buckets grows with the length; set n_buckets to fix it"
    """Why appending tokens changes earlier outputs beyond `prefix_stable_length` (models/hf_patching.py says it)."""

    def prefix_stable_length(self) -> float:
        """Under past-only routing a token's keys are earlier tokens of its bucket, so appending tokens changes no
        earlier output while the bucket count stays: always with a fixed n_buckets; with the default, up to the
        longest length that still gets the bucket count of one token."""
        if self.n_buckets is not None:
            return math.inf
        shortest = default_n_buckets(1, self.bucket_size)
        return max(n for n in range(1, 2 * self.bucket_size + 2)
                   if default_n_buckets(n, self.bucket_size) == shortest)

    def n_ids_bound(self, seq_len: int) -> int:
        """Bucket ids a row of `seq_len` tokens can hold: below 2 * n_half, and padding's 2 * n_half (`buckets`)."""
        return 2 * self.n_half_bound(seq_len) + 1

    def bounded_layout_length(self, seq_len: int) -> int:
        """`layout_length_bound` for any buckets of a row of `seq_len` tokens."""
        return layout_length_bound(seq_len, self.n_ids_bound(seq_len), self.bucket_size)

    def n_half_bound(self, seq_len: int) -> int:
        """Half the bucket count of the longest row of `seq_len` tokens (`buckets` gives no row more)."""
        n = self.n_buckets if self.n_buckets is not None else default_n_buckets(seq_len, self.bucket_size)
        return n // 2

    def attention_parameters(self) -> int:
        return 0
