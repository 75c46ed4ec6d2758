"""Fine-tuning from a pretraining run: find the checkpoint `model.init_from` names, check that it fits the spec
before any Ray time, and load its encoder (and tokenizer) on the worker.

`model.init_from` may name
- a checkpoint folder (holds state.pt) or a run's storage folder (its checkpoint_* folders), a path or a URI;
- a run in run.storage_path (`orchestrator train` wrote `<storage>/<name>/orchestrator.json`);
- an MLflow run id (32 hex digits) of a run or trial: its `orchestrator.checkpoints` tag says where it stored.
A run folder gives its best checkpoint by the pretraining run's own metric (as Ray's CheckpointConfig ranked
them), else its latest. Only the checkpoint's spec.yaml and tokenizer are read here; the weights are read by
the worker that needs them.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs
import yaml
from pydantic import ValidationError
from torch import nn

from models.classifier import load_encoder
from orchestrator.cluster.ray_env import stored_result
from orchestrator.launch.evaluate import choose_checkpoint
from orchestrator.spec import ExperimentSpec, SpecError
from orchestrator.spec.loading import bounded_yaml
from orchestrator.storage.layout import checkpoint_order, checkpoint_steps
from orchestrator.storage.locations import is_remote, join, storage_fs
from orchestrator.storage.locations import resolve as resolve_location
from orchestrator.tracking.describe import CHECKPOINTS_TAG
from orchestrator.tracking.read import TrackingReader
from orchestrator.training.checkpoint import (
    SPEC_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    read_checkpoint,
)

LINEAGE_TAGS = ("init_from.run_id", "init_from.checkpoint", "init_from.step")
"""Tags of a fine-tuning run naming what it started from: the pretraining MLflow run, its checkpoint's folder name
(`checkpoint_000000024`: where that run stored it is its own `orchestrator.checkpoints` tag, so no machine's path
is copied here) and step."""
# Model fields that may differ between pretraining and fine-tuning: no parameter depends on them.
_FREE_MODEL_FIELDS = ("dropout", "init_from", "freeze")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class PretrainedCheckpoint:
    location: str
    """The checkpoint folder: a local path or a URI."""
    spec: ExperimentSpec
    """The pretraining run's resolved spec (from the checkpoint)."""
    vocab_size: int
    """Pieces of the pretraining tokenizer."""


def _kind(location: str) -> pyarrow.fs.FileType:
    fs, path = storage_fs(location)
    return fs.get_file_info(path).type


def _run_folder_of(value: str, spec: ExperimentSpec) -> str:
    """The storage location `model.init_from` names (a checkpoint or a run folder), or a SpecError."""
    if is_remote(value) or Path(value).expanduser().exists():
        return resolve_location(value)
    storage = spec.run.storage_path
    named = join(storage, value)
    if _kind(named) == pyarrow.fs.FileType.Directory:
        return named
    if _RUN_ID.match(value):
        location = _checkpoints_tag(value, spec)
        if location is not None:
            return location
    raise SpecError(f"model.init_from={value!r} names no checkpoint folder, no run in run.storage_path={storage} "
                    f"and no MLflow run (with an {CHECKPOINTS_TAG} tag) in {spec.tracking.uri}; give the "
                    "pretraining run's name (as `orchestrator train` named it), its MLflow run id, or the path of "
                    "its run or checkpoint folder")


def _checkpoints_tag(run_id: str, spec: ExperimentSpec) -> str | None:
    try:
        reader = TrackingReader(spec.tracking.uri, timeout_s=spec.tracking.timeout_s)
        return reader.run(run_id).data.tags.get(CHECKPOINTS_TAG)
    except Exception:  # noqa: BLE001 - no such run, or the store does not answer: the caller says what to give
        return None


