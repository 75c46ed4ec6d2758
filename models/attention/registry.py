"""The attention registry: one table from each `kind` to its config class, projection scheme and mechanism.

`ATTENTION_REGISTRY` is the table; `make_registry(rows)` derives everything else from a table: the kind
names, the mechanism table, the `mechanism:` union (the configs of the crossable mechanisms), each projection
kind's config with that union as its `mechanism` field, the `AttentionConfig` union that `model.attention`
validates against, and `build_attention`. `ATTENTION` is the registry of `ATTENTION_REGISTRY`; the module's
other names (ATTENTION_KINDS, AttentionConfig, MECHANISMS, build_attention, ...) are its parts.

A registry is a value, not a table to register into: another table makes another registry, e.g.
`make_registry(ATTENTION_REGISTRY + (row,))`, and nothing else changes. `ModelConfig.for_registry(registry)`
(models/config.py) is the model config whose attention block validates against that registry and is built
from it (tests/test_attention_toy.py trains a kind defined in tests/ that way). Adding a kind to the project
is one new file and one row below; docs/attention.md, "Adding a kind", walks through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, Callable, Protocol, Union

import torch.nn as nn
from pydantic import BaseModel, Field, create_model

from models.attention.base import _AttentionConfig, _MechanismConfig
from models.attention.exact import ExactMechanism, ExactMechanismConfig
from models.attention.hyper import HyperConfig, HyperMechanism
from models.attention.linformer import LinformerConfig, LinformerMechanism
from models.attention.lsh import LSHConfig, LSHMechanism
from models.attention.module import Attention
from models.attention.projections import (
    ELAttConfig,
    ELAttProjection,
    GQAConfig,
    HeadEmbeddingProjection,
    MHAConfig,
    MHEConfig,
    MQAConfig,
    ProjectionScheme,
    SHAConfig,
    SharedKVProjection,
    SharedQKProjection,
    SKVConfig,
    _ProjectionKindConfig,
    gqa_projection,
    mha_projection,
    mqa_projection,
)
from models.attention.relative import RelativeMechanism


class MechanismClass(Protocol):
    """What the registry needs of a mechanism class; mechanism modules match it without importing it."""

    config_cls: type[_MechanismConfig]
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


def _tagged_union(config_classes: Sequence[type[BaseModel]]) -> Any:
    """The configs as one type, told apart by `kind` (an unknown kind lists the valid ones)."""
    if len(config_classes) == 1:
        return config_classes[0]
    return Annotated[Union[tuple(config_classes)], Field(discriminator="kind")]


@dataclass(frozen=True)
class AttentionKind:
    """One row of the registry."""

    name: str
    """The `kind:` of an attention block; equals the `kind` literal of `config_cls`."""
    config_cls: type[_AttentionConfig]
    """The block's pydantic config, from the kind's own file."""
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


@dataclass(frozen=True)
class AttentionRegistry:
    """Everything derived from one table of kinds; made by `make_registry`."""

    rows: tuple[AttentionKind, ...]
    """The table, in order: the order of `kinds` and of the valid names that errors list."""
    configs: Mapping[str, type[_AttentionConfig]]
    """Kind name -> the class `model.attention` validates into: the row's config, or for a projection kind a
    subclass of it whose `mechanism` field is `mechanism_config`."""
    mechanisms: tuple[MechanismClass, ...]
    """Every mechanism of the rows, each once, in row order: a `mechanism:` block and cross-attention (always
    exact) pick from these by config class."""
    mechanism_config: Any
    """What a projection kind's `mechanism:` block may name: the configs of the crossable mechanisms."""
    attention_config: Any
    """`model.attention`: the kinds' configs (`configs`), told apart by `kind`."""

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(row.name for row in self.rows)

    @property
    def relative_kinds(self) -> tuple[str, ...]:
        """Kinds that take `model.positional: relative`: projection schemes over exact attention, whose logits
        Transformer-XL's relative terms extend (with `mechanism:` left exact)."""
        return tuple(row.name for row in self.rows if issubclass(row.config_cls, _ProjectionKindConfig))

    def fill_from_model(self, block: dict[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
        """A raw attention block (d_model already set) with what its kind and its `mechanism:` block take from
        the model's fields (`model`) filled in; blocks naming an unknown kind are left for validation to refuse."""
        config_cls = self.configs.get(block.get("kind"))  # type: ignore[arg-type]
        if config_cls is not None:
            block = config_cls.fill_from_model(block, model)
        mechanism = block.get("mechanism")
        if isinstance(mechanism, BaseModel):
            mechanism = mechanism.model_dump()
        if isinstance(mechanism, dict):
            mechanism_cls = {_tag(m.config_cls): m.config_cls for m in self.mechanisms}.get(mechanism.get("kind"))
            if mechanism_cls is not None:
                block = {**block, "mechanism": mechanism_cls.fill_from_model(mechanism, model)}
        return block

    def relative_unsupported_reason(self, cfg) -> str | None:
        """Why `model.positional: relative` cannot be used with this attention block; None when it can."""
        if cfg.kind not in self.relative_kinds:
            return (f"model.positional: relative is supported with attention kinds {list(self.relative_kinds)}; "
                    f"got {cfg.kind}: the relative terms extend exact softmax logits, which {cfg.kind} "
                    "approximates. Use one of those kinds, or learned / sinusoidal positions")
        if not isinstance(cfg.mechanism, ExactMechanismConfig):
            return (f"model.positional: relative needs exact attention, but model.attention.mechanism.kind="
                    f"{cfg.mechanism.kind}; drop the mechanism block, or use learned / sinusoidal positions")
        return None

    def build_attention(self, cfg, layer_index: int, shared_state: nn.ModuleDict, *, cross: bool = False,
                        relative: bool = False) -> Attention:
        """Build the attention module of layer `layer_index`.

        `cfg` is one of `configs` with d_model filled in. `shared_state` is a ModuleDict owned by the model
        for cross-layer state (Linformer's layerwise E). Cross-attention keeps the kind's projection scheme but
        always mixes exactly: sequence-compressing mechanisms are defined for self-attention in their papers
        (lsh, whose shared-QK scheme needs one sequence, gets mha projections there). LSH and HyperAttention
        derive their hash seeds from their config seed and `layer_index`, so each layer hashes differently
        and a reversible backward pass recomputes the same buckets. `relative` swaps the exact mechanism for
        Transformer-XL's relative one (models/attention/relative.py; self-attention only).
        """
        name = getattr(cfg, "kind", None)
        kind = next((row for row in self.rows if row.name == name), None)
        if kind is None:
            raise ValueError(f"model.attention.kind={name!r} is not known; valid kinds: {', '.join(self.kinds)}")
        if cfg.d_model is None:
            raise ValueError("model.attention.d_model is unset: build attention through ModelConfig")
        if relative:
            reason = "cross-attention has no relative positions" if cross else self.relative_unsupported_reason(cfg)
            if reason is not None:
                raise ValueError(reason)
            projection = kind.projection(cfg)
            return Attention(kind.name, projection,
                             RelativeMechanism.build(cfg, projection.attended_heads, shared_state))
        mechanism_cfg = ExactMechanismConfig() if cross else cfg.mechanism
        mechanism_cls = next((m for m in self.mechanisms if m.config_cls is type(mechanism_cfg)), None)
        if mechanism_cls is None:
            raise ValueError(f"model.attention.mechanism.kind={mechanism_cfg.kind!r} is not known; valid "
                             f"mechanisms: {', '.join(_tag(m.config_cls) for m in self.mechanisms)}")
        # The mechanism is built before the projection: seeded models keep their parameter creation order.
        mechanism = mechanism_cls.from_config(mechanism_cfg, cfg, layer_index, shared_state)
        projection = (kind.cross_projection or kind.projection) if cross else kind.projection
        return Attention(kind.name, projection(cfg), mechanism)


def _with_mechanisms(config_cls: type[_AttentionConfig], mechanism_config: Any) -> type[_AttentionConfig]:
    """A projection kind's config whose `mechanism` field takes `mechanism_config` (its own class takes exact
    only); any other kind's config as it is."""
    if not issubclass(config_cls, _ProjectionKindConfig):
        return config_cls
    field = config_cls.model_fields["mechanism"]
    return create_model(
        config_cls.__name__, __base__=config_cls, __module__=config_cls.__module__, __doc__=config_cls.__doc__,
        mechanism=(mechanism_config, Field(default_factory=field.default_factory, description=field.description)),
    )


def make_registry(rows: Sequence[AttentionKind]) -> AttentionRegistry:
    """The registry of a table of kinds: every union and table derived from its rows."""
    rows = tuple(rows)
    names = [row.name for row in rows]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"attention kinds {repeated} have more than one registry row; give each kind one row")
    mechanisms = tuple(dict.fromkeys(row.mechanism for row in rows))
    mechanism_config = _tagged_union([m.config_cls for m in mechanisms if m.config_cls.crossable])
    configs = {row.name: _with_mechanisms(row.config_cls, mechanism_config) for row in rows}
    return AttentionRegistry(rows=rows, configs=MappingProxyType(configs), mechanisms=mechanisms,
                             mechanism_config=mechanism_config, attention_config=_tagged_union(list(configs.values())))


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

ATTENTION: AttentionRegistry = make_registry(ATTENTION_REGISTRY)
"""The project's registry: what `model.attention` of a spec validates against and is built from."""

ATTENTION_KINDS: tuple[str, ...] = ATTENTION.kinds
AttentionConfig = ATTENTION.attention_config
"""`model.attention`: the kinds' configs, told apart by `kind` (an unknown kind lists the valid ones)."""
MechanismConfig = ATTENTION.mechanism_config
"""What a projection kind's `mechanism:` block may name (not lsh: see LSHMechanismConfig)."""
MECHANISMS: tuple[MechanismClass, ...] = ATTENTION.mechanisms
RELATIVE_KINDS: tuple[str, ...] = ATTENTION.relative_kinds
relative_unsupported_reason = ATTENTION.relative_unsupported_reason
build_attention = ATTENTION.build_attention
