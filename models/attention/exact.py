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
