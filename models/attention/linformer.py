"""Linformer mechanism: keys and values compressed along the sequence axis from n to k.

Linformer: Self-Attention with Linear Complexity. Wang, Li, Khabsa, Fang, Ma (2020), arXiv 2006.04768.
head_i = softmax(q_i (E_i K_i)^T / sqrt(d)) F_i V_i, eq. 7, with E, F of shape (k, n) applied to the
sequence axis. Inputs shorter than `max_seq_len` use the first n columns of E/F (as fairseq does).

Padding: padded keys and values are zeroed *before* the projection, so they contribute nothing to the
compressed keys/values (fairseq ignores the padding mask here; appending padding changes its outputs).
For pooling and conv projections, compressed slots made only of padding are masked out of the softmax.

Compress first, project after: for a projection scheme whose K and V are affine maps of each position
(mha, gqa, mqa) and an E that is one map along the sequence for every head (sharing headwise/kv/layerwise,
linear or mean), E (X W^T + 1 b^T) = (E X) W^T + (E 1) b^T. The layer then compresses its input X and runs
W^K, W^V over k rows instead of n, as fairseq's Linformer does (`compress_context`; models/attention/module.py).
Zeroing padded rows of X and taking E 1 over valid positions only keeps the padding rule above exactly.
Not for max pooling (it does not commute with W), conv (its kernel mixes each head's features after W^K),
or sharing=none (one E_i per head would compress X once per head, saving nothing).

Causal use is refused: every compressed key mixes all positions, so query i would see tokens after i.
A causal-safe variant would need a different projection; see docs/attention.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import model_validator

from models.attention.base import _AttentionConfig, _MechanismConfig, _MechanismKindConfig
from models.attention.exact import ExactMechanism
from models.attention.lengths import linformer_length
from models.attention.projections import CompressedContext


class LinformerMechanismConfig(_MechanismConfig):
    """Linformer (Wang et al., 2020, arXiv 2006.04768): keys and values projected along the sequence."""

    kind: Literal["linformer"] = "linformer"
    k: int | list[int] = 128
    """Projected length; a list gives one k per layer (the paper's nonuniform k)."""
    sharing: Literal["none", "headwise", "kv", "layerwise"] = "headwise"
    """none: E_i, F_i per head; headwise: one E, F per layer; kv: E = F per layer; layerwise: one E for the model."""
    projection: Literal["linear", "mean", "max", "conv"] = "linear"
    """linear: learned k x n matrix; mean/max pooling or a conv with kernel = stride = max_seq_len / k."""
    max_seq_len: int | None = None
    """Longest sequence the projection covers (defaults to model.max_seq_len); shorter inputs slice E/F."""
    check_length = linformer_length

    @classmethod
    def fill_from_model(cls, block: dict[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
        """In a `mechanism:` block, an unset max_seq_len (missing or null, as a dumped config has it) is the
        model's."""
        return {**block, "max_seq_len": block.get("max_seq_len") or model["max_seq_len"]}

    def check_model(self, model: Any, where: str) -> None:
        if self.max_seq_len > model.max_seq_len:
            raise ValueError(f"{where}.max_seq_len={self.max_seq_len} exceeds model.max_seq_len="
                             f"{model.max_seq_len}; positions beyond model.max_seq_len cannot occur")
        if isinstance(self.k, list) and len(self.k) != max(model.layers, model.decoder_layers or 0):
            raise ValueError(f"{where}.k lists {len(self.k)} values for {model.layers} layers; "
                             "give exactly one k per layer")

    @model_validator(mode="after")
    def _check(self) -> "LinformerMechanismConfig":
        ks = self.k if isinstance(self.k, list) else [self.k]
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"model.attention.k must be >= 1 (got {self.k})")
        if isinstance(self.k, list) and self.sharing == "layerwise":
            raise ValueError(
                "model.attention.k: a per-layer list of k cannot be used with sharing=layerwise "
                "(one E serves every layer); use one integer k or another sharing mode"
            )
        if self.max_seq_len is not None:
            too_big = [k for k in ks if k > self.max_seq_len]
            if too_big:
                raise ValueError(
                    f"model.attention.k={too_big[0]} is larger than model.attention.max_seq_len="
                    f"{self.max_seq_len}; the projection compresses the sequence, so choose k <= max_seq_len"
                )
            if self.projection != "linear":
                bad = [k for k in ks if self.max_seq_len % k]
                if bad:
                    raise ValueError(
                        f"model.attention.projection={self.projection} needs max_seq_len divisible by k "
                        f"(kernel = stride = n / k); {self.max_seq_len} % {bad[0]} != 0: pick k among the "
                        f"divisors of {self.max_seq_len}"
                    )
        return self

    def k_for_layer(self, layer_index: int) -> int:
        if isinstance(self.k, list):
            if layer_index >= len(self.k):
                raise ValueError(
                    f"model.attention.k lists {len(self.k)} values but layer {layer_index} needs one: "
                    "give one k per layer"
                )
            return self.k[layer_index]
        return self.k


class LinformerConfig(LinformerMechanismConfig, _MechanismKindConfig):
    """`mha` projections with the Linformer mechanism; the knobs sit at the top level of the block."""

    kind: Literal["linformer"] = "linformer"  # type: ignore[assignment]

    tiny_knobs = {"k": 8, "sharing": "headwise"}
    bench_knobs = {"k": 32, "sharing": "headwise"}

    @classmethod
    def fill_from_model(cls, block: dict[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
        """At the top level of the block, max_seq_len defaults to model.max_seq_len."""
        return {"max_seq_len": model["max_seq_len"], **block}


def _linear_projection(heads: int | None, k: int, n: int) -> nn.Parameter:
    shape = (k, n) if heads is None else (heads, k, n)
    weight = torch.empty(shape)
    # fairseq's init: Xavier-uniform with gain 1/sqrt(2), per (k, n) matrix.
    bound = (1 / math.sqrt(2)) * math.sqrt(6.0 / (k + n))
    return nn.Parameter(weight.uniform_(-bound, bound))


class SequenceProjection(nn.Module):
    """One E (or F): maps [B, H, S, E] with S <= n to [B, H, k', E] plus a mask of empty slots.

    `heads` is None when one projection serves all heads (headwise/kv/layerwise sharing).
    """

    def __init__(self, kind: str, k: int, n: int, head_dim: int, heads: int | None):
        super().__init__()
        self.kind, self.k, self.n, self.heads = kind, k, n, heads
        self.stride = n // k
        if kind == "linear":
            self.weight = _linear_projection(heads, k, n)
        elif kind == "conv":
            groups = heads or 1
            # Grouped conv = one (head_dim x head_dim x stride) kernel per head when not shared.
            self.conv = nn.Conv1d(groups * head_dim, groups * head_dim, self.stride, self.stride, groups=groups, bias=False)

    def forward(self, x_BHSE: torch.Tensor, key_padding_mask_BS: torch.Tensor | None):
        B, H, S, E = x_BHSE.shape
        if S > self.n:
            raise ValueError(
                f"sequence length {S} exceeds model.attention.max_seq_len={self.n} of the Linformer "
                "projection; raise max_seq_len (the projection has one column per position) or shorten inputs"
            )
        valid_BS = None if key_padding_mask_BS is None else ~key_padding_mask_BS
        if valid_BS is not None:
            x_BHSE = x_BHSE.masked_fill(~valid_BS[:, None, :, None], 0.0)
        if self.kind == "linear":
            w = self.weight[..., :S]
            eq = "ks,bhse->bhke" if self.heads is None else "hks,bhse->bhke"
            return torch.einsum(eq, w.to(x_BHSE.dtype), x_BHSE), None

        # Pooling / conv: kernel = stride = n / k, so the first S positions fill ceil(S / stride) slots.
        slots = math.ceil(S / self.stride)
        pad = slots * self.stride - S
        valid_BS = torch.ones(B, S, dtype=torch.bool, device=x_BHSE.device) if valid_BS is None else valid_BS
        x_BHSE = F.pad(x_BHSE, (0, 0, 0, pad))
        valid_BS = F.pad(valid_BS, (0, pad), value=False)
        valid_BSlR = valid_BS.view(B, slots, self.stride)
        empty_BSl = ~valid_BSlR.any(-1)
        x_BHSlRE = x_BHSE.view(B, H, slots, self.stride, E)
        if self.kind == "mean":
            count_B1Sl1 = valid_BSlR.sum(-1).clamp(min=1)[:, None, :, None].to(x_BHSE.dtype)
            return x_BHSlRE.sum(3) / count_B1Sl1, empty_BSl
        if self.kind == "max":
            masked = x_BHSlRE.masked_fill(~valid_BSlR[:, None, :, :, None], torch.finfo(x_BHSE.dtype).min)
            return masked.amax(3).masked_fill(empty_BSl[:, None, :, None], 0.0), empty_BSl
        # conv over the sequence; channels are (head, feature) when each head has its own kernel.
        if self.heads is None:
            y = self.conv(x_BHSE.reshape(B * H, S + pad, E).transpose(1, 2))  # B*H, E, slots
            return y.transpose(1, 2).reshape(B, H, slots, E), empty_BSl
        y = self.conv(x_BHSE.permute(0, 1, 3, 2).reshape(B, H * E, S + pad))  # B, H*E, slots
        return y.view(B, H, E, slots).transpose(2, 3), empty_BSl


class LinformerMechanism(nn.Module):
    """Projects keys with E and values with F, then runs exact attention over the k compressed slots."""

    supports_causal = False
    config_cls = LinformerMechanismConfig

    def __init__(
        self, cfg: LinformerMechanismConfig, heads: int, head_dim: int, layer_index: int,
        shared_state: nn.ModuleDict, dropout: float = 0.0,
    ):
        super().__init__()
        assert cfg.max_seq_len is not None, "max_seq_len is filled in by ModelConfig"
        k, n = cfg.k_for_layer(layer_index), cfg.max_seq_len
        per_head = heads if cfg.sharing == "none" else None
        if cfg.sharing == "layerwise":
            # One E for every layer, owned by the model (shared_state) so it is counted and saved once;
            # held here without registering, so this layer's parameters() do not include it.
            if "linformer_E" not in shared_state:
                shared_state["linformer_E"] = SequenceProjection(cfg.projection, k, n, head_dim, None)
            object.__setattr__(self, "_layerwise_E", shared_state["linformer_E"])
        else:
            self.E = SequenceProjection(cfg.projection, k, n, head_dim, per_head)
            if cfg.sharing != "kv":
                self.F = SequenceProjection(cfg.projection, k, n, head_dim, per_head)
        self.exact = ExactMechanism(dropout)

    @classmethod
    def from_config(
        cls, cfg: LinformerMechanismConfig, attention: _AttentionConfig, layer_index: int,
        shared_state: nn.ModuleDict,
    ) -> LinformerMechanism:
        """The registry's builder (models/attention/registry.py)."""
        if cfg.max_seq_len is None:
            raise ValueError("model.attention.max_seq_len is unset: build attention through ModelConfig, "
                             "which fills it from model.max_seq_len")
        return cls(cfg, attention.heads, attention.head_dim, layer_index, shared_state, attention.dropout)

    def _projections(self) -> tuple[SequenceProjection, SequenceProjection]:
        E = getattr(self, "_layerwise_E", None) or self.E
        return E, getattr(self, "F", E)

    def forward(self, q_BHTE, k_BHSE, v_BHSE, *, key_padding_mask_BS=None, causal=False):
        E, F_ = self._projections()
        k_BHKE, empty_BK = E(k_BHSE, key_padding_mask_BS)
        v_BHKE, _ = F_(v_BHSE, key_padding_mask_BS)
        return self.attend_compressed(q_BHTE, k_BHKE, v_BHKE, empty_BK=empty_BK, causal=causal)

    @property
    def compresses_context(self) -> bool:
        """Whether E and F may compress the layer input before the K/V projections (see the module docstring)."""
        E, _ = self._projections()
        return E.heads is None and E.kind in ("linear", "mean")

    def compress_context(self, ctx_BSD: torch.Tensor, key_padding_mask_BS: torch.Tensor | None) -> CompressedContext:
        """E X and F X of the context [B, S, D], and E 1, F 1 over its valid positions (for the K/V biases)."""
        assert self.compresses_context
        E, F_ = self._projections()
        B, S, _ = ctx_BSD.shape
        # The projections act on [B, H, S, E]: the context is one "head" of width D, and E 1 is E of a column of ones.
        ctx_B1SD, ones_B1S1 = ctx_BSD[:, None], ctx_BSD.new_ones(B, 1, S, 1)
        keys_B1KD, empty_BK = E(ctx_B1SD, key_padding_mask_BS)
        key_mass_B1K1, _ = E(ones_B1S1, key_padding_mask_BS)
        if F_ is E:  # kv and layerwise sharing: one compression serves keys and values
            values_B1KD, value_mass_B1K1 = keys_B1KD, key_mass_B1K1
        else:
            values_B1KD, _ = F_(ctx_B1SD, key_padding_mask_BS)
            value_mass_B1K1, _ = F_(ones_B1S1, key_padding_mask_BS)
        return CompressedContext(keys_B1KD[:, 0], key_mass_B1K1[:, 0], values_B1KD[:, 0], value_mass_B1K1[:, 0], empty_BK)

    def attend_compressed(self, q_BHTE, k_BHKE, v_BHKE, *, empty_BK=None, causal=False):
        """Exact attention of the queries over the k compressed slots; slots made only of padding are masked."""
        if causal:
            raise ValueError(
                "model.attention.kind=linformer cannot run causal attention: its sequence projection mixes "
                "future tokens into every compressed key. Use it for masked LM / encoders, or choose a "
                "causal-capable kind (mha, mhe, lsh, hyper, ...) for causal LM and decoders"
            )
        return self.exact(q_BHTE, k_BHKE, v_BHKE, key_padding_mask_BS=empty_BK)

    def attention_parameters(self) -> int:
        """Extra k x n matrices of this layer; a layerwise E is counted once by the model."""
        return sum(p.numel() for p in self.parameters())
