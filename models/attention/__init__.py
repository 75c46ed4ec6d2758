"""Attention kinds behind one contract and one registry (see DESIGN.md, "The attention contract")."""

from models.attention.module import Attention
from models.attention.registry import (
    ATTENTION,
    ATTENTION_KINDS,
    ATTENTION_REGISTRY,
    AttentionConfig,
    AttentionKind,
    build_attention,
    make_registry,
)

__all__ = ["ATTENTION", "ATTENTION_KINDS", "ATTENTION_REGISTRY", "Attention", "AttentionConfig", "AttentionKind",
           "build_attention", "make_registry"]
