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

from models import ModelConfig
from models.exported import (  # noqa: F401 - the reader's names, offered here beside the writer
    ARCHITECTURES,
    CONFIG_FILE,
    FORMAT_VERSION,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    build_exported,
    load_model,
)


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
