"""ModelConfig: the `model:` block of a spec. Cross-field checks live here and name the field to fix."""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from models.attention.registry import ATTENTION, AttentionConfig, AttentionRegistry

REVERSIBLE_DECODER = (
    "model.reversible=true is not supported for a translation decoder: its cross-attention is a third residual "
    "branch that the two-stream RevNet block has no place for. Set model.reversible=false for translation, or use "
    "it with masked or causal LM"
)
"""Raised by the spec check (ModelConfig.check_task) and, for models built without one, by the decoder stack."""


class StandardEmbeddingConfig(BaseModel):
    """A d_model lookup table (tied with the output layer unless model.tie_output is false)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["standard"] = "standard"


class DeFINEConfig(BaseModel):
    """DeFINE (Mehta, Koncel-Kedziorski, Rastegari, Hajishirzi, ICLR 2020, arXiv 1911.12385): Map-Expand-Reduce.

    A lookup at input_dim n, `depth` group-linear layers widening linearly from n to `width` k, then a
    reduction to d_model. The paper's notation: n = dim(e_i), k = dim(ê_i), N = depth, m = d_model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["define"] = "define"
    input_dim: int = 64
    """n: width of the lookup table (the paper uses 64-512)."""
    width: int = 512
    """k: width of the last expansion layer (the paper uses 1024-4096)."""
    depth: int = 3
    """N: number of expansion layers (the paper uses 3, 7, 11)."""
    g_max: int = 4
    """Groups of the first layer; hgt halves them per layer: g_l = max(g_max // 2^(l-1), 1)."""
    transform: Literal["lt", "glt", "hgt"] = "hgt"
    """lt: dense layers (g = 1); glt: g_max groups in every layer; hgt: the hierarchical schedule."""
    skip: Literal["none", "concat", "mix", "residual"] = "mix"
    """Input link of layers l > 1: none; concat [e_i, h]; mix (split-and-mix per group); residual h + F(h)."""
    reduce: bool = True
    """Project k down to d_model; false needs width == d_model."""

    def groups(self) -> list[int]:
        """g_l for l = 1..N."""
        if self.transform == "lt":
            return [1] * self.depth
        if self.transform == "glt":
            return [self.g_max] * self.depth
        return [max(self.g_max // 2**i, 1) for i in range(self.depth)]  # layer l = i + 1

    def group_multiple(self) -> int:
        """Every width is a multiple of this, so each layer's input and output split evenly into its groups."""
        return math.lcm(*self.groups())

    def widths(self) -> list[int]:
        """k_l for l = 1..N: linearly spaced from n to k (constant k with residual links), rounded to
        multiples of `group_multiple()`; the last is k."""
        if self.skip == "residual":
            return [self.width] * self.depth
        q = self.group_multiple()
        steps = [self.input_dim + (self.width - self.input_dim) * i / self.depth for i in range(1, self.depth)]
        return [max(q, q * round(w / q)) for w in steps] + [self.width]

    def layer_inputs(self) -> list[int]:
        """n_l, the input width of layer l: n, then the previous width, plus n where the input is linked in."""
        widths = self.widths()
        linked = self.input_dim if self.skip in ("concat", "mix") else 0
        return [self.input_dim] + [w + linked for w in widths[:-1]]

    @model_validator(mode="after")
    def _check(self) -> "DeFINEConfig":
        for name in ("input_dim", "width", "depth", "g_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.embedding.{name} must be >= 1 (got {getattr(self, name)})")
        q = self.group_multiple()
        for name in ("input_dim", "width"):
            if getattr(self, name) % q:
                raise ValueError(
                    f"model.embedding.{name}={getattr(self, name)} must be divisible by {q}, the least common "
                    f"multiple of the group counts {self.groups()} (transform={self.transform}, g_max={self.g_max}): "
                    "each group takes an equal share of every layer; pick a multiple or a smaller g_max"
                )
        if self.input_dim > self.width:
            raise ValueError(
                f"model.embedding.input_dim={self.input_dim} is larger than model.embedding.width={self.width}: "
                "DeFINE's Map-Expand-Reduce widens the lookup of width n (input_dim) up to k (width), n < k (Mehta "
                "et al., 2020, Sec. 3); raise width to at least input_dim, or lower input_dim"
            )
        return self


class AdaptiveInputConfig(BaseModel):
    """Adaptive input (Baevski & Auli, ICLR 2019, arXiv 1809.10853): frequency bands of shrinking width.

    Token ids are assumed sorted by frequency (id 0 most frequent), as sentencepiece and count-ordered
    vocabularies are. Band i holds ids [cutoffs[i-1], cutoffs[i]) at width d_model / factor^i, each band
    projected back to d_model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["adaptive"] = "adaptive"
    cutoffs: list[int]
    """Increasing band boundaries below the vocabulary size, e.g. [20000, 40000, 200000] for WikiText-103."""
    factor: float = 4.0
    """Width reduction per band (the paper's k = 4)."""

    @model_validator(mode="after")
    def _check(self) -> "AdaptiveInputConfig":
        if not self.cutoffs or self.cutoffs[0] < 1 or any(b <= a for a, b in zip(self.cutoffs, self.cutoffs[1:])):
            raise ValueError(f"model.embedding.cutoffs must be a non-empty, strictly increasing list of positive ids "
                             f"(got {self.cutoffs}); e.g. [20000, 40000, 200000]")
        if self.factor < 1:
            raise ValueError(f"model.embedding.factor must be >= 1 (got {self.factor}); the paper uses 4")
        return self

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError when the bands do not fit a vocabulary of `vocab_size` ids."""
        if self.cutoffs[-1] >= vocab_size:
            raise ValueError(f"model.embedding.cutoffs={self.cutoffs} must stay below the vocabulary size "
                             f"{vocab_size}; drop or lower the last cutoff")

    def band_dims(self, d_model: int) -> list[int]:
        return [int(d_model // self.factor**i) for i in range(len(self.cutoffs) + 1)]


EmbeddingConfig = Annotated[
    Union[StandardEmbeddingConfig, DeFINEConfig, AdaptiveInputConfig], Field(discriminator="kind")
]


class MemoryConfig(BaseModel):
    """Transformer-XL segment-level recurrence (Dai et al., ACL 2019, arXiv 1901.02860, Sec. 3.2).

    A causal LM reads its training stream as B rows of consecutive segments; every layer also attends to the
    last mem_len states of its own input from the row's previous segments, cached without gradient.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    mem_len: int
    """Cached states per layer; 0 keeps the segment order but caches nothing (the no-memory ablation)."""

    @model_validator(mode="after")
    def _check(self) -> "MemoryConfig":
        if self.mem_len < 0:
            raise ValueError(f"model.memory.mem_len must be >= 0 (got {self.mem_len}); Transformer-XL uses "
                             "about the segment length, e.g. mem_len: 128 with task.seq_len: 128")
        return self


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    attention_registry: ClassVar[AttentionRegistry] = ATTENTION
    """The registry `attention` validates against and is built from (`for_registry` makes one for another)."""

    d_model: int = 256
    """Model width."""
    layers: int = 4
    """Encoder layers (masked LM, translation) or decoder layers (causal LM)."""
    decoder_layers: int | None = None
    """Decoder layers of a translation model; defaults to `layers`."""
    ffn: int = 1024
    """Hidden width of the position-wise feed-forward block."""
    dropout: float = 0.1
    """Dropout on residual branches and embeddings."""
    activation: Literal["gelu", "relu"] = "gelu"
    """Feed-forward nonlinearity."""
    max_seq_len: int = 512
    """Longest sequence the positional table (and Linformer's projection) covers."""
    positional: Literal["learned", "sinusoidal", "relative"] = "learned"
    """learned or sinusoidal (Vaswani et al., 2017) absolute embeddings, or relative: none at the input,
    Transformer-XL's relative terms in every attention (models/attention/relative.py; causal LM only)."""
    memory: MemoryConfig | None = None
    """{mem_len: N}: Transformer-XL recurrence over consecutive segments (causal LM; needs relative positions
    when N > 0). null trains on shuffled independent blocks."""
    attention: AttentionConfig = Field(default_factory=ATTENTION.configs["mha"])
    """The attention block: {kind, heads, and the kind's knobs}, one of the kinds of `attention_registry`."""
    embedding: EmbeddingConfig = Field(default_factory=StandardEmbeddingConfig)
    """Token embedding: {kind: standard}, {kind: define, input_dim, width, depth, ...} or {kind: adaptive, cutoffs}."""
    tie_output: bool = True
    """Share the token embedding with the output projection (MLM, causal LM and translation heads)."""
    reversible: bool = False
    """Run encoder / decoder-only stacks as reversible RevNet blocks (Reformer): activation memory flat in depth."""
    init_from: str | None = None
    """Fine-tune: start the encoder (embeddings + layers) from a pretraining run's best checkpoint, given as a run
    name in run.storage_path, an MLflow run id, or a checkpoint / run folder path; its tokenizer comes along.
    Every architecture field above must match the pretrained run's (dropout may differ)."""
    freeze: Literal["none", "embeddings", "encoder"] = "none"
    """With init_from: keep the pretrained token embeddings, or the whole encoder (a linear probe), fixed."""

    @model_validator(mode="before")
    @classmethod
    def _fill_attention(cls, data):
        """Give the attention block the model's d_model and whatever else its kind and its mechanism take from
        the model (their configs' `fill_from_model`, e.g. Linformer's max_seq_len)."""
        if not isinstance(data, dict):
            return data
        attention = data.get("attention", {"kind": "mha"})
        if isinstance(attention, list):
            raise ValueError(f"model.attention is a list of {len(attention)}, but a list is not an attention block: "
                             "give one block ({kind: mha, heads: 8}), or sweep several with {grid: [{kind: mha}, "
                             "{kind: linformer, k: 64}]}")
        if isinstance(attention, BaseModel):
            attention = attention.model_dump()
        attention = dict(attention)
        d_model = data.get("d_model", cls.model_fields["d_model"].default)
        attention.setdefault("d_model", d_model)
        if attention.get("d_model") != d_model:
            raise ValueError(f"model.attention.d_model={attention['d_model']} differs from model.d_model={d_model}; "
                             "leave model.attention.d_model unset")
        model = {name: data.get(name, field.default) for name, field in cls.model_fields.items()
                 if not field.is_required() and field.default_factory is None}
        return {**data, "attention": cls.attention_registry.fill_from_model(attention, model)}

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        for name in ("d_model", "layers", "ffn", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1 (got {getattr(self, name)})")
        if self.decoder_layers is not None and self.decoder_layers < 1:
            raise ValueError(f"model.decoder_layers must be >= 1 (got {self.decoder_layers}); leave it unset for "
                             "as many as model.layers")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1) (got {self.dropout})")
        define = self.embedding if isinstance(self.embedding, DeFINEConfig) else None
        if define is not None and not define.reduce and define.width != self.d_model:
            raise ValueError(f"model.embedding.reduce=false feeds the width-{define.width} expansion straight "
                             f"into the model, so model.embedding.width must equal model.d_model={self.d_model}; "
                             "set width to d_model or reduce=true")
        if isinstance(self.embedding, AdaptiveInputConfig) and min(self.embedding.band_dims(self.d_model)) < 1:
            raise ValueError(f"model.embedding: {len(self.embedding.cutoffs)} cutoffs with factor="
                             f"{self.embedding.factor} shrink the last band below width 1 at d_model={self.d_model}; "
                             "use fewer cutoffs or a smaller factor")
        if self.positional == "relative":
            reason = self.attention_registry.relative_unsupported_reason(self.attention)
            if reason is not None:
                raise ValueError(reason)
            if self.reversible:
                raise ValueError("model.reversible=true is not supported with model.positional: relative; "
                                 "set one of them back (reversible: false, or learned / sinusoidal positions)")
        if self.memory is not None:
            if self.memory.mem_len > 0 and self.positional != "relative":
                raise ValueError(
                    f"model.memory.mem_len={self.memory.mem_len} requires model.positional: relative (got "
                    f"{self.positional}): cached states carry the absolute positions of their own segment, "
                    "which the next segment would read at the wrong place. Set model.positional: relative, "
                    "or mem_len: 0"
                )
            if self.reversible:
                raise ValueError("model.memory is not supported with model.reversible=true (a RevNet block "
                                 "recomputes its input and has no cached states); drop one of them")
        self.attention.mechanism.check_model(self, self.mechanism_path)
        return self

    @property
    def mechanism_path(self) -> str:
        """Where the spec sets the attention mechanism's knobs: its own `mechanism:` block, or the attention block
        itself (kind: linformer, lsh, hyper)."""
        return "model.attention.mechanism" if "mechanism" in type(self.attention).model_fields else "model.attention"

    def check_task(self, kind: str, longest: int, source: str, vocab_size: int | None) -> None:
        """Raise ValueError, naming the field to fix, where this model does not fit the task that feeds it: `kind`
        is task.kind, `longest` the longest sequence it feeds (`source` names what sets it, e.g. task.seq_len),
        `vocab_size` its vocabulary (None where the spec does not fix it). The spec check calls this
        (orchestrator/spec/models.py), so `validate` refuses what would otherwise fail at model build."""
        if self.reversible and kind == "translation":
            raise ValueError(REVERSIBLE_DECODER)
        if self.decoder_layers is not None and kind != "translation":
            raise ValueError(f"model.decoder_layers={self.decoder_layers} is the decoder depth of a translation "
                             f"model; task.kind: {kind} has no separate decoder, so it would be ignored: remove "
                             "model.decoder_layers (model.layers sets the depth)")
        if isinstance(self.embedding, AdaptiveInputConfig) and vocab_size is not None:
            self.embedding.check_vocab(vocab_size)
        self.attention.mechanism.check_length(longest, source, self.mechanism_path)

    @classmethod
    def for_registry(cls, registry: AttentionRegistry) -> type[ModelConfig]:
        """This model config with `attention` validated against, and built from, `registry` (made by
        models.attention.registry.make_registry, which must hold the default kind mha) instead of ATTENTION."""
        field = cls.model_fields["attention"]
        return create_model(
            cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__,
            attention_registry=(ClassVar[AttentionRegistry], registry),
            attention=(registry.attention_config,
                       Field(default_factory=registry.configs["mha"], description=field.description)),
        )
