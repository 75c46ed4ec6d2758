"""`orchestrator status NAME`: where a run or a sweep stands, from its storage folder and MLflow, while it
runs and after.

Storage says what exists (the launcher's `orchestrator.json`, its lock while a launcher is live, each Train
run's `checkpoint_<step>` folders); MLflow says how far each run got (status, last step, last and best
value of the spec's metric). Either may be missing: a run that has not reached the tracking server yet, or
whose server does not answer, shows from storage alone (its checkpointed step, whether it finished), and the
MLflow part says why it is absent. An unfinished run that no launcher drives (killed: its lock names a dead
process) is "stopped", with the resume command, though MLflow may still say RUNNING: nobody ended its MLflow
run, which stays open until `orchestrator resume`. Reads only; Ray is not started.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.console.progress import next_step
from orchestrator.launch.name_lock import holder_gone
from orchestrator.launch.preflight import NameNotFound
from orchestrator.spec import expected_trials, study_from_raw, validate_spec
from orchestrator.storage.layout import META_FILE, RunLayout, checkpoint_step, finished, latest_checkpoint
from orchestrator.storage.locations import is_remote, resolve
from orchestrator.storage.object_store import endpoint, is_s3
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
    finished_in_storage: bool = False
    """Storage says it finished (a trial's finished.json, a run's orchestrator.json): known with MLflow down."""

    @property
    def checkpointed_step(self) -> int | None:
        """The step of the last checkpoint: how far the run got by storage alone."""
        return checkpoint_step(self.last_checkpoint.rsplit("/", 1)[-1]) if self.last_checkpoint else None


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
    launcher_alive: bool | None = None
    """False when no launcher drives the name (no lock, or its process is gone); None when storage cannot tell."""
    launcher_died: bool = False
    """The lock a launcher left names a process of this host that is gone: it was killed."""
    next_step: str = ""
    """What to do when no launcher drives an unfinished run: the resume command (console.progress.next_step)."""
    runs: list[RunState] = field(default_factory=list)
    expected: int = 1
    tracking_uri: str = ""
    experiment_id: str | None = None
    mlflow_run_id: str | None = None
    """The run's, or the sweep parent's."""
    mlflow_status: str | None = None
    mlflow_note: str | None = None
    """Why MLflow could not be asked, when it could not."""
    mlflow_down: bool = False
    """The tracking server did not answer (as opposed to: it answered without the run, or no run id is stored)."""

    def best(self) -> RunState | None:
        scored = [r for r in self.runs if r.best is not None and math.isfinite(r.best)]
        if not scored:
            return None
        return (min if self.mode == "min" else max)(scored, key=lambda r: r.best)


def _launcher(layout: RunLayout) -> tuple[str, bool | None, bool]:
    """(what the lock says of the launcher, whether one is alive, whether one was killed). A launcher holds the
    name's lock while it lives (name_lock.py) and deletes it when it ends; a SIGKILL leaves it behind. A lock of
    another host counts as alive: its process cannot be asked from here (an s3:// lease runs out by itself)."""
    if layout.lock_location is None:
        return "unknown (this remote storage has no lock; s3:// and local storage have)", None, False
    holder = layout.lock_holder()
    if holder is None:
        return "none", False, False
    if holder_gone(holder):
        return (f"none (pid {holder.get('pid')} on {holder.get('host')} died without ending; its lock is taken "
                "over by the next launcher)"), False, True
    renewed = f", lease renewed {holder['renewed']}" if "renewed" in holder else ""
    live = f"live: pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since', '?')}{renewed}"
    return live, True, False


def read_status(name: str, storage: str) -> Status:
    """The storage half of the status; `add_mlflow` adds the rest."""
    layout = RunLayout(storage, name)
    meta = layout.read_meta()
    if meta is None:
        raise NameNotFound(f"nothing named {name!r} in {storage} (no {META_FILE}); check the name and --storage-path")
    if meta["kind"] == "run":
        spec = validate_spec(meta["spec"], where=f"stored spec of {name}")
        runs = [RunState(label=name, folder=layout.folder, mlflow_run_id=meta.get("mlflow_run_id"),
                         last_checkpoint=latest_checkpoint(layout.folder),
                         finished_in_storage=meta.get("status") == "FINISHED")]
        expected = 1
    else:
        study = study_from_raw(meta["raw"])
        spec, expected = study.base, expected_trials(study)
        runs = [_stored_trial(trial_id, folder, spec.metric) for trial_id, folder in layout.trials()]
    launcher, alive, died = _launcher(layout)
    return Status(kind=meta["kind"], name=name, folder=layout.folder, metric=spec.metric, mode=spec.mode,
                  max_steps=spec.optim.max_steps, launcher=launcher, launcher_alive=alive, launcher_died=died,
                  next_step=next_step(layout) if alive is False else "", runs=runs, expected=expected,
                  tracking_uri=spec.tracking.uri, mlflow_run_id=meta.get("mlflow_run_id") or meta.get("parent_run_id"))


def _stored_trial(trial_id: str, folder: str, metric: str) -> RunState:
    """A trial as storage knows it; a finished one's last report gives its metric when MLflow cannot."""
    record = finished(folder)
    run = RunState(label=trial_id, folder=folder, last_checkpoint=latest_checkpoint(folder),
                   finished_in_storage=record is not None)
    if record is not None:
        run.value, best = _last(record, metric), _last(record, f"best/{metric}")
        run.best = best if best is not None else run.value
    return run


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
        detail = f"{type(err).__name__}: {str(err)[:200]}"
        if getattr(err, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":  # MLflow answered: the run is gone
            status.mlflow_note = (f"{status.tracking_uri} has no run {status.mlflow_run_id} (deleted, or another "
                                  f"store than the one the run logged to?) ({detail})")
        else:
            status.mlflow_down = True
            status.mlflow_note = (f"MLflow at {status.tracking_uri} did not answer ({detail}); what is shown above "
                                  "is what storage holds")
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
        value, best = _last(metrics, status.metric), _last(metrics, f"best/{status.metric}")
        if value is not None or best is not None:  # else keep what a finished trial's record said
            run.value, run.best = value, best if best is not None else value
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


def _stopped(status: Status, mlflow_status: str | None, finished_in_storage: bool) -> bool:
    """No launcher drives it and it did not finish: MLflow's RUNNING is a run nobody ended (a killed launcher's);
    with MLflow silent, a killed launcher is enough to know."""
    if status.launcher_alive is not False or finished_in_storage:
        return False
    return mlflow_status == "RUNNING" or (mlflow_status is None and status.launcher_died)


def _gone(status: Status) -> str:
    return "stopped when its launcher died" if status.launcher_died else "stopped: no launcher drives it"


def _state(status: Status, run: RunState) -> tuple[str, str]:
    """(what it counts as, what its line says): MLflow's status, corrected by what storage and the lock know."""
    still = " (MLflow still says RUNNING)" if run.status == "RUNNING" else ""
    if _stopped(status, run.status, run.finished_in_storage):
        return "stopped", _gone(status) + still
    if run.finished_in_storage and run.status in (None, "RUNNING"):
        return "FINISHED", "FINISHED in storage" + (still if status.launcher_alive is False else "") + \
            ("; MLflow did not answer" if status.mlflow_down else "")
    if run.status is not None:
        return run.status, run.status
    return "unknown", "MLflow did not answer" if status.mlflow_down else "no MLflow run"


def _headline(status: Status) -> str:
    finished_in_storage = status.kind == "run" and bool(status.runs) and status.runs[0].finished_in_storage
    if _stopped(status, status.mlflow_status, finished_in_storage):
        return _gone(status) + (" (MLflow still says RUNNING)" if status.mlflow_status == "RUNNING" else "")
    if status.mlflow_status:
        return f"MLflow {status.mlflow_status}"
    return f"MLflow at {status.tracking_uri} did not answer" if status.mlflow_down else "not in MLflow"


def _step(run: RunState) -> str:
    if run.step is not None:
        return str(run.step)
    return "-" if run.checkpointed_step is None else f"{run.checkpointed_step}"


def format_status(status: Status) -> str:
    """The lines `orchestrator status` prints."""
    states = [_state(status, run) for run in status.runs]
    counts = {kind: sum(state == kind for state, _ in states) for kind in ("FINISHED", "FAILED", "RUNNING")}
    done, failed, running = counts["FINISHED"], counts["FAILED"], counts["RUNNING"]
    head = _headline(status)
    lines = [f"{status.kind} {status.name}: {head}; launcher {status.launcher}", f"storage: {status.folder}"]
    if status.kind == "sweep":
        others = len(status.runs) - done - failed - running
        pending = max(0, status.expected - len(status.runs))
        lines.append(f"trials: {status.expected}: {done} finished, {running} running, {failed} failed, "
                     f"{others} stopped or unknown, {pending} not started")
    for run, (_, words) in zip(status.runs, states):
        # Without MLflow's step, the last checkpoint's says how far the run got at least.
        from_storage = " (last checkpoint)" if run.step is None and run.checkpointed_step is not None else ""
        lines.append(f"  {run.label}: {words}, step {_step(run)}/{status.max_steps}{from_storage}, {status.metric} "
                     f"{_value(run.value)} (best {_value(run.best)})"
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
    if head.startswith("stopped") or any(state == "stopped" for state, _ in states):
        who = ("its trials stopped when their launcher died" if status.kind == "sweep" else
               "it stopped when its launcher died") if status.launcher_died else \
            "no launcher drives it (none holds its lock), so nothing runs"
        lines.append(f"next: {who}; {status.next_step}")
    return "\n".join(lines)


def _storage_problem(name: str, storage: str, err: OSError) -> str:
    """One line for a storage that cannot be read: the flags that say where it is, and their fix."""
    first = (str(err).strip().splitlines() or [""])[0][:200].rstrip("; ")
    read = f"cannot read {name!r} from --storage-path {storage}"
    if not is_remote(storage):
        return f"{read}: {type(err).__name__}: {first}; give the spec's run.storage_path folder as --storage-path"
    where = (f"the endpoint {endpoint()}" if endpoint() else "AWS S3 (no endpoint set)") if is_s3(storage) else ""
    fix = ("check the bucket and prefix in --storage-path, and give the URL of a store that runs with "
           "--storage-endpoint URL (or AWS_ENDPOINT_URL_S3; neither for AWS S3), its credentials as "
           "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY") if is_s3(storage) else \
        "check --storage-path and this machine's access to it"
    return f"{read}{' at ' + where if where else ''}: {type(err).__name__}: {first}; {fix}"


def status_cli(name: str, storage: str) -> int:
    """Exit 2 when storage cannot be read: --storage-path (or --storage-endpoint) is what to fix."""
    try:
        status = read_status(name, resolve(storage))
    except OSError as err:
        print(f"orchestrator status: {_storage_problem(name, resolve(storage), err)}", file=sys.stderr)
        return 2
    print(format_status(add_mlflow(status)))
    return 0