def _best_checkpoint(run_folder: str, value: str) -> tuple[str, ExperimentSpec] | None:
    """A run folder's best checkpoint by its own metric (Ray's ranking), else its newest, with the run's spec
    (every checkpoint of a run holds the same); None without any checkpoint."""
    steps = checkpoint_steps(run_folder)
    if not steps:
        return None
    newest = join(run_folder, max(steps, key=checkpoint_order))
    spec = _read_spec(newest, value)
    try:

        chosen = choose_checkpoint(stored_result(run_folder), spec, "best", split=None)
    except Exception:  # noqa: BLE001 - no Ray run state (a copied folder): fall back to the newest checkpoint
        chosen = None
    return (join(run_folder, Path(chosen.path).name) if chosen is not None else newest), spec


def _read_spec(location: str, value: str) -> ExperimentSpec:
    """The resolved spec a checkpoint folder holds (SpecError when it holds none)."""
    fs, path = storage_fs(location)
    try:
        with fs.open_input_stream(join(path, SPEC_FILE)) as f:
            return ExperimentSpec.model_validate(bounded_yaml(f.read().decode()))
    except (OSError, ValidationError, yaml.YAMLError, UnicodeDecodeError) as err:
        raise SpecError(f"model.init_from={value!r}: {location} has no readable {SPEC_FILE} ({type(err).__name__}); "
                        "it was not written by this orchestrator") from None


def resolve(spec: ExperimentSpec) -> PretrainedCheckpoint:
    """The checkpoint `spec.model.init_from` names, read far enough to check it (SpecError otherwise)."""
    value = spec.model.init_from
    assert value is not None, "resolve() is for specs with model.init_from"
    location = _run_folder_of(value, spec)
    if _kind(join(location, STATE_FILE)) == pyarrow.fs.FileType.File:
        pre_spec = _read_spec(location, value)
    else:
        found = _best_checkpoint(location, value)
        if found is None:
            raise SpecError(f"model.init_from={value!r}: {location} holds no checkpoint yet (no checkpoint_* "
                            "folder and no state.pt); wait for the pretraining run's first checkpoint, or name "
                            "another run")
        location, pre_spec = found
    with tokenizer_file(location) as tokenizer:
        import sentencepiece as spm

        vocab_size = spm.SentencePieceProcessor(model_file=str(tokenizer)).get_piece_size()
    return PretrainedCheckpoint(location=location, spec=pre_spec, vocab_size=vocab_size)


@contextmanager
def tokenizer_file(location: str) -> Iterator[Path]:
    """The checkpoint's sentencepiece model as a local file (downloaded when the checkpoint is remote)."""
    fs, path = storage_fs(location)
    source = join(path, TOKENIZER_FILE)
    if fs.get_file_info(source).type != pyarrow.fs.FileType.File:
        raise SpecError(f"model.init_from: checkpoint {location} holds no {TOKENIZER_FILE} (it was written before "
                        "checkpoints kept their tokenizer); re-run the pretraining, or resume it for one more "
                        "checkpoint (orchestrator resume NAME with a larger optim.max_steps)")
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        yield Path(source)
        return
    with tempfile.TemporaryDirectory(prefix="init-from-") as tmp:
        local = Path(tmp) / TOKENIZER_FILE
        with fs.open_input_stream(source) as f:
            local.write_bytes(f.read())
        yield local


