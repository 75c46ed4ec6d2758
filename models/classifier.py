"""Sequence classifier: the masked-LM encoder (embeddings + bidirectional stack) under a classification head.

The encoder's modules and parameter names are those of `LanguageModel(causal=False)`, so a masked-LM
checkpoint's `embed.*`, `stack.*` and `shared_state.*` weights load into it unchanged (`encoder_state`); only the
LM output layer is left behind and the head is new.

Pooling: the masked LM here has no sentence-level objective (no [CLS] / next-sentence prediction), so nothing
trains the first position to summarise the input; `mean` (the default) averages the final states of the real
positions (padding excluded), `first` takes position 0 as BERT does. The head is RoBERTa's
(`RobertaClassificationHead` in Hugging Face transformers' modeling_roberta.py, fairseq's
`RobertaClassificationHead`): dropout -> dense d->d -> tanh -> dropout -> d->classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn as nn

from models.config import ModelConfig
from models.transformer import EmbeddingInput, TransformerStack, _CountsMixin, _init_weights

ENCODER_PREFIXES = ("embed.", "stack.", "shared_state.")
"""Parameter-name prefixes of the encoder: what a classifier takes from a masked-LM checkpoint."""


class ClassificationHead(nn.Module):
    def __init__(self, d_model: int, num_classes: int, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, num_classes)

    def forward(self, pooled_BD: torch.Tensor) -> torch.Tensor:
        x_BD = torch.tanh(self.dense(self.dropout(pooled_BD)))
        return self.out_proj(self.dropout(x_BD))


class SequenceClassifier(_CountsMixin, nn.Module):
    """Logits [B, C] of token sequences [B, T] (padding on the right, `key_padding_mask_BT` True = padding)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, num_classes: int,
                 pooling: Literal["mean", "first"] = "mean"):
        super().__init__()
        self.cfg, self.pooling = cfg, pooling
        self.shared_state = nn.ModuleDict()
        self.embed = EmbeddingInput(cfg, vocab_size)
        self.stack = TransformerStack(cfg, cfg.layers, self.shared_state, causal=False, cross=False)
        _init_weights(self.stack)
        self.head = ClassificationHead(cfg.d_model, num_classes, cfg.dropout)
        _init_weights(self.head)

    def pool(self, h_BTD: torch.Tensor, key_padding_mask_BT: torch.Tensor | None) -> torch.Tensor:
        if self.pooling == "first":
            return h_BTD[:, 0]
        if key_padding_mask_BT is None:
            return h_BTD.mean(dim=1)
        real_BT1 = (~key_padding_mask_BT).unsqueeze(-1).to(h_BTD.dtype)
        return (h_BTD * real_BT1).sum(dim=1) / real_BT1.sum(dim=1).clamp_min(1.0)

    def forward(self, tokens_BT: torch.Tensor, key_padding_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        h_BTD = self.stack(self.embed(tokens_BT), key_padding_mask_BT)
        return self.head(self.pool(h_BTD, key_padding_mask_BT))

    def freeze(self, what: Literal["none", "embeddings", "encoder"]) -> None:
        """Stop gradients into the token embeddings, or into the whole encoder (embeddings, positions, layers,
        model-owned shared projections); the head always trains."""
        if what == "none":
            return
        frozen = [self.embed.tokens] if what == "embeddings" else [self.embed, self.stack, self.shared_state]
        for module in frozen:
            for p in module.parameters():
                p.requires_grad_(False)


def encoder_state(lm_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's entries of a LanguageModel state dict (its LM output layer dropped)."""
    return {k: v for k, v in lm_state.items() if k.startswith(ENCODER_PREFIXES)}


def load_encoder(model: SequenceClassifier, lm_state: Mapping[str, torch.Tensor]) -> None:
    """Copy a masked-LM checkpoint's encoder into `model`. Raises ValueError naming the first differing tensor
    when the two encoders are not the same architecture (a missing, extra or differently shaped entry)."""
    source = encoder_state(lm_state)
    target = {k: v for k, v in model.state_dict().items() if k.startswith(ENCODER_PREFIXES)}
    missing, extra = sorted(set(target) - set(source)), sorted(set(source) - set(target))
    if missing or extra:
        what = f"lacks {missing[:3]}" if missing else f"has extra {extra[:3]}"
        raise ValueError(f"model.init_from: the pretrained encoder {what} compared with this model; the model "
                         "block (attention kind and knobs, embedding, layers, positions) must equal the pretraining run's")
    for name, tensor in source.items():
        if tuple(tensor.shape) != tuple(target[name].shape):
            raise ValueError(f"model.init_from: {name} is {tuple(tensor.shape)} in the pretrained run but "
                             f"{tuple(target[name].shape)} here; the model block must equal the pretraining run's")
    model.load_state_dict(source, strict=False)
