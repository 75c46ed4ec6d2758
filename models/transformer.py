"""Pre-LN transformer: encoder, decoder, encoder-decoder, and the LM / translation heads.

Read top to bottom: a layer is x + Attention(LN(x)) then x + FFN(LN(x)) (pre-LN, Xiong et al., 2020),
the attention of each layer comes from `build_attention`, and every head is tied to the token embedding
unless `model.tie_output` is false. Masks follow the attention contract: bool, True = padding.

With `model.reversible` the same layers run as RevNet blocks (models/reversible.py, as in Reformer): the input
is duplicated into two streams, y1 = x1 + Attention(LN(x2)), y2 = x2 + FFN(LN(y1)), and the final LayerNorm
sees the mean of the two streams. The parameters (and their names) are those of the ordinary stack.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention import build_attention
from models.config import ModelConfig
from models.embeddings import build_positions, build_token_embedding
from models.reversible import reversible_stack


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ffn)
        self.down = nn.Linear(cfg.ffn, cfg.d_model)
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.ReLU()
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(self.act(self.up(x_BTD))))


class TransformerLayer(nn.Module):
    """Self-attention (+ cross-attention when `cross`) + feed-forward, each a pre-LN residual branch."""

    def __init__(self, cfg: ModelConfig, layer_index: int, shared_state: nn.ModuleDict, *, causal: bool, cross: bool):
        super().__init__()
        self.causal = causal
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = build_attention(cfg.attention, layer_index, shared_state)
        if causal and not self.attn.supports_causal:
            raise ValueError(
                f"model.attention.kind={cfg.attention.kind} cannot be used with causal attention (causal LM or "
                "a translation decoder): its mechanism mixes future positions. Use it for masked LM, or pick "
                "a causal-capable kind"
            )
        self.ln_cross = nn.LayerNorm(cfg.d_model) if cross else None
        self.cross = build_attention(cfg.attention, layer_index, shared_state, cross=True) if cross else None
        self.ln_ffn = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def attention_branch(self, x_BTD: torch.Tensor, key_padding_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        """The self-attention residual branch (F of a reversible block)."""
        return self.dropout(self.attn(self.ln_attn(x_BTD), key_padding_mask_BS=key_padding_mask_BT, causal=self.causal))

    def feed_forward_branch(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """The feed-forward residual branch (G of a reversible block)."""
        return self.ffn(self.ln_ffn(x_BTD))

    def forward(self, x_BTD, key_padding_mask_BT=None, memory_BSD=None, memory_padding_mask_BS=None):
        x_BTD = x_BTD + self.attention_branch(x_BTD, key_padding_mask_BT)
        if self.cross is not None:
            x_BTD = x_BTD + self.dropout(
                self.cross(self.ln_cross(x_BTD), memory_BSD, key_padding_mask_BS=memory_padding_mask_BS)
            )
        return x_BTD + self.feed_forward_branch(x_BTD)

    def attention_parameters(self) -> int:
        return self.attn.attention_parameters() + (self.cross.attention_parameters() if self.cross else 0)


class TransformerStack(nn.Module):
    """A stack of layers with a final LayerNorm (needed by pre-LN, whose residual stream is unnormalised)."""

    def __init__(self, cfg: ModelConfig, n_layers: int, shared_state: nn.ModuleDict, *, causal: bool, cross: bool):
        super().__init__()
        if cfg.reversible and cross:
            raise ValueError(
                "model.reversible=true is not supported for a translation decoder: its cross-attention is a third "
                "residual branch that the two-stream RevNet block has no place for. Set model.reversible=false "
                "for translation, or use it with masked or causal LM"
            )
        self.reversible = cfg.reversible
        self.layers = nn.ModuleList(
            TransformerLayer(cfg, i, shared_state, causal=causal, cross=cross) for i in range(n_layers)
        )
        # Held, not registered (the model owns it): a reversible backward must return its gradients too.
        object.__setattr__(self, "_shared_state", shared_state)
        self.ln_final = nn.LayerNorm(cfg.d_model)

    def forward(self, x_BTD, key_padding_mask_BT=None, memory_BSD=None, memory_padding_mask_BS=None):
        if self.reversible:
            params = list(self.layers.parameters()) + list(self._shared_state.parameters())
            y1_BTD, y2_BTD = reversible_stack(list(self.layers), x_BTD, x_BTD, params, key_padding_mask_BT)
            return self.ln_final((y1_BTD + y2_BTD) / 2)
        for layer in self.layers:
            x_BTD = layer(x_BTD, key_padding_mask_BT, memory_BSD, memory_padding_mask_BS)
        return self.ln_final(x_BTD)


class EmbeddingInput(nn.Module):
    """Token embedding + absolute positions + dropout."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.max_seq_len = cfg.max_seq_len
        self.tokens = build_token_embedding(cfg, vocab_size)
        self.positions = build_positions(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        T = tokens_BT.shape[1]
        if T > self.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.max_seq_len}; "
                             "raise model.max_seq_len or shorten the task's seq_len")
        return self.dropout(self.tokens(tokens_BT) + self.positions(T))


