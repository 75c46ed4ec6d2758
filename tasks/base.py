"""The interface between a task and the orchestrator's worker loop.

A task turns the `task:` and `model:` blocks of a spec into a model, a resumable stream of training
batches for this worker's shard, a loss and an evaluation. It knows nothing of Ray or MLflow: the
worker loop (orchestrator/launch/worker.py) drives it, and only plain numbers and files come back.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np
import torch
import torch.nn as nn


@dataclass(frozen=True)
class WorkerContext:
    """Runtime facts handed to a task; never part of the spec."""

    rank: int = 0
    world_size: int = 1
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cache_dir: Path = Path(".cache")
    """Shared, persistent folder for tokenizers and prepared data (keyed by content hash inside)."""
    tokenizer_path: Path | None = None
    """A sentencepiece model to use instead of training one: the pretraining run's, when fine-tuning from it
    (model.init_from), or the one stored in a checkpoint being scored. Read by the classification task."""


class EvaluationFiles:
    """The files a task rewrites at each evaluation (a classifier's predictions, a translator's hypotheses), in a
    temporary folder that goes with the task: the worker copies them into the run folder when training ends
    (orchestrator/launch/deliver.py, `store_task_files`) and when it scores a checkpoint, so nothing of it is
    needed once the task is gone. (A folder per task in the system's temp dir, never removed, was left behind by
    every run and test that evaluated such a task.)"""

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._folder: tempfile.TemporaryDirectory | None = None

    def write(self, name: str, text: str) -> Path:
        if self._folder is None:  # on the first evaluation: a task that never evaluates makes no folder
            self._folder = tempfile.TemporaryDirectory(prefix=self._prefix)
        path = Path(self._folder.name) / name
        path.write_text(text, encoding="utf-8")
        return path

    def get(self, name: str) -> Path | None:
        """The file as last written; None before the first evaluation."""
        if self._folder is None:
            return None
        return Path(self._folder.name) / name


def scored_positions(targets_BT: np.ndarray, ignore: int) -> torch.Tensor:
    """The positions of `targets_BT` that are scored (not `ignore`), int64 in the row-major [B * T]: what a model
    takes to compute only those positions' logits (models/transformer.py LanguageModel.forward). Found on the host
    with the batch, they go to the device with it; a boolean mask made on the device would have its count read
    back at every step."""
    return torch.from_numpy(np.flatnonzero(targets_BT.reshape(-1) != ignore))


def scored_targets(targets_BT: torch.Tensor, scored_N: torch.Tensor) -> torch.Tensor:
    """The targets at `scored_positions`, in their order: the labels of the model's [N, V] logits."""
    return targets_BT.flatten().index_select(0, scored_N)


@dataclass
class Batch:
    """Tensors of one step plus how many target tokens the loss averages over."""

    tensors: dict[str, torch.Tensor]
    n_tokens: int
    segment: tuple[int, int] | None = None
    """Transformer-XL training: the (epoch, index) of this segment, whose memory the loss reads. Host ints,
    like n_tokens: as a tensor on the device, reading it would sync the host every step."""

    def to(self, device: torch.device) -> "Batch":
        return replace(self, tensors={k: v.to(device, non_blocking=True) for k, v in self.tensors.items()})


class Task(Protocol):
    """What the worker loop needs; see tasks/lm.py and tasks/translation.py."""

    metrics: tuple[str, ...]
    """Names `evaluate` returns, e.g. ("val/loss", "val/ppl") or ("val/loss", "val/bleu", "val/chrf")."""

    def build_model(self) -> nn.Module:
        """A fresh model (seeded by the caller); has attention_parameters() and parameter_counts()."""

    def train_batches(self, position: dict[str, Any] | None = None) -> Iterator[tuple[Batch, dict[str, Any]]]:
        """Endless stream of this rank's batches. Each comes with the position *after* it, a small
        JSON-able dict that, passed back in, resumes the stream exactly at the next batch."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean loss over batch.n_tokens target tokens."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Full validation split, exact token-weighted; keys are `metrics`."""

    def artifacts(self) -> dict[str, Path]:
        """Files worth keeping with the run (tokenizer model, last evaluation outputs)."""
