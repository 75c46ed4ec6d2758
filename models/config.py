"""ModelConfig: the `model:` block of a spec. Cross-field checks live here and name the field to fix."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.attention.config import AttentionConfig, LinformerConfig, MHAConfig, _ProjectionKindConfig


class StandardEmbeddingConfig(BaseModel):
    """A d_model lookup table (tied with the output layer unless model.tie_output is false)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["standard"] = "standard"


EmbeddingConfig = Annotated[Union[StandardEmbeddingConfig], Field(discriminator="kind")]


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

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
    positional: Literal["learned", "sinusoidal"] = "learned"
    """Absolute position embeddings: a learned table or fixed sinusoids (Vaswani et al., 2017)."""
    attention: AttentionConfig = Field(default_factory=MHAConfig)
    """The attention block: {kind: mha | sha | mqa | gqa | skv | el_att | mhe | linformer, heads, knobs...}."""
    embedding: EmbeddingConfig = Field(default_factory=StandardEmbeddingConfig)
    """Token embedding: {kind: standard}."""
    tie_output: bool = True
    """Share the token embedding with the output projection (MLM, causal LM and translation heads)."""
    reversible: bool = False
    """Run encoder / decoder-only stacks as reversible RevNet blocks (Reformer): activation memory flat in depth."""

    @model_validator(mode="before")
    @classmethod
    def _fill_attention(cls, data):
        """Give the attention block the model's d_model and (for Linformer) its max_seq_len."""
        if not isinstance(data, dict):
            return data
        attention = data.get("attention", {"kind": "mha"})
        if isinstance(attention, BaseModel):
            attention = attention.model_dump()
        attention = dict(attention)
        d_model = data.get("d_model", cls.model_fields["d_model"].default)
        max_len = data.get("max_seq_len", cls.model_fields["max_seq_len"].default)
        attention.setdefault("d_model", d_model)
        if attention.get("d_model") != d_model:
            raise ValueError(f"model.attention.d_model={attention['d_model']} differs from model.d_model={d_model}; "
                             "leave model.attention.d_model unset")
        if attention.get("kind") == "linformer":
            attention.setdefault("max_seq_len", max_len)
        mech = attention.get("mechanism")
        if isinstance(mech, BaseModel):
            mech = mech.model_dump()
        if isinstance(mech, dict) and mech.get("kind") == "linformer":
            attention["mechanism"] = {**mech, "max_seq_len": mech.get("max_seq_len") or max_len}
        return {**data, "attention": attention}

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        for name in ("d_model", "layers", "ffn", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1 (got {getattr(self, name)})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1) (got {self.dropout})")
        linformer = self.linformer_config
        if linformer is not None:
            if linformer.max_seq_len > self.max_seq_len:
                raise ValueError(f"model.attention.max_seq_len={linformer.max_seq_len} exceeds model.max_seq_len="
                                 f"{self.max_seq_len}; positions beyond model.max_seq_len cannot occur")
            if isinstance(linformer.k, list) and len(linformer.k) != max(self.layers, self.decoder_layers or 0):
                raise ValueError(f"model.attention.k lists {len(linformer.k)} values for {self.layers} layers; "
                                 "give exactly one k per layer")
        return self

    @property
    def linformer_config(self):
        if isinstance(self.attention, LinformerConfig):
            return self.attention.mechanism
        if isinstance(self.attention, _ProjectionKindConfig) and self.attention.mechanism.kind == "linformer":
            return self.attention.mechanism
        return None
