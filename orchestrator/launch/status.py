"""`orchestrator status NAME`: where a run or a sweep stands, from its storage folder and MLflow, while it
runs and after.

Storage says what exists (the launcher's `orchestrator.json`, its lock while a launcher is live, each Train
run's `checkpoint_<step>` folders); MLflow says how far each run got (status, last step, last and best
value of the spec's metric). Either may be missing: a run that has not reached the tracking server yet
shows from storage alone, and the MLflow part says why it is absent. Reads only; Ray is not started.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.launch.name_lock import holder_gone
from orchestrator.launch.preflight import LaunchError
from orchestrator.spec import expected_trials, study_from_raw, validate_spec
from orchestrator.storage.layout import META_FILE, RunLayout, latest_checkpoint
from orchestrator.storage.locations import resolve
from orchestrator.tracking.describe import TRIAL_TAG
from orchestrator.tracking.read import TrackingReader, ui_url

UI_ADDRESS = "http://127.0.0.1:5000"
"""Where `orchestrator ui` serves a local tracking store (its default --port)."""


@dataclass
class RunState:
    label: str
    folder: str
    mlflow_run_id: str | None = None
    status: str | None = None
    """MLflow's: RUNNING, FINISHED, FAILED, KILLED; None when MLflow does not know the run (yet)."""
    step: int | None = None
    value: float | None = None
    """The spec's metric at its last evaluation."""
    best: float | None = None
    last_checkpoint: str | None = None
    knobs: str = ""


@dataclass
class Status:
    kind: str
    name: str
    folder: str
    metric: str
    mode: str
    max_steps: int
    launcher: str
    """live (pid, host, since) or "none"."""
    runs: list[RunState] = field(default_factory=list)
    expected: int = 1
    tracking_uri: str = ""
    experiment_id: str | None = None
    mlflow_run_id: str | None = None
    """The run's, or the sweep parent's."""
    mlflow_status: str | None = None
    mlflow_note: str | None = None
    """Why MLflow could not be asked, when it could not."""

    def best(self) -> RunState | None:
        scored = [r for r in self.runs if r.best is not None and math.isfinite(r.best)]
        if not scored:
            return None
        return (min if self.mode == "min" else max)(scored, key=lambda r: r.best)


def _launcher(layout: RunLayout) -> str:
    if layout.lock_location is None:
        return "unknown (this remote storage has no lock; s3:// and local storage have)"
    holder = layout.lock_holder()
    if holder is None:
        return "none"
    if holder_gone(holder):
        return "none (a launcher died; its lock is taken over by the next one)"
    renewed = f", lease renewed {holder['renewed']}" if "renewed" in holder else ""
    return f"live: pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since', '?')}{renewed}"


def read_status(name: str, storage: str) -> Status:
    """The storage half of the status; `add_mlflow` adds the rest."""
    layout = RunLayout(storage, name)
    meta = layout.read_meta()
    if meta is None:
        raise LaunchError(f"nothing named {name!r} in {storage} (no {META_FILE}); check the name and --storage-path")
    if meta["kind"] == "run":
        spec = validate_spec(meta["spec"], where=f"stored spec of {name}")
        runs = [RunState(label=name, folder=layout.folder, mlflow_run_id=meta.get("mlflow_run_id"),
                         last_checkpoint=latest_checkpoint(layout.folder))]
        expected = 1
    else:
        study = study_from_raw(meta["raw"])
        spec, expected = study.base, expected_trials(study)
        runs = [RunState(label=trial_id, folder=folder, last_checkpoint=latest_checkpoint(folder))
                for trial_id, folder in layout.trials()]
    return Status(kind=meta["kind"], name=name, folder=layout.folder, metric=spec.metric, mode=spec.mode,
                  max_steps=spec.optim.max_steps, launcher=_launcher(layout), runs=runs, expected=expected,
                  tracking_uri=spec.tracking.uri, mlflow_run_id=meta.get("mlflow_run_id") or meta.get("parent_run_id"))


