"""Attention kinds behind one contract and one registry (see DESIGN.md, "The attention contract")."""

from models.attention.module import Attention
from models.attention.registry import ATTENTION_KINDS, ATTENTION_REGISTRY, AttentionConfig, build_attention

__all__ = ["ATTENTION_KINDS", "ATTENTION_REGISTRY", "Attention", "AttentionConfig", "build_attention"]
