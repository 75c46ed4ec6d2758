"""Typed configs for every attention kind.

One pydantic model per kind; models/attention/registry.py joins them in the discriminated union on
``kind`` (``AttentionConfig``): a misspelt kind fails with pydantic's "does not match any of the expected
tags" message, which lists every valid name. ``d_model`` and Linformer's ``max_seq_len`` are filled in by
the model config, so a spec writes them once.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- mechanisms: how per-head q, k, v are mixed --------------------------------------------------


class ExactMechanismConfig(_Config):
    kind: Literal["exact"] = "exact"


class LinformerMechanismConfig(_Config):
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


class LSHMechanismConfig(_Config):
    """Reformer LSH attention (Kitaev, Kaiser, Levskaya, 2020, arXiv 2001.04451).

    Not offered as a `mechanism:` on other projection schemes: hashing sorts queries and keys together, which
    is only meaningful with the shared-QK projection of kind `lsh`.
    """

    kind: Literal["lsh"] = "lsh"
    bucket_size: int = 64
    """Chunk length of the sorted sequence; each chunk attends to itself and the previous chunk."""
    n_hashes: int = 4
    """Hash rounds, combined through their log-sum-exp; more rounds approach full attention."""
    n_buckets: int | None = None
    """Buckets per round (even); default 2 * seq_len / bucket_size rounded to an even number >= 2."""
    seed: int = 0
    """Seed of the fixed rotations (evaluation, and training with rotations=fixed); each layer derives its own."""
    rotations: Literal["redraw", "fixed"] = "redraw"
    """redraw: new rotations every training forward (trax, Hugging Face), replayed in a reversible backward;
    fixed: one per layer from `seed` for the model's life. Evaluation always uses the fixed ones."""
    logit_scale: Literal["none", "rsqrt_head_dim"] = "none"
    """none: logits q.k/|k| (trax, Hugging Face); rsqrt_head_dim: q.k/|k|/sqrt(head_dim) (lucidrains)."""
    causal_routing: Literal["past_only", "paper"] = "past_only"
    """Under causal: past_only attends to the last bucket_size earlier keys of the query's own bucket (a
    function of the past only); paper sorts and chunks the whole sequence, which LEAKS THE FUTURE."""

    @model_validator(mode="after")
    def _check(self) -> "LSHMechanismConfig":
        if self.bucket_size < 1:
            raise ValueError(f"model.attention.bucket_size must be >= 1 (got {self.bucket_size}); "
                             "typical values are 32 or 64")
        if self.n_hashes < 1:
            raise ValueError(f"model.attention.n_hashes must be >= 1 (got {self.n_hashes}); the paper uses 1-8")
        if self.n_buckets is not None and (self.n_buckets < 2 or self.n_buckets % 2):
            raise ValueError(f"model.attention.n_buckets must be an even number >= 2 (got {self.n_buckets}): "
                             "angular LSH takes the argmax over [xR; -xR]; leave it unset for "
                             "2 * seq_len / bucket_size")
        return self


MAX_LSH_BITS = 30
"""Hash codes are int64 sort keys multiplied by the sequence length, so 2^30 buckets is a safe ceiling."""


class HyperMechanismConfig(_Config):
    """HyperAttention (Han, Jayaram, Karbasi, Mirrokni, Woodruff, Zandieh, 2023, arXiv 2310.05869)."""

    kind: Literal["hyper"] = "hyper"
    block_size: int = 256
    """Size of the exact diagonal blocks in sortLSH order (the paper's b); inputs are padded internally."""
    sample_size: int = 256
    """Uniformly sampled keys per (batch, head) for the residual part (the paper's m); 0 = blocks only."""
    min_seq_len: int = 4096
    """Shorter inputs run exact attention; also the base case of the causal recursion."""
    lsh_bits: int = 7
    """SimHash hyperplanes r (2^r buckets ordered along a Gray code); the official code uses 7."""
    seed: int = 0
    """Seed of the hyperplanes; each layer derives its own from it, fixed for the model's life."""
    causal_routing: Literal["past_only", "paper"] = "past_only"
    """Under causal: past_only places each query in the key order by its own hash (a function of the past
    only); paper sorts the queries of a block together, which LEAKS THE FUTURE."""

    @model_validator(mode="after")
    def _check(self) -> "HyperMechanismConfig":
        if self.block_size < 1:
            raise ValueError(f"model.attention.block_size must be >= 1 (got {self.block_size}); the paper uses 256")
        if self.sample_size < 0:
            raise ValueError(f"model.attention.sample_size must be >= 0 (got {self.sample_size}); "
                             "0 keeps only the diagonal blocks, the paper uses 256")
        if self.min_seq_len < 2:
            raise ValueError(f"model.attention.min_seq_len must be >= 2 (got {self.min_seq_len}); the causal "
                             "recursion halves the sequence until it is at most min_seq_len long")
        if not 1 <= self.lsh_bits <= MAX_LSH_BITS:
            raise ValueError(f"model.attention.lsh_bits must be in [1, {MAX_LSH_BITS}] (got {self.lsh_bits}); "
                             "it is the number of hash hyperplanes (2^lsh_bits buckets), the official code uses 7")
        return self


