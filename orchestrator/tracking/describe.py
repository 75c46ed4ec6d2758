"""How a run is described to MLflow: tag names, the params of a spec, and `RunHandle`, the one description
of a run that the launcher builds and `MlflowTracker.ensure_run` turns into a run (orchestrator/tracking/write.py).

One experiment per study, a parent run per sweep, a nested child run per trial (tag `mlflow.parentRunId`), and a
run id that survives resume. No MLflow import here: the worker's config carries a handle without one.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

PARENT_TAG = "mlflow.parentRunId"
TRIAL_TAG = "ray.trial_id"
KIND_TAG = "method.family"
COMMIT_TAG = "mlflow.source.git.commit"
"""MLflow's own tag for the code version: the UI shows it with the run's source."""
SOURCE_TAG = "mlflow.source.name"
VERSION_TAGS_PREFIX = "versions."
"""versions.torch, versions.ray, versions.mlflow, versions.python, versions.attention-orchestrator."""
ROLE_TAG = "orchestrator.role"
SEED_TAG = "orchestrator.seed"
"""A sweep trial's seed (optim.seed, one of tune.seeds)."""
POINT_TAG = "orchestrator.point"
"""A sweep trial's method point: its swept values but the seed, shared by the trials of one point over seeds."""
RUN_KEY_TAG = "orchestrator.run"
"""Storage path + name of a single run: finds its MLflow run again (a trial is found by TRIAL_TAG)."""
CHECKPOINTS_TAG = "orchestrator.checkpoints"
"""MLflow tag of every run and trial: the storage folder (path or URI) of its Ray Train run and checkpoints."""
FAILURE_TAG = "orchestrator.failure"
"""Why a run ended FAILED, in one line (NaN, an exception, Ray Train giving up after run.max_failures)."""
NOTE_TAG = "mlflow.note.content"
FAILED_NOTE = "**Failed:**"
"""How a failed run's description begins (`failure_tags`), so a finished resume removes only that one."""
"""MLflow's run description, shown on the run's page: a failed run's reason, a sweep parent's comparison."""
# MLflow accepts 6000-char param values, older servers 500: keep every value within the smaller limit.
MAX_PARAM_CHARS = 500
MAX_TAG_CHARS = 5000  # MLflow's limit for a tag value is 8000 characters
ARTIFACTS_DIR = "mlartifacts"
"""Beside a local SQLite store's database file: its artifacts, one folder per experiment the project created
(the folder name `mlflow server` uses for the artifacts it serves)."""


@dataclass(frozen=True)
class RunHandle:
    """What identifies and describes one MLflow run. The launcher builds it (the one place tags are made);
    `MlflowTracker.ensure_run` turns it into a run id, in the launcher or, after an outage, in the worker."""

    experiment: str
    run_name: str
    key: tuple[str, str]
    """(tag, value) unique to this run, so a retried trial or a restarted launcher finds it again."""
    tags: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)
    """The flattened, resolved spec (logged once, when the run is created)."""
    spec_yaml: str = ""
    run_id: str | None = None

    def with_run_id(self, run_id: str | None) -> RunHandle:
        return replace(self, run_id=run_id) if run_id else self


def run_handle(params: Mapping[str, Any], spec_yaml: str, *, experiment: str, run_name: str, role: str,
               kind: str | None, commit: str, key: tuple[str, str], parent_run_id: str | None = None) -> RunHandle:
    """The handle of a run, a trial or a sweep's parent: the one place run tags are made (role, method family,
    commit, parent, key), with the params logged at creation (the flattened spec, or a sweep's tune.*)."""
    tags = {ROLE_TAG: role, COMMIT_TAG: commit, SOURCE_TAG: "orchestrator", key[0]: key[1], **version_tags()}
    if kind is not None:
        tags[KIND_TAG] = kind
    if parent_run_id:
        tags[PARENT_TAG] = parent_run_id
    return RunHandle(experiment=experiment, run_name=run_name, key=key, tags=tags,
                     params={k: str(v) for k, v in params.items()}, spec_yaml=spec_yaml)


