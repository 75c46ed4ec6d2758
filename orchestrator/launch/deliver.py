"""What a run leaves for MLflow after training, sent from storage exactly once: the final evaluation's scores and
files (`test/*` metrics, the exported model, hypotheses) and the task's files (tokenizer, last outputs).

Training's own points go through the tracker's spool (orchestrator/tracking/write.py). These outputs are made by
other processes (the final evaluation's Ray task, rank 0 of the workers), so they are first written to the run's
storage folder (`evaluation/`, `task/`: orchestrator/storage/layout.py), which outlives any process, and the launcher
sends them from there. A run whose outputs did not all arrive is not ended FINISHED: its MLflow run stays open
and the next launcher of the name (`orchestrator resume`, a resumed sweep, `orchestrator evaluate`) sends what is
missing. Scores that `orchestrator evaluate` stored for another checkpoint (`evaluation/<checkpoint folder>/`) go
as `checkpoints/<split>/*` (a rewritten step's as `checkpoints-r<n>/<split>/*`), so they never replace the final
evaluation's `test/*` (_scores_as_sent).

Exactly once: `mlflow-delivered.json` in the run folder lists what the MLflow run already holds (per MLflow run
id). Scores are also checked against the run's metric history and the spool before they are sent, so a launcher
killed between sending and recording sends none twice. A file is known by its path, size and modification
time: one rewritten by a later `orchestrator evaluate` is sent again, replacing the old one (MLflow overwrites
an artifact of the same path).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from orchestrator.storage.layout import (
    DELIVERED_FILE,
    EVALUATION_DIR,
    EVALUATION_RECORD_SUFFIX,
    TASK_FILES_DIR,
    checkpoint_order,
    is_final_evaluation,
)
from orchestrator.storage.locations import (
    files_under,
    is_remote,
    join,
    read_json,
    storage_fs,
    upload,
    write_json,
)
from orchestrator.tracking.write import MlflowTracker

MODEL_DIR = "model"
"""The exported model's folder, in an evaluation folder and among the MLflow run's artifacts alike."""
CHECKPOINT_SCORES_PREFIX = "checkpoints/"
"""MLflow key prefix of scores of a checkpoint other than the final evaluation's: `checkpoints/test/loss`; a step
checkpointed again after a resume fell back past it (`checkpoint_000000030-r1`) has its own, `checkpoints-r1/`."""


def store_task_files(run_folder: str, files: Mapping[str, Path]) -> None:
    """Rank 0 at the end of training: the task's files into `<run>/task/<name>/`, for the launcher to send."""
    for name, path in files.items():
        path = Path(path)
        if not path.exists():
            continue
        target = join(run_folder, TASK_FILES_DIR, name)
        upload(path, target if path.is_dir() else join(target, path.name))


def _artifact_path(relative: str) -> str | None:
    """Where a stored output goes among the MLflow run's artifacts (None: not an artifact). The exported model
    is the run's `model/`; the task's files keep `task/<name>/`; other evaluation files keep their folder."""
    folder, _, name = relative.rpartition("/")
    if name.endswith(EVALUATION_RECORD_SUFFIX):
        return None  # scores: sent as metrics
    if folder == f"{EVALUATION_DIR}/{MODEL_DIR}" or folder.startswith(f"{EVALUATION_DIR}/{MODEL_DIR}/"):
        return folder.removeprefix(f"{EVALUATION_DIR}/")
    if folder.startswith((EVALUATION_DIR, f"{TASK_FILES_DIR}/")):
        return folder
    return None


