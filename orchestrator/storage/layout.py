"""Where a run or a sweep keeps its files in storage: the one owner of those folder and file names.

Storage is a local folder or a URI (s3://bucket/runs, gs://...), read and written through pyarrow.fs either
way. Under `<storage>/<name>`:

    orchestrator.json          the launcher's metadata: what `orchestrator resume NAME` needs (spec, MLflow ids)
    .orchestrator.lock         while a launcher (train, sweep, resume) drives the name (local or s3:// storage)
    checkpoint_<step>/         a run's checkpoints (nine digits: a storage listing reads as a training history)
    mlflow-spool.jsonl         metric points the tracking server has not taken yet (any storage)
    diverged.txt               once the run's loss became NaN or infinite: the reason, one line
    error.txt                  once the run failed: the whole error, tracebacks included
    finished.json              once a sweep's trial finished (trained, scored, MLflow run ended): its last report
    evaluation/                outputs of the final evaluation (and of `orchestrator evaluate`): files, and
                               `<split>.metrics.json` with the scores
    task/                      the task's files at the end of training (tokenizer, last evaluation's outputs)
    mlflow-delivered.json      which of those outputs the run's MLflow run already holds (orchestrator/launch/deliver.py)
    pretrain/                  a two-stage run's pretraining stage (a Train run folder of its own)
    trials/train-<id>/         a sweep's Train run of each trial
    trials/pretrain-<id>/      a two-stage trial's pretraining stage
    report/                    a sweep's summary report, when storage is local

An s3:// location is read and written through the one S3 filesystem of orchestrator/storage/object_store.py (its endpoint,
region and credentials from the standard AWS settings); Ray Train gets the same filesystem (`locations.ray_storage`).
Tokenizers and prepared data live next to the runs (`<storage>/.cache`) when storage is local, else in the
user's cache. Every other module asks a `RunLayout` (or the helpers below) for these paths; nobody joins or
parses the names by hand.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs

from orchestrator.storage.locations import (
    is_remote,
    join,
    read_json,
    read_text,
    storage_fs,
    subfolders,
    write_json,
    write_text,
)
from orchestrator.storage.object_store import is_s3

META_FILE = "orchestrator.json"
"""Written next to a run's or sweep's Ray files: what `orchestrator resume NAME` needs (spec, MLflow ids)."""
LOCK_FILE = ".orchestrator.lock"
"""In a run's or sweep's storage folder while a launcher (train, sweep, resume) drives it."""
TRIALS_DIR = "trials"
"""Sub-folder of a sweep holding the Train run of each trial."""
PRETRAIN_DIR = "pretrain"
"""Sub-folder of a two-stage run holding its pretraining stage's Train run (a trial's is trials/pretrain-<id>)."""
TRIAL_PREFIX = "train-"
"""A trial's Train run folder under trials/: train-<trial id>."""
TRIAL_PRETRAIN_PREFIX = "pretrain-"
"""A two-stage trial's pretraining Train run folder under trials/: pretrain-<trial id>."""
SPOOL_FILE = "mlflow-spool.jsonl"
"""In a run's storage folder: metric points not yet accepted by the tracking server, one JSON object a line."""
DIVERGED_FILE = "diverged.txt"
"""In a Train run's folder once its loss became NaN or infinite (run.stop_on_nan): the reason, one line."""
ERROR_FILE = "error.txt"
"""In a Train run's folder once it failed: the whole error, tracebacks included (the console shows one line)."""
FINISHED_FILE = "finished.json"
"""In a sweep trial's Train run folder once it finished (mark_finished)."""
EVALUATION_DIR = "evaluation"
"""Sub-folder of a run's storage folder with the outputs of its final evaluation."""
EVALUATION_RECORD_SUFFIX = ".metrics.json"
"""`<split>.metrics.json` in an evaluation folder: the scores, written after the files they describe."""
TASK_FILES_DIR = "task"
"""Sub-folder of a Train run's folder with the task's files (task.artifacts()) at the end of training."""
DELIVERED_FILE = "mlflow-delivered.json"
"""In a Train run's folder: which outputs (evaluation/, task/) its MLflow run holds."""
REPORT_DIR = "report"
"""Sub-folder of a sweep's folder with its summary report's files (local storage only)."""
CACHE_DIR = ".cache"
"""Tokenizers and prepared data, next to the runs of a local storage."""
_CHECKPOINT_PREFIX = "checkpoint_"
_CHECKPOINT_NAME = re.compile(rf"{_CHECKPOINT_PREFIX}(\d+)(?:-r(\d+))?$")


