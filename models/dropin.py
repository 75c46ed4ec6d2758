"""Efficient attention dropped into a trained model: which layers, which mechanism, and the mechanism itself.

HyperAttention's headline experiment (Han et al. 2023, Sec. 4.1, Table 1 and Figure 3; the authors'
benchmark_patch_llm.py) trains nothing: it replaces the attention of the last l layers of a pretrained causal
LM with HyperAttention and measures perplexity and speed as l grows. A mechanism can be dropped in like that
only if it holds no weights of its own: it must take the trained model's per-head q, k, v as they are.

- `hyper` (models/attention/hyper.py) qualifies as it is.
- `lsh` (models/attention/lsh.py) qualifies with two changes that Reformer's shared-QK projection made
  unnecessary: a token may attend to its own key (Reformer masks it because q.k of a token with itself
  dominates when k = q/|q|; with separate projections the own key is an ordinary key), and logits are the
  model's own q.k * scaling (the adapter hands the mechanism q pre-multiplied so that its 1/sqrt(d) gives the
  model's scaling). Buckets come from the keys, and a query rides with its own token's key, as in Reformer;
  with separate projections that routes query i to the keys whose direction is near k_i rather than near q_i,
  which is what dropping Reformer's mechanism into such a model means (docs/patching.md).
- Linformer (trained E and F), MHE and the other projection kinds (their own embeddings or projections) are
  refused: they need training first, which a spec with `optim.max_steps > 0` and the project's own model does.

`PatchConfig` is the spec's `patch:` block; `selected_layers` resolves its layer selector;
`build_dropin_mechanism` builds a layer's mechanism; `patch_project_model` swaps the mechanisms of one of the
project's own trained language models. models/hf_patching.py does the same for Hugging Face models.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from models.attention.exact import ExactMechanism, ExactMechanismConfig
from models.attention.hyper import HyperMechanism, HyperMechanismConfig
from models.attention.lsh import LSHMechanism, LSHMechanismConfig

DROPIN_KINDS = ("exact", "hyper", "lsh")
"""Mechanisms that hold no weights and so can replace a trained layer's attention as they are."""

_NEEDS_TRAINING = {
    "linformer": "its projections E and F of the sequence are trained weights",
    "mhe": "its head embeddings are trained weights that replace the model's projections",
    "sha": "it replaces the model's projections with one head's",
    "mqa": "it replaces the model's key and value projections",
    "gqa": "it replaces the model's key and value projections",
    "skv": "it replaces the model's key and value projections",
    "el_att": "it replaces the model's projections",
}

DropinMechanismConfig = Annotated[
    ExactMechanismConfig | HyperMechanismConfig | LSHMechanismConfig, Field(discriminator="kind")
]


