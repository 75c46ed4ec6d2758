"""Key/value cache for incremental decoding of the encoder-decoder: one explicit structure the decoding loop holds.

Without it every decoding step reruns the decoder over the whole prefix, O(T^2) decoder work per sentence.
With it a step runs the newest position only: its self-attention keys/values are appended to each layer's
cache, and cross-attention reads keys/values of the encoder output computed once per batch (the incremental
state of fairseq's decoder, Ott et al., 2019, arXiv 1904.01038, passed as an argument instead of kept in the
modules). Tensors hold the compact heads of `ProjectionScheme.keys_values` ([N, G, T, E], G = 1 for mqa and
mhe), so an mqa/gqa cache is as small as the scheme promises.

Rows are sentences x beams. Beam reselection moves rows within a sentence (`reorder_beams`); a sentence whose
beam search is done leaves the batch (`select`), so later steps spend no decoder work on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerKV:
    """One decoder layer: self-attention keys/values of the prefix and cross-attention ones of the source."""

    cross_k_NGSE: torch.Tensor
    cross_v_NGSE: torch.Tensor
    self_k_NGTE: torch.Tensor | None = None
    """None before the first step; grows by one position per step."""
    self_v_NGTE: torch.Tensor | None = None

    def append(self, k_NG1E: torch.Tensor, v_NG1E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the newest position's keys/values; returns the whole prefix's."""
        if self.self_k_NGTE is None or self.self_v_NGTE is None:
            self.self_k_NGTE, self.self_v_NGTE = k_NG1E, v_NG1E
        else:
            self.self_k_NGTE = torch.cat([self.self_k_NGTE, k_NG1E], dim=2)
            self.self_v_NGTE = torch.cat([self.self_v_NGTE, v_NG1E], dim=2)
        return self.self_k_NGTE, self.self_v_NGTE

    def select_prefix(self, rows_N: torch.Tensor) -> None:
        """Keep rows `rows_N`, in that order, of the prefix's keys/values."""
        if self.self_k_NGTE is not None and self.self_v_NGTE is not None:
            self.self_k_NGTE = self.self_k_NGTE.index_select(0, rows_N)
            self.self_v_NGTE = self.self_v_NGTE.index_select(0, rows_N)

    def select(self, rows_N: torch.Tensor) -> None:
        """Keep rows `rows_N`, in that order, of every tensor (the source's keys/values too)."""
        self.cross_k_NGSE = self.cross_k_NGSE.index_select(0, rows_N)
        self.cross_v_NGSE = self.cross_v_NGSE.index_select(0, rows_N)
        self.select_prefix(rows_N)


@dataclass
class DecoderCache:
    """Every decoder layer's LayerKV for N = sentences x beams rows, plus the source padding mask."""

    layers: list[LayerKV]
    memory_padding_mask_NS: torch.Tensor | None
    length: int = 0
    """Target positions decoded so far: the position of the next token (its position-embedding offset)."""

    def reorder_beams(self, origin_BK: torch.Tensor) -> None:
        """Beam k of sentence b continues the prefix of its beam origin_BK[b, k] (beam reselection).

        Rows only move within their sentence, whose beams share one source, so the cross-attention keys/values
        and the source mask stay where they are and only the prefixes' keys/values are gathered.
        """
        B, K = origin_BK.shape
        rows_N = (torch.arange(B, device=origin_BK.device)[:, None] * K + origin_BK).view(-1)
        for layer in self.layers:
            layer.select_prefix(rows_N)

    def select(self, rows_N: torch.Tensor) -> None:
        """Keep rows `rows_N`, in that order: the beams of the sentences still being decoded.

        Unlike `reorder_beams` this moves rows across sentences, so every layer's cross-attention keys/values
        and the source padding mask are gathered along with the prefixes' keys/values.
        """
        for layer in self.layers:
            layer.select(rows_N)
        if self.memory_padding_mask_NS is not None:
            self.memory_padding_mask_NS = self.memory_padding_mask_NS.index_select(0, rows_N)
