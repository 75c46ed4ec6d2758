"""The attention registry: one table from each `kind` to its config class, projection scheme and mechanism.

`ATTENTION_KINDS`, the pydantic union `AttentionConfig` (the type of `model.attention`), the mechanism table
and `build_attention` are all derived from `ATTENTION_REGISTRY`. Adding a kind is one new file (its config
class, subclassing `_ProjectionKindConfig` or a mechanism config and `_AttentionConfig`, plus its projection
scheme or mechanism) and one line below; docs/attention.md, "Adding a kind", walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable, Protocol, Union

import torch.nn as nn
from pydantic import BaseModel, Field

from models.attention.config import (
    ELAttConfig,
    ExactMechanismConfig,
    GQAConfig,
    HyperConfig,
    LinformerConfig,
    LSHConfig,
    MHAConfig,
    MHEConfig,
    MQAConfig,
    SHAConfig,
    SKVConfig,
    _AttentionConfig,
    _ProjectionKindConfig,
)
from models.attention.exact import ExactMechanism
from models.attention.hyper import HyperMechanism
from models.attention.linformer import LinformerMechanism
from models.attention.lsh import LSHMechanism
from models.attention.module import Attention
from models.attention.relative import RelativeMechanism
from models.attention.projections import (
    ELAttProjection,
    HeadEmbeddingProjection,
    ProjectionScheme,
    SharedKVProjection,
    SharedQKProjection,
    gqa_projection,
    mha_projection,
    mqa_projection,
)


class MechanismClass(Protocol):
    """What the registry needs of a mechanism class; mechanism modules match it without importing it."""

    config_cls: type[BaseModel]
    """The mechanism's config class, whose `kind` literal names it in a `mechanism:` block."""

    def from_config(
        self, cfg: Any, attention: _AttentionConfig, layer_index: int, shared_state: nn.ModuleDict
    ) -> nn.Module:
        """Build the mechanism of layer `layer_index` from its config and the attention block around it."""
        ...


ProjectionBuilder = Callable[[Any], ProjectionScheme]
"""Builds a projection scheme from an attention config: a ProjectionScheme subclass or a small function."""


def _tag(config_cls: type[BaseModel]) -> str:
    """The `kind` literal of a config class (its default, which is also its only allowed value)."""
    return config_cls.model_fields["kind"].default


@dataclass(frozen=True)
class AttentionKind:
    """One row of the registry."""

    name: str
    """The `kind:` of an attention block; equals the `kind` literal of `config_cls`."""
    config_cls: type[_AttentionConfig]
    """The block's pydantic config."""
    projection: ProjectionBuilder
    """Makes per-head q, k, v and the output projection."""
    mechanism: MechanismClass
    """Mixes the heads; kinds with a `mechanism:` field (mha to mhe) take the one their block names, if any."""
    cross_projection: ProjectionBuilder | None = None
    """Projection scheme for cross-attention when `projection` needs one sequence (lsh's shared QK)."""

    def __post_init__(self) -> None:
        if _tag(self.config_cls) != self.name:
            raise TypeError(f"registry row {self.name!r} holds {self.config_cls.__name__}, whose kind is "
                            f"{_tag(self.config_cls)!r}: the row's name and the config's kind literal must match")


ATTENTION_REGISTRY: tuple[AttentionKind, ...] = (
    AttentionKind("mha", MHAConfig, projection=mha_projection, mechanism=ExactMechanism),
    AttentionKind("sha", SHAConfig, projection=HeadEmbeddingProjection, mechanism=ExactMechanism),
    AttentionKind("mqa", MQAConfig, projection=mqa_projection, mechanism=ExactMechanism),
    AttentionKind("gqa", GQAConfig, projection=gqa_projection, mechanism=ExactMechanism),
    AttentionKind("skv", SKVConfig, projection=SharedKVProjection, mechanism=ExactMechanism),
    AttentionKind("el_att", ELAttConfig, projection=ELAttProjection, mechanism=ExactMechanism),
    AttentionKind("mhe", MHEConfig, projection=HeadEmbeddingProjection, mechanism=ExactMechanism),
    AttentionKind("linformer", LinformerConfig, projection=mha_projection, mechanism=LinformerMechanism),
    AttentionKind("lsh", LSHConfig, projection=SharedQKProjection, mechanism=LSHMechanism,
                  cross_projection=mha_projection),
    AttentionKind("hyper", HyperConfig, projection=mha_projection, mechanism=HyperMechanism),
)

