"""What a checkpoint holds, and how it is written and read back.

A checkpoint is one directory: `state.pt` (model, optimizer, LR scheduler, grad scaler, step, every
rank's data position, stream state and RNG states, the MLflow run id), `spec.yaml` (the resolved spec, so a model
can be rebuilt from the checkpoint alone; STYLE.md section 3) and `tokenizer.model` (the run's sentencepiece
model, which scoring and fine-tuning read instead of rebuilding it from the data). A sharded (FSDP) run's model
and optimizer tensors are in `sharded/` instead, one file per rank (torch.distributed.checkpoint), read back in
full by `read_checkpoint`, or by a resumed sharded run each rank its own shards (orchestrator/training/sharding.py).
The directory is filled under a temporary name and renamed into place, so a crash never leaves a half-written
checkpoint for Ray to upload.

A checkpoint holds data, never code: `state.pt` is tensors, numbers, strings and containers of them, and is read
with `torch.load(weights_only=True)`, PyTorch's restricted unpickler, so a `state.pt` planted in a shared bucket or
handed over by someone else is refused (`CheckpointError`, naming the file) instead of running what it carries.
Checkpoints written before numpy's RNG state was stored as plain numbers hold one numpy array; the three types
that rebuild an array from its bytes are allowed for them, nothing else.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orchestrator.storage.layout import checkpoint_name
from orchestrator.training.sharding import (
    SHARDS_DIR,
    ShardIndexError,
    ShardReadError,
    load_full_state,
    save_shards,
)

STATE_FILE = "state.pt"
SPEC_FILE = "spec.yaml"
TOKENIZER_FILE = "tokenizer.model"
"""The run's sentencepiece model, so a checkpoint is scored or fine-tuned from without the run's data cache."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as data: not a state this project writes, or one whose reading could run
    code."""


def _numpy_state_as_data(state: tuple) -> dict[str, Any]:
    """numpy's legacy RNG state, ("MT19937", uint32[624], pos, has_gauss, cached_gaussian), as plain values that
    the restricted unpickler reads (the keys as an int64 tensor: uint32 tensors have no arithmetic support)."""
    kind, keys, pos, has_gauss, cached_gaussian = state
    return {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}


def _numpy_state_of(saved: Any) -> tuple:
    """The state np.random.set_state takes, from a checkpoint of either form (plain values, or the tuple itself
    in checkpoints written before)."""
    if isinstance(saved, dict):
        keys = saved["keys"].numpy().astype(np.uint32)
        return saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]
    return tuple(saved)


def capture_rng() -> dict[str, Any]:
    """Every RNG a training step can draw from (dropout, masking, sampling), as plain data."""
    return {
        "python": random.getstate(),
        "numpy": _numpy_state_as_data(np.random.get_state()),
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
    np.random.set_state(_numpy_state_of(state["numpy"]))
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
    sharded: bool = False
    """Written by a sharded (FSDP) run: `model` is empty and `optimizer` holds the param groups in state.pt; the
    tensors are in the DCP folder `sharded/` (orchestrator/training/sharding.py). Read back, the state holds them
    in full, FQN-keyed."""


def write_checkpoint(parent: Path, state: TrainingState | None, spec_yaml: str, tokenizer: Path | None = None, *,
                     shards: dict[str, Any] | None = None, step: int | None = None) -> Path:
    """Write `state` as `parent/<checkpoint_name(step)>` atomically (temp dir + rename), with the run's tokenizer.

    A sharded run calls this on every rank (a collective): each passes its `shards` (Trainer.checkpoint_parts)
    and the step, rank 0 also the state; each rank's folder then holds its part, which Ray Train gathers into one
    checkpoint."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    step = state.step if state is not None else step
    if step is None:
        raise ValueError("write_checkpoint needs the state or, for a rank that writes shards only, the step")
    final = parent / checkpoint_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=parent))
    try:
        if shards is not None:
            save_shards(shards, tmp / SHARDS_DIR)
        if state is not None:
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


def _legacy_numpy_types() -> list[Any]:
    """What unpickles the numpy array of a checkpoint written before the RNG state was plain data: the array type,
    its dtype and numpy's array rebuilder, under the module names numpy 2 and numpy 1 pickled them with."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct,
            (reconstruct, "numpy.core.multiarray._reconstruct"), (reconstruct, "numpy._core.multiarray._reconstruct")]


def read_checkpoint(directory: Path, *, in_full: bool = True) -> TrainingState:
    """The state of a checkpoint directory (written by `write_checkpoint`), read as data only. A sharded one's
    tensors are read in full, unless `in_full` is False: a sharded run's ranks then read their own shards from the
    folder (`Trainer.restore(state, shards=...)`), and the state holds the optimizer's param groups only."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no {STATE_FILE}; it was not written by "
                                "orchestrator/training/checkpoint.py")
    try:
        with torch.serialization.safe_globals(_legacy_numpy_types()):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "Unsupported" in line or "global" in line),
                      str(err).splitlines()[0] if str(err) else type(err).__name__)
        raise CheckpointError(
            f"{path} is refused: it holds objects other than tensors, numbers, strings and their containers "
            f"({detail[:200]}), and reading them could run code. The checkpoints this project writes hold none; "
            "do not load this file unless you know who wrote it and why.") from None
    if not isinstance(data, dict) or not {"step", "model"} <= data.keys():
        raise CheckpointError(f"{path} is not a training state of this project (a dict with step, model, ...)")
    if unknown := sorted(data.keys() - TrainingState.__dataclass_fields__.keys()):
        raise CheckpointError(f"{path} holds fields no training state has: {unknown}")
    state = TrainingState(**data)
    if state.sharded and in_full:
        try:
            state.model, state.optimizer = load_full_state(Path(directory) / SHARDS_DIR,
                                                           state.optimizer.get("param_groups", []))
        except (ShardIndexError, ShardReadError) as err:
            raise CheckpointError(str(err)) from None
    return state
