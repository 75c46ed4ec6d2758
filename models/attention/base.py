"""Base classes of the attention configs: what every kind's and every mechanism's config shares.

Each kind's file (models/attention/<method>.py) subclasses these beside its implementation, and
models/attention/registry.py joins the subclasses into the unions `model.attention` validates against. This
module imports no kind, so kind files and the registry both import it without a cycle.

A config also declares what its kind needs from the rest of the project: what it takes from the model
(`fill_from_model`, `check_model`) and the knobs that make it meaningful at the tests' and benchmarks' small
sizes (`tiny_knobs`, `bench_knobs`). models/config.py, tests/ and benchmarks/ read these through the registry,
so none of them lists kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _MechanismConfig(_Config):
    """The config of a mechanism (how per-head q, k, v are mixed); its `kind` literal names it."""

    crossable: ClassVar[bool] = True
    """Offered in the `mechanism:` block of projection kinds; the registry derives that union from this flag."""

    @classmethod
    def fill_from_model(cls, block: dict[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
        """The raw `mechanism:` block with what it takes from the model's fields (`model`) filled in."""
        return block

    def check_model(self, model: Any, where: str) -> None:
        """Raise ValueError, naming the field to fix, where this mechanism does not fit the validated ModelConfig;
        `where` is the block's path (model.attention or model.attention.mechanism)."""

    def check_length(self, longest: int, source: str, where: str) -> None:
        """Raise ValueError, naming the field to fix, where this mechanism degenerates on inputs of at most
        `longest` tokens: `source` names what sets that length (e.g. "task.seq_len"), `where` the block's path
        (model.attention, model.attention.mechanism or task.patch.attention). Called by the spec check."""


class _AttentionConfig(_Config):
    heads: int = 8
    """Number of attention heads n; head dim d = d_model / heads for every kind (also sha and mhe)."""
    d_model: int | None = None
    """Model width; filled in from model.d_model."""
    dropout: float = 0.0
    """Dropout on attention probabilities."""

    tiny_knobs: ClassVar[Mapping[str, Any]] = {}
    """Knobs that make the kind meaningful at the tests' tiny sizes (d_model 32, sequences of at most 32)."""
    bench_knobs: ClassVar[Mapping[str, Any]] = {}
    """Knobs that make the kind meaningful in the small benchmarks' sequences of 64-128 tokens."""

    @classmethod
    def fill_from_model(cls, block: dict[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
        """The raw attention block with what the kind takes from the model's fields (`model`) filled in, beyond
        d_model, which ModelConfig fills for every kind."""
        return block

    @model_validator(mode="after")
    def _check_heads(self) -> "_AttentionConfig":
        if self.heads < 1:
            raise ValueError(f"model.attention.heads must be >= 1 (got {self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.attention.dropout must be in [0, 1) (got {self.dropout}); it is the dropout "
                             "probability of the attention weights, 0 disables it")
        if self.d_model is not None and self.d_model % self.heads:
            raise ValueError(
                f"model.attention.heads={self.heads} does not divide model.d_model={self.d_model}; "
                "choose heads among the divisors of d_model"
            )
        return self

    @property
    def head_dim(self) -> int:
        assert self.d_model is not None, "d_model is filled in by ModelConfig"
        return self.d_model // self.heads


class _MechanismKindConfig(_AttentionConfig):
    """A kind whose block holds one mechanism's knobs at its top level, over `mha`-style projections.

    Subclass the mechanism's config first, then this: `class LinformerConfig(LinformerMechanismConfig,
    _MechanismKindConfig)` with its own `kind` literal.
    """

    @property
    def mechanism(self) -> _MechanismConfig:
        """The mechanism's config, made from the block's top-level knobs."""
        mechanism_cls = next(c for c in type(self).__mro__
                             if issubclass(c, _MechanismConfig) and not issubclass(c, _AttentionConfig))
        fields = mechanism_cls.model_fields.keys() - {"kind"}
        return mechanism_cls(**{f: getattr(self, f) for f in fields})