def cache_dir_of(storage_path: str) -> str:
    """Tokenizers and prepared data: next to the runs when storage is local, else in the user's cache."""
    if not is_remote(storage_path):
        return str(Path(storage_path) / CACHE_DIR)
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attention-orchestrator")


# --- one Train run's folder ----------------------------------------------------------------------------


def checkpoint_name(step: int, rewrite: int = 0) -> str:
    """The folder name of the checkpoint after `step` optimizer steps (`checkpoint_000002750`); `rewrite` > 0 for
    a step checkpointed again after a resume fell back past it (`checkpoint_000002750-r1`, see
    `fresh_checkpoint_name`)."""
    return f"{_CHECKPOINT_PREFIX}{step:09d}" + (f"-r{rewrite}" if rewrite else "")


def checkpoint_step(name: str) -> int | None:
    """The step a checkpoint folder's name says, or None when the name is not a checkpoint's."""
    found = _CHECKPOINT_NAME.match(name)
    return int(found.group(1)) if found else None


def checkpoint_order(name: str) -> tuple[int, int]:
    """Sort key of checkpoint folder names, oldest first: by step, then a step's rewrites after it; (-1, 0) for a
    name that is not a checkpoint's."""
    found = _CHECKPOINT_NAME.match(name)
    return (int(found.group(1)), int(found.group(2) or 0)) if found else (-1, 0)


def fresh_checkpoint_name(step: int, taken: Collection[str]) -> str:
    """The name for a new checkpoint of `step` that no folder in `taken` has. A resume that fell back past an
    unreadable checkpoint reaches that step again; Ray's checkpoint manager may already hold the old folder under
    its name, and a second checkpoint of the same name would be registered twice, so that deleting the stale
    entry removes the new folder and a later clean-up fails on the missing path. The new one gets `-r<n>`."""
    rewrite = 0
    while checkpoint_name(step, rewrite) in taken:
        rewrite += 1
    return checkpoint_name(step, rewrite)


def checkpoint_steps(run_folder: str) -> dict[str, int]:
    """The checkpoint folders of a Train run's storage folder, name -> step ({} without any, or no folder)."""
    return {name: step for name in subfolders(run_folder) if (step := checkpoint_step(name)) is not None}


def local_checkpoints(folder: Path) -> list[Path]:
    """The checkpoint folders under a local folder, oldest step first."""
    return sorted((path for path in Path(folder).iterdir() if checkpoint_step(path.name) is not None),
                  key=lambda path: checkpoint_order(path.name)) \
        if Path(folder).is_dir() else []


def latest_checkpoint(run_folder: str) -> str | None:
    """The newest checkpoint folder of a Train run (path or URI), or None."""
    steps = checkpoint_steps(run_folder)
    return join(run_folder, max(steps, key=checkpoint_order)) if steps else None


def spool_of(run_folder: str) -> str:
    """The metric spool of a Train run's folder (a local file, or an object next to the run's checkpoints)."""
    return join(run_folder, SPOOL_FILE)


def exists(location: str) -> bool:
    fs, path = storage_fs(location)
    return fs.get_file_info(path).type == pyarrow.fs.FileType.File


def mark_diverged(run_folder: str, reason: str) -> None:
    """Record that the run diverged. Resuming it from its checkpoints would diverge again (same state, data and
    RNG), so retries (run.max_failures, tune.max_failures, `orchestrator resume`) stop at once with the reason
    instead of training up to the same step again."""
    write_text(join(run_folder, DIVERGED_FILE), reason)


def diverged(run_folder: str) -> str | None:
    """The reason the run at `run_folder` diverged, or None."""
    text = read_text(join(run_folder, DIVERGED_FILE))
    return None if text is None else text.strip() or "the loss became NaN or infinite"


RAY_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
"""Ray Train's record of a run's registered checkpoints (ray/train/v2/_internal/constants.py), which its controller
reads at every start of the run."""


