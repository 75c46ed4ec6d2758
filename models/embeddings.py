"""Token and position embeddings.

`build_token_embedding` is the table from `model.embedding.kind` to a module with
forward(tokens [B, T]) -> [B, T, d_model] and `output_weight()` ([V, d_model] to tie, or None).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from models.config import ModelConfig, StandardEmbeddingConfig


class StandardEmbedding(nn.Module):
    """Lookup table at d_model, scaled by sqrt(d_model) as in Vaswani et al. (2017) so that it keeps
    its weight against the position embedding when tied to the output layer (init std d^-1/2)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.table = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.table.weight, std=d_model**-0.5)
        self.scale = math.sqrt(d_model)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        return self.table(tokens_BT) * self.scale

    def output_weight(self) -> torch.Tensor | None:
        return self.table.weight


def build_token_embedding(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    if isinstance(cfg.embedding, StandardEmbeddingConfig):
        return StandardEmbedding(vocab_size, cfg.d_model)
    raise ValueError(f"model.embedding.kind={cfg.embedding.kind!r} is not known")


class SinusoidalPositions(nn.Module):
    """Fixed sin/cos position encodings (Vaswani et al., 2017, Sec. 3.5)."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_len, d_model)
        table[:, 0::2] = torch.sin(pos * inv_freq)
        table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
        self.register_buffer("table", table, persistent=False)

    def forward(self, T: int) -> torch.Tensor:
        return self.table[:T]


class LearnedPositions(nn.Module):
    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def forward(self, T: int) -> torch.Tensor:
        return self.table[:T]


def build_positions(cfg: ModelConfig) -> nn.Module:
    cls = LearnedPositions if cfg.positional == "learned" else SinusoidalPositions
    return cls(cfg.max_seq_len, cfg.d_model)
