"""The `task:` block of task.kind: pretrained_lm (tasks/pretrained_lm.py), beside tasks/config.py's other kinds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from models.dropin import PatchConfig, selected_layers
from tasks.data_files import DataFiles, _Config, check_eval_split


class PretrainedLMTaskConfig(_Config):
    """A pretrained causal LM, some of its layers' attention replaced by a weight-free efficient mechanism, scored
    on long documents (HyperAttention's patching experiment, Han et al. 2023, Sec. 4.1; tasks/pretrained_lm.py).
    With optim.max_steps: 0 it trains nothing; with steps it fine-tunes the patched model on task.files.train."""

    kind: Literal["pretrained_lm"] = "pretrained_lm"
    pretrained: str
    """The model: a Hugging Face hub id ("microsoft/phi-1_5", downloaded where the network allows), a local
    Hugging Face folder (config.json + weights), or an export folder of one of this project's causal LM runs
    (`orchestrator export`: model.json + model.safetensors)."""
    patch: PatchConfig = Field(default_factory=PatchConfig)
    """Which layers get which mechanism (models/dropin.py); layers: 0 scores the unpatched model."""
    files: DataFiles
    """Local text files {train, validation, test}: the evaluation split is cut into documents; train is read only
    for fine-tuning (optim.max_steps > 0)."""
    seq_len: int = 4096
    """Tokens per document (the paper's n): the split's token stream is cut into consecutive windows of seq_len."""
    documents: int | None = None
    """Score the first N documents of the split; None scores every whole window (the remainder is dropped)."""
    batch_size: int = 1
    """Documents per forward pass (the paper: 1); also the fine-tuning batch."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The weights' dtype as loaded (the paper: bf16 on GPUs)."""
    time_unpatched: bool = True
    """Also run the unpatched model over the same documents in the same process, for the speed-up."""
    eval_split: Literal["validation", "test"] = "validation"
    """Split that `evaluate` scores."""
    eval_batches: int | None = None
    """Score only the first N batches of documents (fast checks); None scores task.documents."""
    trust_remote_code: bool = False
    """Never on by default: a hub model's own Python would run on every worker (models needing it are refused)."""

    metrics: ClassVar[tuple[str, ...]] = (
        "val/loss", "val/ppl", "val/ppl_unpatched", "val/patched_layers", "val/forward_s", "val/forward_s_unpatched",
        "val/speedup", "val/attention_s", "val/attention_s_unpatched", "val/attention_speedup")
    default_metric: ClassVar[str] = "val/ppl"
    default_mode: ClassVar[Literal["min", "max"]] = "min"

    @field_validator("pretrained")
    @classmethod
    def _local_or_hub(cls, value: str) -> str:
        """An existing folder becomes absolute (workers may run elsewhere); a value shaped like a path (leading
        /, . or ~, or more than one /) must be a folder; anything else is a hub id ("gpt2", "org/name")."""
        path = Path(value).expanduser()
        if path.is_dir():
            if not any((path / name).is_file() for name in ("config.json", "model.json")):
                raise ValueError(f"task.pretrained={value} is a folder without config.json (a Hugging Face model) "
                                 "or model.json (an export of this project); point it at the folder that holds "
                                 "the model's files")
            return str(path.resolve())
        if value.startswith(("/", ".", "~")) or value.count("/") > 1:
            raise ValueError(f"task.pretrained={value} is not a folder (relative paths are resolved against the "
                             "directory the command runs in); give a local Hugging Face folder (config.json and "
                             "weights), an export folder of this project (model.json), or a hub id such as "
                             "microsoft/phi-1_5")
        return value

    @model_validator(mode="after")
    def _check_pretrained(self) -> "PretrainedLMTaskConfig":
        if not self.pretrained.strip():
            raise ValueError("task.pretrained is empty; give a hub id, a local Hugging Face folder or an export "
                             "folder of this project")
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) < (2 if name == "seq_len" else 1):
                raise ValueError(f"task.{name}={getattr(self, name)} is too small")
        if self.documents is not None and self.documents < 1:
            raise ValueError(f"task.documents={self.documents} must be >= 1, or leave it unset (every document)")
        check_eval_split(self.files, self.eval_split, self.eval_batches)
        context = trained_context(self.pretrained)
        if context is not None and self.seq_len > context[0]:
            # Caught here, before Ray: an export's positions stop at its max_seq_len (the worker raised, naming a
            # model.max_seq_len this kind does not take), and past a Hugging Face model's positions learned
            # embeddings fail on an index and rotary ones extrapolate silently, off the trained context.
            raise ValueError(f"task.seq_len={self.seq_len} is longer than task.pretrained={self.pretrained} "
                             f"takes ({context[1]}={context[0]}); lower task.seq_len to at most {context[0]}, or "
                             "use a model trained on longer sequences")
        return self

    @property
    def source_label(self) -> str:
        return f"pretrained:{self.pretrained}"


_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
"""config.json fields that bound a Hugging Face model's positions, first found wins (Llama, GPT-2, ...)."""


_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
"""config.json fields of a Hugging Face model's depth, first found wins (Llama, ...; GPT-2, GPT-J; others)."""


def _local_config(pretrained: str) -> tuple[str, dict] | None:
    """(how its fields are named, its settings) of a local model folder, an export's model.json `model` block or a Hugging Face
    config.json, or of a hub id's config.json in this machine's Hugging Face cache (what a worker loads where the
    cache is shared, or the same revision downloaded); None where there is none, or it cannot be read (the loader
    reports that on the worker)."""
    folder = Path(pretrained).expanduser()
    try:
        if not folder.is_dir():
            return _cached_hub_config(pretrained)
        if (folder / "model.json").is_file():
            model = json.loads((folder / "model.json").read_text())["model"]
            return ("model.json's model.", model) if isinstance(model, dict) else None
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ("config.json's ", config) if isinstance(config, dict) else None


_CACHED = "the cached config.json's "
"""How `_local_config` names the fields of a hub model's config.json read from the Hugging Face cache."""


def _cached_hub_config(repo_id: str) -> tuple[str, dict] | None:
    """A hub model's config.json from the Hugging Face cache, never downloaded (validation makes no request)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    from tasks.text_sources import hub_cache

    try:
        path = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache())
    except HFValidationError:  # not a repo id at all: a folder that does not exist, which validate names
        return None
    if not isinstance(path, str):
        return None
    config = json.loads(Path(path).read_text())
    return (_CACHED, config) if isinstance(config, dict) else None


def _first_count(pretrained: str, fields: tuple[str, ...]) -> tuple[int, str] | None:
    """(value, where it is said) of the first of `fields` a local model's settings hold as a positive int."""
    if (found := _local_config(pretrained)) is None:
        return None
    where, settings = found
    return next(((settings[f], f"{where}{f}") for f in fields
                 if isinstance(settings.get(f), int) and not isinstance(settings[f], bool) and settings[f] > 0), None)


def trained_context(pretrained: str) -> tuple[int, str] | None:
    """(longest sequence, the field that says so) of a local model folder or a cached hub model: an export's
    model.max_seq_len or a Hugging Face config.json's positions; None where that is not known before Ray."""
    return _first_count(pretrained, _POSITION_FIELDS)


_DROPOUT_FIELDS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")
"""config.json fields of a Hugging Face model's attention dropout (GPT-2 and GPT-J; Llama, Phi, OPT, ...; BERT)."""


def check_patch(cfg: PretrainedLMTaskConfig, max_steps: int) -> None:
    """The patch against what the run feeds it, before Ray: the mechanism's length bounds, and no attention dropout
    in a local model that fine-tuning (optim.max_steps > 0) would run through the drop-in mechanisms."""
    if cfg.patch.layers in (0, "none"):
        return
    cfg.patch.attention.check_length(cfg.seq_len, "task.seq_len", "task.patch.attention")
    if (depth := _first_count(cfg.pretrained, _LAYER_FIELDS + ("layers",))) is not None:
        selected_layers(cfg.patch.layers, depth[0])  # a layer the model lacks, named before Ray (was: the worker)
    found = _local_config(cfg.pretrained) if max_steps > 0 else None
    if found is None or found[0].startswith("model.json"):  # scoring only, or this project's export
        return
    cached, config = found[0] == _CACHED, found[1]
    fix = ("download it to a folder (`hf download <id> --local-dir <folder>`), set {field} to 0 in its config.json "
           "and point task.pretrained at the folder" if cached else "set {field} to 0 in (a copy of) that config.json")
    for field in _DROPOUT_FIELDS:
        # The adapter refuses dropout in training (the mechanisms merge their parts through log-sum-exps), which
        # GPT-2's default attn_pdrop=0.1 met only on the worker, after the cluster started.
        if isinstance(config.get(field), (int, float)) and config[field] > 0:
            raise ValueError(f"optim.max_steps={max_steps} fine-tunes the patched layers of task.pretrained="
                             f"{cfg.pretrained}, whose config.json has {field}={config[field]}: the drop-in "
                             f"mechanisms take no attention dropout; {fix.format(field=field)}, or score without "
                             "training (optim.max_steps: 0)")


def pretrained_model_problem(cfg: PretrainedLMTaskConfig) -> str | None:
    """Why a hub id in `task.pretrained` cannot be loaded, found without downloading it (the launcher asks before
    Ray starts; a worker would find out after the cluster started); None for a folder, a model in the hub's
    cache, or one the hub knows."""
    from huggingface_hub import try_to_load_from_cache

    from tasks.text_sources import _hub_endpoint, hub_cache, hub_reachable, hub_repo_problem

    source = cfg.pretrained
    if Path(source).expanduser().is_dir() or isinstance(
            try_to_load_from_cache(source, "config.json", cache_dir=hub_cache()), str):
        return None
    advice = ("download it where the hub is reachable and point task.pretrained at the folder "
              "(`hf download <id> --local-dir <folder>`), or use an export folder of this project")
    if not hub_reachable():
        return (f"task.pretrained={source!r} is not in the Hugging Face cache on this machine and the hub "
                f"({_hub_endpoint()}) cannot be reached from it; {advice}")
    return hub_repo_problem("task.pretrained", source, "model", advice)
