"""A toy attention kind written the way a real one is: this one file, plus one registry row where it is used
(tests/test_attention_toy.py; docs/attention.md, "Adding a kind", walks through it).

`mean` mixes the heads by giving every key a query may see the same weight: the output at i is the mean of
the visible values (those of unpadded keys, at positions <= i under `causal`), times `value_scale`. Queries
and keys are ignored. Like linformer, lsh and hyper it is a mechanism whose knobs sit at the top level of its
own kind's block, and its config is crossable, so any projection kind of a registry holding it can also name
it in a `mechanism:` block.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention.base import _AttentionConfig, _MechanismConfig, _MechanismKindConfig
from models.attention.exact import exact_attention_bias


class MeanMechanismConfig(_MechanismConfig):
    """Uniform attention over the visible keys."""

    kind: Literal["mean"] = "mean"
    value_scale: float = 1.0
    """Factor on the mean of the visible values."""


class MeanConfig(MeanMechanismConfig, _MechanismKindConfig):
    """`mha` projections with the mean mechanism; its knob sits at the top level of the block."""

    kind: Literal["mean"] = "mean"  # type: ignore[assignment]

    tiny_knobs = {"value_scale": 0.5}


class MeanMechanism(nn.Module):
    """The mean of the visible values v [B, H, S, E] for each query of q [B, H, T, E]."""

    supports_causal = True
    config_cls = MeanMechanismConfig

    def __init__(self, value_scale: float):
        super().__init__()
        self.value_scale = value_scale

    @classmethod
    def from_config(cls, cfg: MeanMechanismConfig, attention: _AttentionConfig, layer_index: int,
                    shared_state: nn.ModuleDict) -> MeanMechanism:
        """The registry's builder (models/attention/registry.py)."""
        return cls(cfg.value_scale)

    def forward(self, q_BHTE, k_BHSE, v_BHSE, *, key_padding_mask_BS=None, causal=False):
        T, S = q_BHTE.shape[-2], k_BHSE.shape[-2]
        bias = exact_attention_bias(key_padding_mask_BS, causal, T, S, v_BHSE.dtype, v_BHSE.device)
        # Zero queries make every logit 0, so the softmax weighs the unmasked keys alike.
        return self.value_scale * F.scaled_dot_product_attention(torch.zeros_like(q_BHTE), k_BHSE, v_BHSE,
                                                                 attn_mask=bias)

    def attention_parameters(self) -> int:
        return 0