def _last(metrics: Mapping[str, float], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def add_mlflow(status: Status) -> Status:
    """Each run's MLflow state (a sweep's children found by parent and trial id); a store that does not
    answer leaves a note instead."""
    if status.mlflow_run_id is None:
        status.mlflow_note = "no MLflow run id stored (the tracking server was down at launch?)"
        return status
    try:
        reader = TrackingReader(status.tracking_uri, timeout_s=5)
        top = reader.run(status.mlflow_run_id)
        status.experiment_id, status.mlflow_status = top.info.experiment_id, top.info.status
        if status.kind == "run":
            children = {status.runs[0].label: top}
        else:
            found = reader.children(top.info.experiment_id, status.mlflow_run_id)
            children = {run.data.tags.get(TRIAL_TAG, run.info.run_id): run for run in found}
    except Exception as err:  # noqa: BLE001 - status must work with the server down: storage still answers
        status.mlflow_note = f"MLflow at {status.tracking_uri} did not answer ({type(err).__name__}: {str(err)[:200]})"
        return status
    known = {run.label: run for run in status.runs}
    for label, found in children.items():
        run = known.get(label)
        if run is None:  # a child whose Train run has no folder yet
            run = RunState(label=label, folder="")
            status.runs.append(run)
        metrics = found.data.metrics
        run.mlflow_run_id, run.status = found.info.run_id, found.info.status
        run.step = int(metrics["step"]) if "step" in metrics else _last_step(reader, found.info.run_id, status.metric)
        run.value, run.best = _last(metrics, status.metric), _last(metrics, f"best/{status.metric}")
        if run.best is None:
            run.best = run.value
        params = found.data.params
        run.knobs = found.info.run_name if status.kind == "sweep" else params.get("model.attention.kind", "")
    return status


def _last_step(reader: TrackingReader, run_id: str, metric: str) -> int | None:
    """The last step the run logged: train/loss is logged every log_every steps, the metric at evaluations."""
    for key in ("train/loss", metric):
        history = reader.metric_history(run_id, key)
        if history:
            return max(point.step for point in history)
    return None


def link(status: Status, run_id: str | None) -> str | None:
    if status.experiment_id is None or run_id is None:
        return None
    uri = status.tracking_uri
    return ui_url(uri if uri.startswith(("http://", "https://")) else UI_ADDRESS, status.experiment_id, run_id)


def _value(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def format_status(status: Status) -> str:
    """The lines `orchestrator status` prints."""
    done = sum(r.status == "FINISHED" for r in status.runs)
    failed = sum(r.status == "FAILED" for r in status.runs)
    running = sum(r.status == "RUNNING" for r in status.runs)
    lines = [f"{status.kind} {status.name}: " + (f"MLflow {status.mlflow_status}" if status.mlflow_status else
                                                  "not in MLflow") + f"; launcher {status.launcher}",
             f"storage: {status.folder}"]
    if status.kind == "sweep":
        others = len(status.runs) - done - failed - running
        pending = max(0, status.expected - len(status.runs))
        lines.append(f"trials: {status.expected}: {done} finished, {running} running, {failed} failed, "
                     f"{others} stopped or unknown, {pending} not started")
    for run in status.runs:
        lines.append(f"  {run.label}: {run.status or 'no MLflow run'}, step {run.step if run.step is not None else '-'}"
                     f"/{status.max_steps}, {status.metric} {_value(run.value)} (best {_value(run.best)})"
                     + (f", {run.knobs}" if run.knobs and run.knobs != run.label else ""))
        lines.append(f"    last checkpoint: {run.last_checkpoint or '(none yet)'}")
    best = status.best()
    if best is not None:
        lines.append(f"best so far: {status.metric} {_value(best.best)} ({best.knobs or best.label})")
    if status.mlflow_note:
        lines.append(f"MLflow: {status.mlflow_note}")
    else:
        where = link(status, status.mlflow_run_id)
        served = "" if status.tracking_uri.startswith(("http://", "https://")) else \
            f" (served by `orchestrator ui` on {status.tracking_uri})"
        lines.append(f"MLflow: {where}{served}")
    return "\n".join(lines)


def status_cli(name: str, storage: str) -> int:
    print(format_status(add_mlflow(read_status(name, resolve(storage)))))
    return 0