def set_aside_unreadable_snapshot(run_folder: str) -> str | None:
    """Move Ray Train's checkpoint snapshot of `run_folder` aside when it is not JSON (written on a full disk, cut
    short): Ray's controller fails to start on it, so the run could never resume. Without it, Ray starts with no
    registered checkpoints, the worker still finds the checkpoints in storage (worker.py, `_restore_point`), and
    Ray does not delete the ones it no longer knows. Says what was done, or None when the snapshot was fine."""
    location = join(run_folder, RAY_SNAPSHOT_FILE)
    try:
        text = read_text(location)
    except OSError:
        return None
    if text is None:
        return None
    try:
        json.loads(text)
        return None
    except ValueError:
        pass
    aside = f"{location}.unreadable"
    fs, path = storage_fs(location)
    fs.move(path, storage_fs(aside)[1])
    return (f"Ray's checkpoint record {RAY_SNAPSHOT_FILE} was unreadable ({len(text)} bytes, cut short?) and is "
            f"kept as {aside}; the run resumes from the checkpoints in storage, and the ones before this resume stay "
            "until you delete them")


def record_error(run_folder: str, text: str) -> str:
    """Keep a failed run's whole error (the console prints its one-line reason) in the run's folder, or where that
    cannot be written (a full disk, a storage that does not answer) in the system's temporary folder; says where,
    or why it could not be kept at all."""
    location = join(run_folder, ERROR_FILE)
    try:
        write_text(location, text)
        return location
    except OSError as err:
        problem = f"{err.strerror or type(err).__name__} in {run_folder}"
    try:
        with tempfile.NamedTemporaryFile("w", prefix="orchestrator-error-", suffix=".txt", delete=False) as f:
            f.write(text)
        return f"{f.name} ({problem})"
    except OSError as err:
        return f"nowhere: {problem}, and {err.strerror or type(err).__name__} in {tempfile.gettempdir()}"


def mark_finished(run_folder: str, metrics: Mapping[str, Any]) -> None:
    """Record that the Train run at `run_folder` (a sweep's trial) finished: trained and scored, with its last
    report. A resumed sweep counts it finished from this, not from Tune's last result (a launcher killed right
    after the trial ended never saved that), and does not run it again."""
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}
    write_json(join(run_folder, FINISHED_FILE), {"metrics": scalars})


def finished(run_folder: str) -> dict[str, Any] | None:
    """The last report of the finished Train run at `run_folder` (mark_finished), or None."""
    record = read_json(join(run_folder, FINISHED_FILE))
    return record.get("metrics") if isinstance(record, dict) else None


def checkpoint_evaluation_dir(checkpoint: str) -> str:
    """The evaluation folder, relative to a run's folder, of a checkpoint `orchestrator evaluate` scored other than
    the final evaluation's (`evaluation/checkpoint_000000420`), so that it never replaces the final one's."""
    return f"{EVALUATION_DIR}/{checkpoint}"


def is_final_evaluation(record: str) -> bool:
    """Whether a score record (relative to the run's folder) is the final evaluation's, in `evaluation/` itself,
    rather than in a checkpoint's own folder (checkpoint_evaluation_dir)."""
    return record.rpartition("/")[0] == EVALUATION_DIR


def evaluation_record(folder: str, split: str) -> str:
    """The scores of `split` in an evaluation folder (written by orchestrator/launch/evaluate.py)."""
    return join(folder, f"{split}{EVALUATION_RECORD_SUFFIX}")


def trained_to(run_folder: str, max_steps: int) -> bool:
    """The Train run at `run_folder` checkpointed its last step (a finished stage is not run again)."""
    return max(checkpoint_steps(run_folder).values(), default=-1) >= max_steps


# --- a run's or a sweep's folder -------------------------------------------------------------------------


