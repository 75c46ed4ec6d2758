"""Reading an export folder (`orchestrator export`, orchestrator/training/export.py): the model rebuilt from
`model.json` and its weights loaded from `model.safetensors`, with no code from the folder run.

It lives in models/ because a task reads exports too (task.kind: pretrained_lm scores and patches one), and
tasks import models, never orchestrator.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors.torch
from torch import nn

from models.classifier import SequenceClassifier
from models.config import ModelConfig
from models.transformer import LanguageModel, Seq2SeqTransformer

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model.json"
TOKENIZER_FILE = "tokenizer.model"
ARCHITECTURES = {"mlm": "masked_lm", "clm": "causal_lm", "translation": "seq2seq", "classify": "classifier",
                 "listops": "classifier", "mqar": "masked_lm", "bytelm": "causal_lm"}
"""task.kind -> the exported architecture (an mqar run with task.causal: true passes causal_lm in `extra`)."""


def read_export_config(path: Path | str) -> dict[str, Any]:
    """The `model.json` of an export folder, its format checked."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} holds no {CONFIG_FILE}: not a folder written by orchestrator/training/export.py")
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT_VERSION:
        raise ValueError(f"{config_path}: format {config.get('format')!r}, this version reads {FORMAT_VERSION}")
    return config


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
    model = build_exported(read_export_config(path))
    safetensors.torch.load_model(model, str(path / WEIGHTS_FILE), strict=True)
    return model.eval()
