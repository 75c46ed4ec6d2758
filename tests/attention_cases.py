"""Tiny configurations of every attention kind, shared by the attention test modules."""

from __future__ import annotations

import torch
import torch.nn as nn

from models import ModelConfig
from models.attention import ATTENTION, ATTENTION_KINDS, build_attention

D_MODEL, HEADS, MAX_LEN = 32, 4, 32


def tiny_knobs(kind: str) -> dict:
    """Knobs that make `kind` meaningful at these tiny sizes, as its config declares them (`tiny_knobs`)."""
    return dict(ATTENTION.configs[kind].tiny_knobs)


def attention_cfg(kind: str, d_model: int = D_MODEL, heads: int = HEADS, max_len: int = MAX_LEN, **knobs):
    block = {"kind": kind, "heads": heads, **tiny_knobs(kind), **knobs}
    return ModelConfig(d_model=d_model, layers=1, ffn=2 * d_model, max_seq_len=max_len, attention=block).attention


def make_attention(kind: str, layer_index: int = 0, shared_state: nn.ModuleDict | None = None, **knobs):
    torch.manual_seed(0)
    module = build_attention(attention_cfg(kind, **knobs), layer_index, shared_state or nn.ModuleDict())
    return module.eval()


def causal_kinds() -> list[str]:
    return [k for k in ATTENTION_KINDS if make_attention(k).supports_causal]