@dataclass(frozen=True)
class RunLayout:
    """The folders and files of the run or sweep `name` under `storage` (a local path or a URI)."""

    storage: str
    name: str

    @property
    def folder(self) -> str:
        """The run's Train run folder, or the sweep's Tune experiment folder."""
        return join(self.storage, self.name)

    @property
    def remote(self) -> bool:
        return is_remote(self.storage)

    @property
    def cache_dir(self) -> str:
        return cache_dir_of(self.storage)

    @property
    def spool(self) -> str:
        """A single run's metric spool."""
        return spool_of(self.folder)

    @property
    def pretrain_folder(self) -> str:
        """A two-stage run's pretraining Train run."""
        return join(self.folder, PRETRAIN_DIR)

    @property
    def trials_folder(self) -> str:
        return join(self.folder, TRIALS_DIR)

    def trial_folder(self, trial_id: str) -> str:
        """The Train run folder of a sweep's trial."""
        return join(self.trials_folder, self.trial_run_name(trial_id))

    @staticmethod
    def trial_run_name(trial_id: str) -> str:
        """The Ray Train run name of a trial (its folder under trials/)."""
        return f"{TRIAL_PREFIX}{trial_id}"

    @staticmethod
    def trial_pretrain_name(trial_id: str) -> str:
        """The Ray Train run name of a two-stage trial's pretraining stage (its folder under trials/)."""
        return f"{TRIAL_PRETRAIN_PREFIX}{trial_id}"

    def spool_of_trial(self, trial_id: str) -> str:
        """A trial's metric spool."""
        return spool_of(self.trial_folder(trial_id))

    def trial_spools(self) -> list[str]:
        """The spool files that exist under trials/ (every trial's and pretraining stage's Train run)."""
        return [spool for spool in (spool_of(folder) for _, folder in self.stage_runs()) if exists(spool)]

    def trials(self) -> list[tuple[str, str]]:
        """(trial id, Train run folder) of every trial that has a folder, by id."""
        return [(entry.removeprefix(TRIAL_PREFIX), join(self.trials_folder, entry))
                for entry in sorted(subfolders(self.trials_folder)) if entry.startswith(TRIAL_PREFIX)]

    def stage_runs(self) -> list[tuple[str, str]]:
        """(label, folder) of every Train run under trials/, pretraining stages included (`pretrain-<id>`);
        a trial's label is its id."""
        return [(entry.removeprefix(TRIAL_PREFIX), join(self.trials_folder, entry))
                for entry in sorted(subfolders(self.trials_folder))]

    def run_folders(self) -> list[str]:
        """Every Train run folder of the name: the run, its pretraining stage, every trial's (and stage's)."""
        return [self.folder, self.pretrain_folder, *(folder for _, folder in self.stage_runs())]

    def has_checkpoint(self) -> bool:
        """The run, or a trial of the sweep, wrote a checkpoint: it can be resumed, and its name is taken."""
        return any(checkpoint_steps(folder) for folder in self.run_folders())

    @property
    def report_dir(self) -> Path | None:
        """Where a sweep's summary report's files go: the sweep's folder when storage is local."""
        return None if self.remote else Path(self.folder) / REPORT_DIR

    # --- metadata and lock ---------------------------------------------------------------------------

    @property
    def meta_path(self) -> str:
        return join(self.folder, META_FILE)

    def read_meta(self) -> dict[str, Any] | None:
        text = read_text(self.meta_path)
        return None if text is None else json.loads(text)

    def write_meta(self, meta: Mapping[str, Any]) -> None:
        write_json(self.meta_path, meta)

    @property
    def lock_location(self) -> str | None:
        """The launcher's lock (orchestrator/launch/name_lock.py): a local file, or an object with a lease on s3://;
        None on other remote storage, which has no lock."""
        return join(self.folder, LOCK_FILE) if not self.remote or is_s3(self.storage) else None

    @property
    def lock_path(self) -> Path | None:
        """The launcher's lock file on local storage (None on remote storage)."""
        return None if self.remote else Path(self.folder) / LOCK_FILE

    def lock_holder(self) -> dict[str, Any] | None:
        """What the lock says of the launcher holding it (pid, host, since), {} when unreadable; None when
        there is no lock (or no lock at all: remote storage other than s3://)."""
        if self.lock_location is None:
            return None
        try:
            text = read_text(self.lock_location)
        except OSError:
            return {}
        if text is None:
            return None
        try:
            return json.loads(text or "{}")
        except json.JSONDecodeError:
            return {}

    def clear(self) -> None:
        """Delete everything of the name but the lock (a first attempt that never reached a checkpoint)."""
        fs, path = storage_fs(self.folder)
        for info in fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True)):
            if info.base_name == LOCK_FILE:
                continue  # the launcher's own
            if info.type == pyarrow.fs.FileType.Directory:
                fs.delete_dir(info.path)
            else:
                fs.delete_file(info.path)
