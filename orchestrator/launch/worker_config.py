"""The typed configuration the launcher hands to every Ray Train worker (no Ray import: run.py and sweep.py build it
before `ray.train` may be imported, which must wait until Train V2 is switched on)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.tracking.describe import RunHandle

WORKER_CONFIG = "worker"
"""The one key of Ray's train_loop_config: a `WorkerConfig`."""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs besides Ray's context; built by the launcher."""

    spec: dict[str, Any]
    """The resolved spec (JSON), validated again on the worker."""
    run: RunHandle
    """The MLflow run to log to (its id, or how to find or create it after an outage at launch)."""
    label: str
    """Console prefix: the run name, or the study name and trial id."""
    cache_dir: str
    """Tokenizers and prepared data, shared by the runs of this storage."""
    run_path: str
    """The Train run's storage folder (local path or URI): where its checkpoints are, registered or not."""
    spool: str | None = None
    """Where metric points the tracking server has not taken yet wait (layout.SPOOL_FILE in the run's storage
    folder: a local file, or an object on s3://)."""
    fail_at_step: int | None = None
    """Raise InjectedFailure after this step (tests of resume)."""
    init_checkpoint: str | None = None
    """The checkpoint model.init_from resolved to (orchestrator/launch/pretrained.py), when the run fine-tunes."""
