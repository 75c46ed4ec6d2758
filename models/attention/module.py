"""The outer attention module every layer holds: a projection scheme around a mixing mechanism."""

from __future__ import annotations

import torch
import torch.nn as nn

from models.attention.projections import ProjectionScheme


class Attention(nn.Module):
    """The attention contract of DESIGN.md.

    forward(x [B, T, D], context [B, S, D] | None, key_padding_mask [B, S] bool (True = padding) | None,
    causal) -> [B, T, D]. `attention_parameters()` counts projection weights incl. W^O plus the
    mechanism's own extras (MHE paper convention: no biases; ours have none).
    """

    def __init__(self, kind: str, projection: ProjectionScheme, mechanism: nn.Module):
        super().__init__()
        self.kind = kind
        self.projection = projection
        self.mechanism = mechanism
        # A mechanism that compresses the sequence linearly (Linformer with a shared E) and a scheme whose K/V
        # are affine per position commute: compress the input first, then project k rows instead of n.
        self.compresses_context = projection.projects_compressed_context and bool(
            getattr(mechanism, "compresses_context", False)
        )
        # Linformer sharing=none holds one E, F per head; sha attends with one head, so they would not fit.
        per_head = getattr(getattr(mechanism, "E", None), "heads", None)
        if per_head is not None and per_head != projection.attended_heads:
            raise ValueError(
                f"model.attention.kind={kind} attends with {projection.attended_heads} head(s) but its mechanism "
                f"holds per-head projections for {per_head} (linformer sharing=none); use sharing=headwise, "
                "which is the same thing for one head"
            )

    @property
    def supports_causal(self) -> bool:
        return bool(getattr(self.mechanism, "supports_causal", False))

    def kv_cache_unsupported_reasons(self) -> list[str]:
        """Why `keys_values` + `attend` cannot decode step by step; empty when they can.

        Only the exact mechanism qualifies: approximate ones (linformer, lsh, hyper) mix a query with keys
        compressed, hashed or sampled from the whole sequence, which changes as the sequence grows.
        """
        reasons = []
        if not getattr(self.mechanism, "supports_kv_cache", False):
            reasons.append(f"{self.kind}: mechanism {type(self.mechanism).__name__} is not exact attention")
        if not self.projection.supports_kv_cache:
            reasons.append(f"{self.kind}: projection {type(self.projection).__name__} cannot cache keys/values")
        return reasons

    def keys_values(self, ctx_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact keys and values [B, G, S, E] of the context, the form a decoder caches."""
        return self.projection.keys_values(ctx_BSD)

    def attend(self, x_BTD: torch.Tensor, k_BGSE: torch.Tensor, v_BGSE: torch.Tensor,
               key_padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        """x's queries over given compact keys/values (from `keys_values`), without a causal mask: an
        incremental decoder passes exactly the keys its new position may see."""
        q_BHTE = self.projection.queries(x_BTD)
        k_BHSE, v_BHSE = self.projection.expand_heads(k_BGSE, v_BGSE)
        o_BHTE = self.mechanism(q_BHTE, k_BHSE, v_BHSE, key_padding_mask_BS=key_padding_mask_BS, causal=False)
        return self.projection.output(o_BHTE)

    def forward(
        self,
        x_BTD: torch.Tensor,
        context_BSD: torch.Tensor | None = None,
        key_padding_mask_BS: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        ctx_BSD = x_BTD if context_BSD is None else context_BSD
        if key_padding_mask_BS is not None and key_padding_mask_BS.shape != ctx_BSD.shape[:2]:
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_mask_BS.shape)} but keys are "
                f"{tuple(ctx_BSD.shape[:2])} (batch, seq); it must be bool with True at padded key positions"
            )
        if self.compresses_context:
            compressed = self.mechanism.compress_context(ctx_BSD, key_padding_mask_BS)
            q_BHTE, k_BHKE, v_BHKE = self.projection.qkv_compressed(x_BTD, compressed)
            o_BHTE = self.mechanism.attend_compressed(
                q_BHTE, k_BHKE, v_BHKE, empty_BK=compressed.empty_BK, causal=causal
            )
            return self.projection.output(o_BHTE)
        q_BHTE, k_BHSE, v_BHSE = self.projection.qkv(x_BTD, ctx_BSD)
        o_BHTE = self.mechanism(q_BHTE, k_BHSE, v_BHSE, key_padding_mask_BS=key_padding_mask_BS, causal=causal)
        return self.projection.output(o_BHTE)

    def attention_parameters(self) -> int:
        return self.projection.attention_parameters() + self.mechanism.attention_parameters()
