"""What a checkpoint holds, and how it is written and read back.

A checkpoint is one directory: `state.pt` (model, optimizer, LR scheduler, grad scaler, step, every
rank's data position, stream state and RNG states, the MLflow run id), `spec.yaml` (the resolved spec, so a model
can be rebuilt from the checkpoint alone; STYLE.md section 3) and `tokenizer.model` (the run's sentencepiece
model, which scoring and fine-tuning read instead of rebuilding it from the data). The directory is filled under a temporary
name and renamed into place, so a crash never leaves a half-written checkpoint for Ray to upload.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orchestrator.storage.layout import checkpoint_name

STATE_FILE = "state.pt"
SPEC_FILE = "spec.yaml"
TOKENIZER_FILE = "tokenizer.model"
"""The run's sentencepiece model, so a checkpoint is scored or fine-tuned from without the run's data cache."""


def capture_rng() -> dict[str, Any]:
    """Every RNG a training step can draw from (dropout, masking, sampling)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        # The current device's generator only: a Ray Train worker draws from the one GPU it was given, and a run
        # resumed after a node loss may be placed where a worker sees another number of GPUs (per-device lists
        # from get_rng_state_all would then not fit).
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def cuda_rng_of_rank(saved: Any) -> torch.Tensor | None:
    """The CUDA generator state this rank restores: the saved state, or from a checkpoint written before states
    were per device, the first of its list (the device a Ray worker used); None when the run had no GPU."""
    if isinstance(saved, (list, tuple)):
        return saved[0] if saved else None
    return saved


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = cuda_rng_of_rank(state.get("cuda"))
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


@dataclass
class TrainingState:
    """Everything that resumes a run exactly where it stopped."""

    step: int
    """Optimizer steps completed."""
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any]
    data_positions: list[dict[str, Any] | None]
    """Per rank: the position after the last consumed batch (the task's resumable stream)."""
    rng: list[dict[str, Any]]
    """Per rank: RNG states, so dropout and masking continue as in an uninterrupted run."""
    mlflow_run_id: str | None
    stream_states: list[Any] = field(default_factory=list)
    """Per rank: what the task carries from batch to batch besides the position (a causal LM's Transformer-XL
    memory, tasks/recurrence.py), or None; empty in checkpoints written before it was kept."""
    spec: dict[str, Any] = field(default_factory=dict)
    best: dict[str, Any] = field(default_factory=dict)
    """The compared metric's best value so far and its step ({metric, value, step}); empty before the first
    evaluation (and in checkpoints written before it was kept)."""


def write_checkpoint(parent: Path, state: TrainingState, spec_yaml: str, tokenizer: Path | None = None) -> Path:
    """Write `state` as `parent/<checkpoint_name(step)>` atomically (temp dir + rename), with the run's tokenizer."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / checkpoint_name(state.step)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=parent))
    try:
        torch.save(state.__dict__, tmp / STATE_FILE)
        (tmp / SPEC_FILE).write_text(spec_yaml)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_checkpoint(directory: Path) -> TrainingState:
    """The state of a checkpoint directory (written by `write_checkpoint`)."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no {STATE_FILE}; it was not written by orchestrator/training/checkpoint.py")
    # weights_only=False: our own files carry numpy/python RNG tuples, which the safe loader rejects.
    data = torch.load(path, map_location="cpu", weights_only=False)
    return TrainingState(**data)
