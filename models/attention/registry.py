"""`build_attention`: the one explicit table from a config block to an attention module."""

from __future__ import annotations

import torch.nn as nn

from models.attention.config import (
    ATTENTION_KINDS,
    ExactMechanismConfig,
    HyperMechanismConfig,
    LinformerMechanismConfig,
    LSHMechanismConfig,
)
from models.attention.exact import ExactMechanism
from models.attention.hyper import HyperMechanism
from models.attention.linformer import LinformerMechanism
from models.attention.lsh import LSHMechanism
from models.attention.module import Attention
from models.attention.projections import build_projection


def _build_mechanism(cfg, mechanism_cfg, layer_index: int, shared_state: nn.ModuleDict) -> nn.Module:
    if isinstance(mechanism_cfg, ExactMechanismConfig):
        return ExactMechanism(cfg.dropout)
    if isinstance(mechanism_cfg, LinformerMechanismConfig):
        if mechanism_cfg.max_seq_len is None:
            raise ValueError("model.attention.max_seq_len is unset: build attention through ModelConfig, "
                             "which fills it from model.max_seq_len")
        return LinformerMechanism(mechanism_cfg, cfg.heads, cfg.head_dim, layer_index, shared_state, cfg.dropout)
    if isinstance(mechanism_cfg, LSHMechanismConfig):
        return LSHMechanism(mechanism_cfg, cfg.head_dim, layer_index, cfg.dropout)
    if isinstance(mechanism_cfg, HyperMechanismConfig):
        return HyperMechanism(mechanism_cfg, cfg.head_dim, layer_index, cfg.dropout)
    raise ValueError(f"model.attention.mechanism.kind={mechanism_cfg.kind!r} is not known")


def build_attention(cfg, layer_index: int, shared_state: nn.ModuleDict, *, cross: bool = False) -> Attention:
    """Build the attention module of layer `layer_index`.

    `cfg` is an AttentionConfig with d_model filled in. `shared_state` is a ModuleDict owned by the model
    for cross-layer state (Linformer's layerwise E). Cross-attention keeps the kind's projection scheme but
    always mixes exactly: sequence-compressing mechanisms are defined for self-attention in their papers
    (lsh, whose shared-QK scheme needs one sequence, gets mha projections there). LSH and HyperAttention
    derive their hash seeds from their config seed and `layer_index`, so each layer hashes differently
    and a reversible backward pass recomputes the same buckets.
    """
    kind = getattr(cfg, "kind", None)
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"model.attention.kind={kind!r} is not known; valid kinds: {', '.join(ATTENTION_KINDS)}")
    if cfg.d_model is None:
        raise ValueError("model.attention.d_model is unset: build attention through ModelConfig")
    mechanism_cfg = ExactMechanismConfig() if cross else cfg.mechanism
    mechanism = _build_mechanism(cfg, mechanism_cfg, layer_index, shared_state)
    return Attention(kind, build_projection(cfg, cross=cross), mechanism)
