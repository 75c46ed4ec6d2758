"""Attention kinds behind one contract and one registry (see DESIGN.md, "The attention contract")."""

from models.attention.config import ATTENTION_KINDS, AttentionConfig
from models.attention.module import Attention
from models.attention.registry import build_attention

__all__ = ["ATTENTION_KINDS", "Attention", "AttentionConfig", "build_attention"]
