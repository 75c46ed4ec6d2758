"""Reformer LSH attention: hash, sort by bucket, attend within chunks of the sorted sequence.

Reformer: The Efficient Transformer. Kitaev, Kaiser, Levskaya (ICLR 2020), arXiv 2001.04451, Sec. 2.
Angular LSH h(x) = argmax([xR; -xR]) with a random rotation R of shape [d_k, n_buckets / 2]; tokens are sorted
by (bucket, position), the sorted sequence is cut into chunks of `bucket_size` and each chunk attends to itself
and the previous chunk; `n_hashes` rounds are combined by their log-sum-exp (a softmax over rounds). Queries and
keys come from the shared-QK projection (keys unit-normalised); a token attends to itself only when nothing
else is available, and causal masking compares original positions.

Differences from the reference implementations, all deliberate (see docs/long_attention.md):
- The rotations are a fixed function of (seed, layer): a reversible backward pass recomputes the same buckets
  without caching them, and no global RNG is touched. Trax and lucidrains redraw them every call.
- Padded keys go to an extra last bucket and the first chunk does not look back cyclically, so appending
  padding leaves the outputs of real tokens unchanged; the default n_buckets counts each row's real tokens,
  and rotation column c depends only on (seed, layer, c), so a row hashes the same alone or in a batch.
- Any length works: the last chunk may be short; a sequence shorter than one chunk is one chunk (exact
  shared-QK attention with the self-mask).
- Keys found by several rounds are counted once per round (lucidrains' default allow_duplicate_attention).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.attention.config import LSHMechanismConfig, _AttentionConfig
from models.attention.lse import chunked_attention, merge_lse_many

_LAYER_SEED_STRIDE = 1_000_003  # a prime, so (seed, layer) pairs do not collide for realistic depths


def default_n_buckets(seq_len: int, bucket_size: int) -> int:
    """2 * seq_len / bucket_size rounded to an even number >= 2 (Reformer, Sec. 2: ~ n_buckets = L / chunk * 2)."""
    n = round(2 * seq_len / bucket_size)
    return max(2, n + (n % 2))


class LSHMechanism(nn.Module):
    """LSH attention over per-head q, k (= normalised q), v of shape [B, H, T, E]."""

    supports_causal = True
    config_cls = LSHMechanismConfig

    def __init__(self, cfg: LSHMechanismConfig, head_dim: int, layer_index: int, dropout: float = 0.0):
        super().__init__()
        self.bucket_size, self.n_hashes, self.n_buckets = cfg.bucket_size, cfg.n_hashes, cfg.n_buckets
        self.head_dim, self.dropout = head_dim, dropout
        self.layer_seed = cfg.seed + _LAYER_SEED_STRIDE * layer_index
        self._rotation_columns: list[torch.Tensor] = []  # a cache, not state: rebuilt from the seed on demand

    @classmethod
    def from_config(
        cls, cfg: LSHMechanismConfig, attention: _AttentionConfig, layer_index: int, shared_state: nn.ModuleDict
    ) -> LSHMechanism:
        """The registry's builder (models/attention/registry.py)."""
        return cls(cfg, attention.head_dim, layer_index, attention.dropout)

    def rotations(self, n_half: int, device: torch.device) -> torch.Tensor:
        """R [n_hashes, E, n_half]: column c depends only on (seed, layer, c), so rows of a batch with fewer
        buckets use a prefix of the same rotation and a sequence hashes the same alone or padded in a batch."""
        while len(self._rotation_columns) < n_half:
            c = len(self._rotation_columns)
            gen = torch.Generator().manual_seed(self.layer_seed * 7919 + c)
            self._rotation_columns.append(torch.randn(self.n_hashes, self.head_dim, generator=gen))
        return torch.stack(self._rotation_columns[:n_half], dim=-1).to(device)

    def buckets(self, k_BHTE: torch.Tensor, key_padding_mask_BT: torch.Tensor | None) -> torch.Tensor:
        """Bucket ids [B, H, R, T]; padded tokens get an id after every real bucket so they sort last.

        Without a fixed n_buckets each row gets 2 * (its real length) / bucket_size buckets.
        """
        B, T = k_BHTE.shape[0], k_BHTE.shape[2]
        if self.n_buckets is not None:
            half_B = torch.full((B,), self.n_buckets // 2, device=k_BHTE.device)
        else:
            real_B = torch.full((B,), T) if key_padding_mask_BT is None else (~key_padding_mask_BT).sum(-1).cpu()
            half_B = torch.tensor([default_n_buckets(max(int(n), 1), self.bucket_size) // 2 for n in real_B])
            half_B = half_B.to(k_BHTE.device)
        n_half = int(half_B.max())
        rot_REN = self.rotations(n_half, k_BHTE.device).to(k_BHTE.dtype)
        xr_BHRTN = torch.einsum("bhte,ren->bhrtn", k_BHTE, rot_REN)
        unused_B1111N = (torch.arange(n_half, device=k_BHTE.device) >= half_B[:, None])[:, None, None, None, :]
        xr_BHRTN = xr_BHRTN.masked_fill(unused_B1111N, float("-inf"))
        neg_BHRTN = (-xr_BHRTN).masked_fill(unused_B1111N, float("-inf"))
        idx_BHRT = torch.cat([xr_BHRTN, neg_BHRTN], dim=-1).argmax(-1)
        # argmax over [xR; -xR] restricted to this row's columns: column c of -xR is bucket half + c.
        half_B111 = half_B[:, None, None, None]
        bucket_BHRT = torch.where(idx_BHRT >= n_half, idx_BHRT - n_half + half_B111, idx_BHRT)
        if key_padding_mask_BT is not None:
            bucket_BHRT = bucket_BHRT.masked_fill(key_padding_mask_BT[:, None, None, :], 2 * n_half)
        return bucket_BHRT

    def forward(self, q_BHTE, k_BHSE, v_BHSE, *, key_padding_mask_BS=None, causal=False):
        B, H, T, E = q_BHTE.shape
        if k_BHSE.shape[2] != T:
            raise ValueError("lsh attention is self-attention: queries and keys must have the same length "
                             f"(got {T} and {k_BHSE.shape[2]})")
        R = self.n_hashes
        bucket_BHRT = self.buckets(k_BHSE.detach(), key_padding_mask_BS)
        pos_T = torch.arange(T, device=q_BHTE.device)
        # Sort by (bucket, position): one int64 key, stable because positions are distinct.
        order_BHRT = torch.argsort(bucket_BHRT * T + pos_T, dim=-1)
        undo_BHRT = torch.argsort(order_BHRT, dim=-1)

        def sort(x_BHTE: torch.Tensor) -> torch.Tensor:
            idx = order_BHRT[..., None].expand(B, H, R, T, x_BHTE.shape[-1])
            x_BHRTE = x_BHTE[:, :, None].expand(B, H, R, T, x_BHTE.shape[-1])
            return torch.gather(x_BHRTE, 3, idx).reshape(B, H * R, T, x_BHTE.shape[-1])  # rounds as extra heads

        pad_BHRT = None
        if key_padding_mask_BS is not None:
            pad_BHRT = torch.gather(key_padding_mask_BS[:, None, None, :].expand(B, H, R, T), 3, order_BHRT)
            pad_BHRT = pad_BHRT.reshape(B, H * R, T)
        out_BXTE, lse_BXT = chunked_attention(
            sort(q_BHTE), sort(k_BHSE), sort(v_BHSE), self.bucket_size, lookback=1,
            positions=order_BHRT.reshape(B, H * R, T), causal=causal, self_mask=True,
            key_padding_mask=pad_BHRT, wrap=False, dropout_p=self.dropout if self.training else 0.0,
        )
        out_BHRTE = torch.gather(out_BXTE.view(B, H, R, T, E), 3, undo_BHRT[..., None].expand(B, H, R, T, E))
        lse_BHRT = torch.gather(lse_BXT.view(B, H, R, T), 3, undo_BHRT)
        out_BHTE, _ = merge_lse_many(out_BHRTE, lse_BHRT, dim=2)
        return out_BHTE

    def attention_parameters(self) -> int:
        return 0