ATTENTION_KINDS: tuple[str, ...] = tuple(kind.name for kind in ATTENTION_REGISTRY)

AttentionConfig = Annotated[Union[tuple(kind.config_cls for kind in ATTENTION_REGISTRY)], Field(discriminator="kind")]
"""`model.attention`: the kinds' configs, told apart by `kind` (an unknown kind lists the valid ones)."""

MECHANISMS: tuple[MechanismClass, ...] = tuple(dict.fromkeys(kind.mechanism for kind in ATTENTION_REGISTRY))
"""Every mechanism, each once, in registry order: a `mechanism:` block (models/attention/config.py's
MechanismConfig) and cross-attention (always exact) pick from these by config class."""

RELATIVE_KINDS: tuple[str, ...] = tuple(
    kind.name for kind in ATTENTION_REGISTRY if issubclass(kind.config_cls, _ProjectionKindConfig)
)
"""Kinds that take `model.positional: relative`: projection schemes over exact attention, whose logits
Transformer-XL's relative terms extend (with `mechanism:` left exact)."""


def relative_unsupported_reason(cfg) -> str | None:
    """Why `model.positional: relative` cannot be used with this attention block; None when it can."""
    if cfg.kind not in RELATIVE_KINDS:
        return (f"model.positional: relative is supported with attention kinds {list(RELATIVE_KINDS)}; got "
                f"{cfg.kind}: the relative terms extend exact softmax logits, which {cfg.kind} approximates. "
                "Use one of those kinds, or learned / sinusoidal positions")
    if not isinstance(cfg.mechanism, ExactMechanismConfig):
        return (f"model.positional: relative needs exact attention, but model.attention.mechanism.kind="
                f"{cfg.mechanism.kind}; drop the mechanism block, or use learned / sinusoidal positions")
    return None


_KIND_BY_NAME: dict[str, AttentionKind] = {kind.name: kind for kind in ATTENTION_REGISTRY}
_MECHANISM_BY_CONFIG: dict[type[BaseModel], MechanismClass] = {m.config_cls: m for m in MECHANISMS}


def build_attention(cfg, layer_index: int, shared_state: nn.ModuleDict, *, cross: bool = False,
                    relative: bool = False) -> Attention:
    """Build the attention module of layer `layer_index`.

    `cfg` is an AttentionConfig with d_model filled in. `shared_state` is a ModuleDict owned by the model
    for cross-layer state (Linformer's layerwise E). Cross-attention keeps the kind's projection scheme but
    always mixes exactly: sequence-compressing mechanisms are defined for self-attention in their papers
    (lsh, whose shared-QK scheme needs one sequence, gets mha projections there). LSH and HyperAttention
    derive their hash seeds from their config seed and `layer_index`, so each layer hashes differently
    and a reversible backward pass recomputes the same buckets. `relative` swaps the exact mechanism for
    Transformer-XL's relative one (models/attention/relative.py; self-attention only).
    """
    name = getattr(cfg, "kind", None)
    if name not in _KIND_BY_NAME:
        raise ValueError(f"model.attention.kind={name!r} is not known; valid kinds: {', '.join(ATTENTION_KINDS)}")
    kind = _KIND_BY_NAME[name]
    if cfg.d_model is None:
        raise ValueError("model.attention.d_model is unset: build attention through ModelConfig")
    if relative:
        reason = "cross-attention has no relative positions" if cross else relative_unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(reason)
        projection = kind.projection(cfg)
        return Attention(kind.name, projection,
                         RelativeMechanism.build(cfg, projection.attended_heads, shared_state))
    mechanism_cfg = ExactMechanismConfig() if cross else cfg.mechanism
    mechanism_cls = _MECHANISM_BY_CONFIG.get(type(mechanism_cfg))
    if mechanism_cls is None:
        raise ValueError(f"model.attention.mechanism.kind={mechanism_cfg.kind!r} is not known; valid "
                         f"mechanisms: {', '.join(_tag(m.config_cls) for m in MECHANISMS)}")
    # The mechanism is built before the projection: seeded models keep their parameter creation order.
    mechanism = mechanism_cls.from_config(mechanism_cfg, cfg, layer_index, shared_state)
    projection = (kind.cross_projection or kind.projection) if cross else kind.projection
    return Attention(kind.name, projection(cfg), mechanism)