def failure_tags(reason: str) -> dict[str, str]:
    """The tags that say on its MLflow run why a run FAILED: the reason as a tag (searchable, a column of the
    runs page) and as the run's description."""
    reason = reason[:MAX_TAG_CHARS]
    return {FAILURE_TAG: reason, NOTE_TAG: f"{FAILED_NOTE} {reason}\n"}


def stale_failure_tags(tags: Mapping[str, str]) -> list[str]:
    """The keys of `failure_tags` a run still holds (its description only while it is still the failure's): what a
    resume that FINISHED the run removes."""
    return [key for key in (FAILURE_TAG, NOTE_TAG)
            if key in tags and (key == FAILURE_TAG or tags[key].startswith(FAILED_NOTE))]


def artifact_root(uri: str) -> Path | None:
    """Where the artifacts of a local SQLite store go: `mlartifacts/` next to its database file. None for a
    server (it decides) or a file store (artifacts already live inside it). Without this, MLflow puts a SQLite
    store's artifacts in `./mlruns` of whatever folder created the experiment."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri == prefix + ":memory:":
        return None
    return Path(uri[len(prefix):]).resolve().parent / ARTIFACTS_DIR


def artifact_location(uri: str, experiment: str) -> str | None:
    """The artifact location of a new experiment of the store at `uri` (None: MLflow's default)."""
    root = artifact_root(uri)
    return None if root is None else (root / re.sub(r"[^\w.-]", "_", experiment)).as_uri()


def version_tags() -> dict[str, str]:
    """The versions that decide what a run computes, as tags (a run compared months later says what made it)."""
    import platform
    from importlib import metadata

    tags = {f"{VERSION_TAGS_PREFIX}python": platform.python_version()}
    for package in ("torch", "ray", "mlflow", "attention-orchestrator"):
        try:
            tags[f"{VERSION_TAGS_PREFIX}{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            tags[f"{VERSION_TAGS_PREFIX}{package}"] = "not installed"
    return tags


def device_tags(device: Any, world_size: int) -> dict[str, str]:
    """What trained the run: `device.name` (the GPU model, or the CPU's) and `device.workers` (DDP ranks)."""
    import platform

    import torch

    if getattr(device, "type", "cpu") == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    return {"device.name": name, "device.workers": str(world_size)}


MACHINE_SPECIFIC = ("run.storage_path", "tracking.uri")
"""Where a run was stored and logged: not a property of the experiment (tags and spec.yaml keep them)."""


def portable_params(spec: Mapping[str, Any]) -> dict[str, str]:
    """The spec as MLflow params, comparable across machines: where it was stored and logged is left out, and a
    local file or checkpoint path is shortened to its last two parts (`data/train.txt`), which name the data
    without the user's home or the cluster's mount point. The whole spec stays in the run's spec.yaml."""
    out = {}
    for key, value in flatten(spec).items():
        if key in MACHINE_SPECIFIC or key.endswith(tuple(f".{suffix}" for suffix in MACHINE_SPECIFIC)):
            continue
        out[key] = _short_path(value)
    return out


def _short_path(value: str) -> str:
    local = value.removeprefix("file://")
    if local.startswith(("/", "~")) and "\n" not in local:
        return "/".join(Path(local).parts[-2:])
    return value


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"model": {"attention": {"k": 128}}}` -> `{"model.attention.k": "128"}`, values as MLflow strings."""
    out: dict[str, str] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, prefix=f"{path}."))
        else:
            out[path] = str(value)[:MAX_PARAM_CHARS]
    return out


def git_commit(root: Path | None = None) -> str:
    """The project's commit, or "unknown" outside a git checkout (e.g. a pip-installed cluster image)."""
    root = root or Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
"""The environment of an `mlflow server` or `mlflow ui` this project starts: without MLflow's job runner, which
starts seven huey consumer processes (each importing MLflow: tens of CPU-seconds at every start on 2 cores) for
GenAI jobs (evaluation, prompt optimisation) that no run here submits."""