MechanismConfig = Annotated[
    Union[ExactMechanismConfig, LinformerMechanismConfig, HyperMechanismConfig], Field(discriminator="kind")
]
"""What a projection kind's `mechanism:` block may name (not lsh: see LSHMechanismConfig). Each of these
configs is built into its mechanism by the registry's MECHANISMS table (models/attention/registry.py)."""


# --- attention kinds: a projection scheme (and optionally a mechanism) ----------------------------


class _AttentionConfig(_Config):
    heads: int = 8
    """Number of attention heads n; head dim d = d_model / heads for every kind (also sha and mhe)."""
    d_model: int | None = None
    """Model width; filled in from model.d_model."""
    dropout: float = 0.0
    """Dropout on attention probabilities."""

    @model_validator(mode="after")
    def _check_heads(self) -> "_AttentionConfig":
        if self.heads < 1:
            raise ValueError(f"model.attention.heads must be >= 1 (got {self.heads})")
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


class _ProjectionKindConfig(_AttentionConfig):
    mechanism: MechanismConfig = Field(default_factory=ExactMechanismConfig)
    """How heads mix tokens: exact softmax attention, or e.g. {kind: linformer, k: 64} to cross schemes."""


class MHAConfig(_ProjectionKindConfig):
    """Multi-head attention (Vaswani et al., 2017)."""

    kind: Literal["mha"] = "mha"


class SHAConfig(_ProjectionKindConfig):
    """Single-head attention: one head of dim d_model / heads, as the MHE paper's lower bound."""

    kind: Literal["sha"] = "sha"


class MQAConfig(_ProjectionKindConfig):
    """Multi-query attention (Shazeer, 2019): one K and one V head shared by every query head."""

    kind: Literal["mqa"] = "mqa"


class GQAConfig(_ProjectionKindConfig):
    """Grouped-query attention (Ainslie et al., 2023): `groups` K/V heads, each serving heads/groups queries."""

    kind: Literal["gqa"] = "gqa"
    groups: int = 2
    """Number of K/V heads; must divide heads (groups = heads is mha, groups = 1 is mqa)."""

    @model_validator(mode="after")
    def _check_groups(self) -> "GQAConfig":
        if self.groups < 1 or self.heads % self.groups:
            raise ValueError(
                f"model.attention.groups={self.groups} must be >= 1 and divide model.attention.heads={self.heads}"
            )
        return self


class SKVConfig(_ProjectionKindConfig):
    """Shared key-value projection (W^K = W^V), as the MHE paper describes its SKV baseline."""

    kind: Literal["skv"] = "skv"


class ELAttConfig(_ProjectionKindConfig):
    """EL-attention (Yan et al., 2021): no K/V projections; the heads of the input act as keys and values."""

    kind: Literal["el_att"] = "el_att"


class MHEConfig(_ProjectionKindConfig):
    """Multi-head embeddings (Xue & Aletras, 2023, arXiv 2310.07911)."""

    kind: Literal["mhe"] = "mhe"
    mode: Literal["add", "mul"] = "mul"
    """add: A + e_i; mul: A * (1 + e_i)."""
    init_std: float = 0.02
    """Std of the near-zero normal init of the head embeddings (the paper leaves it open)."""


class LinformerConfig(LinformerMechanismConfig, _AttentionConfig):
    """`mha` projections with the Linformer mechanism; the knobs sit at the top level of the block."""

    kind: Literal["linformer"] = "linformer"  # type: ignore[assignment]

    @property
    def mechanism(self) -> LinformerMechanismConfig:
        fields = LinformerMechanismConfig.model_fields.keys() - {"kind"}
        return LinformerMechanismConfig(**{f: getattr(self, f) for f in fields})


class LSHConfig(LSHMechanismConfig, _AttentionConfig):
    """Reformer: shared-QK projections (keys unit-normalised) with LSH attention; knobs at the top level."""

    kind: Literal["lsh"] = "lsh"  # type: ignore[assignment]

    @property
    def mechanism(self) -> LSHMechanismConfig:
        fields = LSHMechanismConfig.model_fields.keys() - {"kind"}
        return LSHMechanismConfig(**{f: getattr(self, f) for f in fields})


class HyperConfig(HyperMechanismConfig, _AttentionConfig):
    """`mha` projections with the HyperAttention mechanism; the knobs sit at the top level of the block."""

    kind: Literal["hyper"] = "hyper"  # type: ignore[assignment]

    @property
    def mechanism(self) -> HyperMechanismConfig:
        fields = HyperMechanismConfig.model_fields.keys() - {"kind"}
        return HyperMechanismConfig(**{f: getattr(self, f) for f in fields})