class OutputHead(nn.Module):
    """Projection to the vocabulary, tied to the token embedding when it offers a [V, D] weight."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, embedding: nn.Module):
        super().__init__()
        tied = embedding.output_weight() if cfg.tie_output else None
        if tied is not None:
            object.__setattr__(self, "_tied_module", embedding)  # not a submodule: counted once
        else:
            self.proj = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        tied = getattr(self, "_tied_module", None)
        weight = tied.output_weight() if tied is not None else self.proj.weight
        return F.linear(h_BTD, weight, self.bias)


def _init_weights(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class _CountsMixin:
    def attention_parameters(self) -> int:
        """Attention-only count (MHE paper convention), model-owned shared extras counted once."""
        layers = [m for m in self.modules() if isinstance(m, TransformerLayer)]  # type: ignore[attr-defined]
        shared = sum(p.numel() for p in self.shared_state.parameters())  # type: ignore[attr-defined]
        return sum(layer.attention_parameters() for layer in layers) + shared

    def parameter_counts(self) -> dict[str, int]:
        return {"attention": self.attention_parameters(), "total": sum(p.numel() for p in self.parameters())}  # type: ignore[attr-defined]


class LanguageModel(_CountsMixin, nn.Module):
    """Encoder (masked LM, causal=False) or decoder-only (causal LM, causal=True) with a tied head."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, *, causal: bool):
        super().__init__()
        self.cfg, self.causal = cfg, causal
        self.shared_state = nn.ModuleDict()
        self.embed = EmbeddingInput(cfg, vocab_size)
        self.stack = TransformerStack(cfg, cfg.layers, self.shared_state, causal=causal, cross=False)
        _init_weights(self.stack)
        self.head = OutputHead(cfg, vocab_size, self.embed.tokens)

    def forward(self, tokens_BT: torch.Tensor, key_padding_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V]."""
        return self.head(self.stack(self.embed(tokens_BT), key_padding_mask_BT))


class Seq2SeqTransformer(_CountsMixin, nn.Module):
    """Encoder-decoder for translation; source and target share one (joint) vocabulary and embedding."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.shared_state = nn.ModuleDict()
        self.embed = EmbeddingInput(cfg, vocab_size)
        self.encoder = TransformerStack(cfg, cfg.layers, self.shared_state, causal=False, cross=False)
        self.decoder = TransformerStack(
            cfg, cfg.decoder_layers or cfg.layers, self.shared_state, causal=True, cross=True
        )
        _init_weights(self.encoder)
        _init_weights(self.decoder)
        self.head = OutputHead(cfg, vocab_size, self.embed.tokens)

    def encode(self, src_BS: torch.Tensor, src_padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(self.embed(src_BS), src_padding_mask_BS)

    def decode(self, tgt_in_BT, memory_BSD, src_padding_mask_BS=None, tgt_padding_mask_BT=None) -> torch.Tensor:
        """Logits [B, T, V] for every target prefix position."""
        h_BTD = self.decoder(self.embed(tgt_in_BT), tgt_padding_mask_BT, memory_BSD, src_padding_mask_BS)
        return self.head(h_BTD)

    def forward(self, src_BS, tgt_in_BT, src_padding_mask_BS=None, tgt_padding_mask_BT=None) -> torch.Tensor:
        memory_BSD = self.encode(src_BS, src_padding_mask_BS)
        return self.decode(tgt_in_BT, memory_BSD, src_padding_mask_BS, tgt_padding_mask_BT)
