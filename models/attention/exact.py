"""Exact softmax attention, the mechanism every approximation is measured against.

`exact_attention_bias` turns the contract's masks into the one additive bias SDPA takes. Masked logits
get the dtype's most negative finite value rather than -inf: a query row whose keys are all masked
(e.g. padding under a causal mask) then averages uniformly instead of producing NaN, and padded query
rows are dropped by the loss anyway.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import exact_attention
from models.attention.base import _AttentionConfig, _MechanismConfig


def exact_attention_bias(
    key_padding_mask_BS: torch.Tensor | None, causal: bool, T: int, S: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Additive bias [B or 1, 1, T, S]; key_padding_mask is True where a key is padding.

    Causal masking aligns queries and keys top-left (query i sees keys j <= i), as in self-attention.
    """
    if key_padding_mask_BS is None and not causal:
        return None
    allowed_BTS = torch.ones(1, T, S, dtype=torch.bool, device=device)
    if causal:
        allowed_BTS = torch.ones(T, S, dtype=torch.bool, device=device).tril()[None]
    if key_padding_mask_BS is not None:
        allowed_BTS = allowed_BTS & ~key_padding_mask_BS[:, None, :]
    bias = torch.zeros(allowed_BTS.shape, dtype=dtype, device=device)
    return bias.masked_fill(~allowed_BTS, torch.finfo(dtype).min)[:, None]  # B, 1, T, S


class ExactMechanismConfig(_MechanismConfig):
    """Exact softmax attention: the mechanism of every projection kind unless its block names another."""

    kind: Literal["exact"] = "exact"


class ExactMechanism(nn.Module):
    """softmax(q k^T / sqrt(d)) v through torch's scaled_dot_product_attention."""

    supports_causal = True
    supports_kv_cache = True
    """A new query's output depends on past keys/values only through themselves, so they can be cached."""
    config_cls = ExactMechanismConfig

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    @classmethod
    def from_config(
        cls, cfg: ExactMechanismConfig, attention: _AttentionConfig, layer_index: int, shared_state: nn.ModuleDict
    ) -> ExactMechanism:
        """The registry's builder (models/attention/registry.py): no knobs beyond the block's dropout."""
        return cls(attention.dropout)

    def forward(self, q_BHTE, k_BHSE, v_BHSE, *, key_padding_mask_BS=None, causal=False):
        T, S = q_BHTE.shape[-2], k_BHSE.shape[-2]
        dropout_p = self.dropout if self.training else 0.0
        if key_padding_mask_BS is None and causal and T == S:
            return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSE, dropout_p=dropout_p, is_causal=True)
        bias = exact_attention_bias(key_padding_mask_BS, causal, T, S, q_BHTE.dtype, q_BHTE.device)
        return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSE, attn_mask=bias, dropout_p=dropout_p)

    def causal_last_rows(self, q_BHTE: torch.Tensor, k_BHSE: torch.Tensor, v_BHSE: torch.Tensor) -> torch.Tensor:
        """Rows S-T .. S-1 of `forward(causal=True)` over S positions, from those rows' queries and every key: a
        cached decoding step. Row t sees keys j <= S - T + t (the causal mask aligned bottom-right)."""
        T, S = q_BHTE.shape[-2], k_BHSE.shape[-2]
        mask_TS = None if T == 1 else torch.ones(T, S, dtype=torch.bool, device=q_BHTE.device).tril(S - T)
        dropout_p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSE, attn_mask=mask_TS, dropout_p=dropout_p)

    def prefix_stable_length(self) -> float:
        """Appending tokens never changes an earlier position's output, so keys cached at any length are current."""
        return math.inf

    def attention_parameters(self) -> int:
        return 0


def exact_causal_rows(q_BHTE, first: int, k_BHNE, v_BHNE, key_padding_BN):
    """(out [B, H, T, E], lse [B, H, T]) of rows first .. first+T-1 of `exact_attention(causal=True)` over N keys,
    from those rows' queries: row first+t sees the unpadded keys j <= first+t. Each row goes into the batch with its
    own key mask, so only the keys up to the last row are read (one row, the usual decoding step, reads them once)."""
    B, H, T, E = q_BHTE.shape
    S, dev = first + T, q_BHTE.device
    later_TS = torch.arange(S, device=dev) > (first + torch.arange(T, device=dev))[:, None]
    pad_TBS = later_TS[:, None, :].expand(T, B, S)
    if key_padding_BN is not None:
        pad_TBS = pad_TBS | key_padding_BN[None, :, :S]
    fold = lambda x: x[None, :, :, :S].expand(T, B, H, S, E).reshape(T * B, H, S, E)  # noqa: E731
    out_XH1E, lse_XH1 = exact_attention(q_BHTE.permute(2, 0, 1, 3).reshape(T * B, H, 1, E), fold(k_BHNE),
                                        fold(v_BHNE), key_padding_mask=pad_TBS.reshape(T * B, S))
    return out_XH1E.view(T, B, H, E).permute(1, 2, 0, 3), lse_XH1.view(T, B, H).permute(1, 2, 0)