def check_compatible(spec: ExperimentSpec, pretrained: PretrainedCheckpoint) -> None:
    """The fine-tuning spec can take the pretrained encoder: a masked-LM run, the same architecture (every model
    field but dropout), and no vocabulary size asked for that the pretraining tokenizer does not have."""
    value, pre = spec.model.init_from, pretrained.spec
    if pre.task.kind != "mlm":
        raise SpecError(f"model.init_from={value!r} is a {pre.task.kind} run; fine-tuning for classification takes "
                        "the bidirectional encoder of a masked-LM run (task.kind: mlm)")
    mine, theirs = _architecture(spec), _architecture(pre)
    if mine["d_model"] != theirs["d_model"]:  # before the attention block, which carries d_model hidden (_short)
        raise SpecError(f"model.d_model is {mine['d_model']!r} here but {theirs['d_model']!r} in the pretraining run "
                        f"{value!r}; the encoder's weights fit only the same architecture: set "
                        f"model.d_model={theirs['d_model']!r}")
    if mine["attention"] != theirs["attention"]:
        raise SpecError(f"model.attention is {_short(mine['attention'])} here but {_short(theirs['attention'])} in the "
                        f"pretraining run {value!r}; fine-tune with the pretraining run's attention block")
    for field in sorted(set(mine) | set(theirs)):
        if mine.get(field) != theirs.get(field):
            raise SpecError(f"model.{field} is {mine.get(field)!r} here but {theirs.get(field)!r} in the pretraining "
                            f"run {value!r}; the encoder's weights fit only the same architecture: set "
                            f"model.{field}={theirs.get(field)!r}")
    if "vocab_size" in spec.task.model_fields_set and spec.task.vocab_size != pretrained.vocab_size:
        raise SpecError(f"task.vocab_size={spec.task.vocab_size} but the pretraining run's tokenizer has "
                        f"{pretrained.vocab_size} pieces; a fine-tuned model reads the pretraining tokenizer: remove "
                        "task.vocab_size from the spec")


def _architecture(spec: ExperimentSpec) -> dict[str, Any]:
    data = spec.model.model_dump(mode="json")
    return {k: v for k, v in data.items() if k not in _FREE_MODEL_FIELDS}


def _short(attention: dict[str, Any]) -> str:
    """`{kind: mhe, heads: 2, mode: mul}`: the kind first, then its knobs (d_model is the model's)."""
    knobs = {"kind": attention.get("kind"), **{k: v for k, v in attention.items() if k not in ("kind", "d_model")}}
    return "{" + ", ".join(f"{k}: {v}" for k, v in knobs.items() if v is not None) + "}"


def preflight(spec: ExperimentSpec) -> PretrainedCheckpoint | None:
    """Resolve and check `model.init_from` (None when the spec does not fine-tune)."""
    if spec.model.init_from is None:
        return None
    pretrained = resolve(spec)
    check_compatible(spec, pretrained)
    return pretrained


@dataclass(frozen=True)
class LoadedPretraining:
    state: Any
    """The pretraining checkpoint's TrainingState (weights, step, MLflow run id)."""
    tokenizer: Path
    """Its tokenizer, as a local file that outlives a download."""
    location: str

    def lineage_tags(self) -> dict[str, str]:
        """What the fine-tuning run records of its origin (LINEAGE_TAGS)."""
        checkpoint = self.location.rstrip("/").rsplit("/", 1)[-1]
        return dict(zip(LINEAGE_TAGS, (str(self.state.mlflow_run_id), checkpoint, str(self.state.step))))

    def initializer(self, freeze: str) -> Callable[[nn.Module], None]:
        """For Trainer.create: the pretrained encoder into a fresh classifier, then the frozen part fixed."""
        def initialize(model: nn.Module) -> None:
            load_encoder(model, self.state.model)
            model.freeze(freeze)

        return initialize


def load(location: str, keep_dir: Path) -> LoadedPretraining:
    """Read a pretraining checkpoint (a remote one is downloaded through Ray Train's Checkpoint); its tokenizer
    is copied into `keep_dir`, so the task can read it after the download is gone."""
    fs, path = storage_fs(location)
    keep_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        state = read_checkpoint(Path(path))
        tokenizer = Path(shutil.copy(Path(path) / TOKENIZER_FILE, keep_dir / TOKENIZER_FILE))
        return LoadedPretraining(state=state, tokenizer=tokenizer, location=location)
    import ray.train  # deferred: local training (orchestrator/launch/local_run.py) reads local checkpoints without Ray

    with ray.train.Checkpoint(path, filesystem=fs).as_directory() as directory:
        state = read_checkpoint(Path(directory))
        tokenizer = Path(shutil.copy(Path(directory) / TOKENIZER_FILE, keep_dir / TOKENIZER_FILE))
    return LoadedPretraining(state=state, tokenizer=tokenizer, location=location)