class PatchConfig(BaseModel):
    """The `patch:` block: which layers of a trained causal LM get which weight-free mechanism."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: int | str = 0
    """Which layers: an int l patches the last l (the paper's l; 0 patches none); or "all", "none",
    "last:l", "first:l", "every:k" (layers 0, k, 2k, ...) or a comma list of layer indices "0,3,5"."""
    attention: DropinMechanismConfig = Field(default_factory=HyperMechanismConfig)
    """The mechanism and its knobs, e.g. {kind: hyper, block_size: 256, sample_size: 256, min_seq_len: 4096}
    or {kind: lsh, bucket_size: 64, n_hashes: 4}. Its `seed` is added to the run's seed (optim.seed), so
    `tune.seeds` draws the hashes afresh per seed."""

    @field_validator("attention", mode="before")
    @classmethod
    def _refuse_trained(cls, value: Any) -> Any:
        kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
        if kind in _NEEDS_TRAINING:
            raise ValueError(
                f"task.patch.attention.kind={kind} cannot be dropped into a trained model: "
                f"{_NEEDS_TRAINING[kind]}, which would start untrained. Drop-in kinds: {', '.join(DROPIN_KINDS)}. "
                f"To study {kind}, fine-tune: train the project's own model with model.attention.kind: {kind} "
                "(task.kind: clm), or pretrain it and fine-tune from it with model.init_from")
        return value

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, value: int | str) -> int | str:
        parse_layer_selector(value)  # raises with the accepted forms
        return value

    @model_validator(mode="after")
    def _check(self) -> PatchConfig:
        if getattr(self.attention, "causal_routing", "past_only") != "past_only":
            raise ValueError("task.patch.attention.causal_routing must be past_only: a causal LM scored with "
                             f"causal_routing=paper reads the future (models/attention/{self.attention.kind}.py)")
        return self


_SELECTOR_FORMS = ('an int l (the last l layers)', '"all"', '"none"', '"last:l"', '"first:l"', '"every:k"',
                   'a comma list of layer indices such as "0,3,5"')


def parse_layer_selector(value: int | str) -> tuple[str, Any]:
    """(form, argument) of a layer selector; ValueError naming the accepted forms."""
    bad = ValueError(f"task.patch.layers={value!r} is not a layer selector; use {', '.join(_SELECTOR_FORMS)}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        if value < 0:
            raise bad
        return "last", value
    text = value.strip().lower()
    if text in ("all", "none"):
        return text, None
    if ":" in text:
        form, _, number = text.partition(":")
        if form not in ("last", "first", "every") or not number.strip().isdigit():
            raise bad
        count = int(number)
        if form == "every" and count < 1:
            raise bad
        return form, count
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise bad
    return "list", tuple(sorted({int(p) for p in parts}))


def selected_layers(selector: int | str, n_layers: int) -> list[int]:
    """Indices of the layers `selector` names in a model of `n_layers`; ValueError when it names a layer the
    model does not have."""
    form, arg = parse_layer_selector(selector)
    if form in ("last", "first") and arg > n_layers:
        raise ValueError(f"task.patch.layers={selector!r} asks for {arg} layers but the model has {n_layers}; "
                         f"use at most {n_layers} (or \"all\")")
    if form == "list" and arg and arg[-1] >= n_layers:
        raise ValueError(f"task.patch.layers={selector!r} names layer {arg[-1]} but the model's layers are "
                         f"0..{n_layers - 1}")
    if form == "all":
        return list(range(n_layers))
    if form == "none":
        return []
    if form == "last":
        return list(range(n_layers - arg, n_layers))
    if form == "first":
        return list(range(arg))
    if form == "every":
        return list(range(0, n_layers, arg))
    return list(arg)


def build_dropin_mechanism(cfg: Any, head_dim: int, layer_index: int, seed_offset: int = 0) -> nn.Module:
    """Layer `layer_index`'s mechanism over a trained model's per-head q, k, v [B, H, T, head_dim]; the hash seed
    is cfg.seed + seed_offset (the run's seed), per layer as in the project's own models."""
    cfg = cfg.model_copy(update={"seed": cfg.seed + seed_offset}) if hasattr(cfg, "seed") else cfg
    if isinstance(cfg, HyperMechanismConfig):
        return HyperMechanism(cfg, head_dim, layer_index)
    if isinstance(cfg, LSHMechanismConfig):
        # The model's logits are q.k * scaling; the adapter folds scaling * sqrt(d) into q, so the mechanism
        # must apply 1/sqrt(d) to raw keys (not trax's unit-normalised keys with no scale).
        mechanism = LSHMechanism(cfg.model_copy(update={"logit_scale": "rsqrt_head_dim"}), head_dim, layer_index)
        mechanism.self_mask = False
        return mechanism
    if isinstance(cfg, ExactMechanismConfig):
        return ExactMechanism()
    raise ValueError(f"task.patch.attention.kind={getattr(cfg, 'kind', cfg)!r} cannot be dropped in; "
                     f"drop-in kinds: {', '.join(DROPIN_KINDS)}")


def patch_project_model(model: nn.Module, patch: PatchConfig, seed_offset: int = 0) -> list[int]:
    """Swap the mechanism of the selected self-attention layers of one of the project's trained language models
    (models/transformer.py LanguageModel) for `patch.attention`; the projections and every other weight stay.
    Returns the patched layer indices."""
    stack = getattr(model, "stack", None)
    layers = getattr(stack, "layers", None)
    if layers is None:
        raise ValueError(f"patching needs a decoder-only language model; got {type(model).__name__}")
    chosen = selected_layers(patch.layers, len(layers))
    for index in chosen:
        attention = layers[index].attn
        if not isinstance(attention.mechanism, ExactMechanism):
            raise ValueError(
                f"layer {index} of the pretrained model mixes with {type(attention.mechanism).__name__}, not exact "
                "attention; drop-in patching replaces exact attention (pretrain with a kind whose mechanism is exact)")
        mechanism = build_dropin_mechanism(patch.attention, attention.projection.head_dim, index, seed_offset)
        # A new module starts in training mode: it follows the model's (hyper samples afresh in training).
        attention.mechanism = mechanism.to(next(model.parameters()).device).train(model.training)
    return chosen
