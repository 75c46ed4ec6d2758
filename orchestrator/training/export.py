"""A trained model as plain files a user loads without Ray, MLflow or a checkpoint of this project's format.

An export folder holds `model.safetensors` (the weights; tied embeddings stored once), `model.json` (the
architecture, vocabulary size and resolved model config, from which the module is rebuilt) and, when the task
has one, `tokenizer.model` (sentencepiece). Runs log it to MLflow as the `model/` artifact folder:

    from orchestrator.training import load_model
    model = load_model("path/to/model")      # e.g. from `mlflow artifacts download -r RUN_ID -a model`
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
from torch import nn

from models import LanguageModel, ModelConfig, Seq2SeqTransformer, SequenceClassifier

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model.json"
TOKENIZER_FILE = "tokenizer.model"
ARCHITECTURES = {"mlm": "masked_lm", "clm": "causal_lm", "translation": "seq2seq", "classify": "classifier",
                 "listops": "classifier", "mqar": "masked_lm", "bytelm": "causal_lm"}
"""task.kind -> the exported architecture (an mqar run with task.causal: true passes causal_lm in `extra`)."""


def export_model(model: nn.Module, *, task_kind: str, model_cfg: ModelConfig, vocab_size: int, out_dir: Path,
                 tokenizer: Path | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write the export folder `out_dir` (created); returns it."""
    if task_kind not in ARCHITECTURES:
        raise ValueError(f"task.kind={task_kind!r} has no export architecture; known: {sorted(ARCHITECTURES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # save_model (not save_file): it stores tensors that share memory (tied input/output embeddings) once.
    safetensors.torch.save_model(model, str(out_dir / WEIGHTS_FILE))
    config = {"format": FORMAT_VERSION, "architecture": ARCHITECTURES[task_kind], "vocab_size": vocab_size,
              "model": model_cfg.model_dump(mode="json"), **(extra or {})}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None and Path(tokenizer).exists():
        shutil.copy(tokenizer, out_dir / TOKENIZER_FILE)
    return out_dir


def build_exported(config: dict[str, Any]) -> nn.Module:
    """An untrained module of the exported architecture."""
    cfg = ModelConfig.model_validate(config["model"])
    architecture = config["architecture"]
    if architecture == "seq2seq":
        return Seq2SeqTransformer(cfg, config["vocab_size"])
    if architecture in ("causal_lm", "masked_lm"):
        return LanguageModel(cfg, config["vocab_size"], causal=architecture == "causal_lm")
    if architecture == "classifier":  # the head's size and pooling come with the export (`extra`)
        return SequenceClassifier(cfg, config["vocab_size"], config["num_classes"], config["pooling"])
    raise ValueError(f"{CONFIG_FILE}: architecture={architecture!r} is not one of {sorted(ARCHITECTURES.values())}")


def load_model(path: Path | str) -> nn.Module:
    """The exported model in eval mode, weights loaded strictly (a missing or extra tensor is an error)."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} holds no {CONFIG_FILE}: not a folder written by orchestrator/training/export.py")
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT_VERSION:
        raise ValueError(f"{config_path}: format {config.get('format')!r}, this version reads {FORMAT_VERSION}")
    model = build_exported(config)
    safetensors.torch.load_model(model, str(path / WEIGHTS_FILE), strict=True)
    return model.eval()