def pending_outputs(run_folder: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(key, path relative to the run folder, score record or None for a file) of every output stored in the
    run folder, scores first."""
    files = [f for folder in (EVALUATION_DIR, TASK_FILES_DIR)
             for f in ((f"{folder}/{rel}", size, mtime) for rel, size, mtime in files_under(join(run_folder, folder)))]
    scores, artifacts = [], []
    for relative, size, mtime in files:
        if relative.endswith(EVALUATION_RECORD_SUFFIX):
            record = read_json(join(run_folder, relative))
            if isinstance(record, dict) and "metrics" in record:
                scores.append((f"scores:{relative}@{record['step']}", relative, record))
        elif _artifact_path(relative) is not None:
            artifacts.append((f"file:{relative}:{size}:{mtime}", relative, None))
    return scores + artifacts


@contextmanager
def _local_file(location: str) -> Iterator[Path]:
    """A local path with the content of `location` (downloaded first from remote storage)."""
    if not is_remote(location):
        yield Path(location)
        return
    fs, path = storage_fs(location)
    with tempfile.TemporaryDirectory(prefix="deliver-") as tmp:
        local = Path(tmp) / Path(path).name
        with fs.open_input_stream(path) as src, open(local, "wb") as dst:
            shutil.copyfileobj(src, dst)
        yield local


def _scores_as_sent(relative: str, record: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags) of a score record as its MLflow run gets them. The record in `evaluation/` itself is the
    final evaluation's: `test/*` and its `test.checkpoint` tag. One in a checkpoint's own folder
    (`orchestrator evaluate --checkpoint latest | all | checkpoint_<step>`) is sent as `checkpoints/<split>/*` at
    that checkpoint's step and without tags: MLflow shows a metric's value at its highest step, so under the same
    keys a later checkpoint's scores would replace the final evaluation's, and its tag would too."""
    metrics = dict(record["metrics"])
    if is_final_evaluation(relative):
        return metrics, dict(record.get("tags") or {})
    # Both checkpoints of a rewritten step are at that step: under one key, the second's scores would be taken for
    # the first's, already held, and never sent.
    rewrite = checkpoint_order(relative.split("/")[-2])[1]
    prefix = f"{CHECKPOINT_SCORES_PREFIX.rstrip('/')}-r{rewrite}/" if rewrite else CHECKPOINT_SCORES_PREFIX
    return {f"{prefix}{key}": value for key, value in metrics.items()}, {}


def _send_scores(tracker: MlflowTracker, run_id: str, relative: str, record: Mapping[str, Any]) -> bool:
    """The record's metrics at its step, those the run (or the spool) does not hold yet, and its tags. True when
    they are sent, or kept in a spool file that the next launcher sends."""
    step = int(record["step"])
    metrics, tags = _scores_as_sent(relative, record)
    held = tracker.steps_held(run_id, list(metrics))
    fresh = {k: v for k, v in metrics.items() if step not in held.get(k, ())}
    if fresh:
        tracker.log_metrics(run_id, fresh, step=step)
    tagged = tracker.set_tags(run_id, tags)
    return tagged and (tracker.spool is not None or not tracker.holds_unsent(run_id))


def outputs_owed(run_id: str | None, run_folder: str) -> int:
    """How many of the run folder's outputs the MLflow run `run_id` does not hold yet, by the ledger (0 for None:
    nothing can be owed to a run not opened yet), so that a launcher says "sent" only of what was owed."""
    if run_id is None:
        return 0
    done = set((read_json(join(run_folder, DELIVERED_FILE)) or {}).get(run_id, []))
    return sum(key not in done for key, _, _ in pending_outputs(run_folder))


def deliver_outputs(tracker: MlflowTracker, run_id: str | None, run_folder: str) -> bool:
    """Send the run folder's outputs that the MLflow run `run_id` does not hold yet; True when it holds them all.
    None (the run could not be opened yet): True, as nothing can be owed to it yet; its outputs wait in the run
    folder for whoever opens it."""
    if run_id is None:
        return True
    ledger_path = join(run_folder, DELIVERED_FILE)
    ledger = read_json(ledger_path) or {}
    done: set[str] = set(ledger.get(run_id, []))
    complete = True
    for key, relative, record in pending_outputs(run_folder):
        if key in done:
            continue
        if record is not None:
            sent = _send_scores(tracker, run_id, relative, record)
        else:
            with _local_file(join(run_folder, relative)) as local:
                sent = tracker.log_artifact(run_id, local, artifact_path=_artifact_path(relative))
        if not sent:
            complete = False
            continue
        done.add(key)
        write_json(ledger_path, {**ledger, run_id: sorted(done)})
    return complete
