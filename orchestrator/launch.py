"""Launching: a TorchTrainer for one run, a Tuner of driver trials for a sweep, and resume of both.

Ray Train V2 (default since Ray 2.51, pinned on here) refuses `Tuner(trainer)`: a sweep trial is a
*driver function* that builds and fits its own TorchTrainer and forwards rank 0's reports to Tune with
`TuneReportCallback` (Ray doc_code/train_tune_interop.py). Names come from the spec and trial ids,
never timestamps, so re-running with the same (storage_path, name) resumes instead of starting over.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray
import yaml

from orchestrator.search_space import grid_points, resolve, to_param_space
from orchestrator.finalize import final_evaluation
from orchestrator.spec import (
    ExperimentSpec,
    SpecError,
    Study,
    check_gpus,
    spec_to_yaml,
    study_from_raw,
    validate_spec,
)
from orchestrator.tracking import (
    RUN_KEY_TAG,
    TRIAL_TAG,
    MlflowTracker,
    RunHandle,
    flatten,
    git_commit,
    run_handle,
)
from orchestrator.trainer import Cadence
from orchestrator.worker_config import WORKER_CONFIG, WorkerConfig

PROJECT_ROOT = Path(__file__).resolve().parents[1]
META_FILE = "orchestrator.json"
"""Written next to a run's or sweep's Ray files: what `orchestrator resume NAME` needs (spec, MLflow ids)."""
TRIALS_DIR = "trials"
"""Sub-folder of a sweep holding the Train run of each trial."""


class LaunchError(RuntimeError):
    """A run or sweep cannot be started or resumed; the message says why and what to do."""


# --- Ray ---------------------------------------------------------------------------------------------


def ray_runtime_env() -> dict[str, Any]:
    """Environment of every Ray worker: Train V2 on, trial drivers stay in the launcher's cwd (relative data
    paths keep working), and this checkout importable even when it is not pip-installed."""
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"RAY_TRAIN_V2_ENABLED": "1", "RAY_CHDIR_TO_TRIAL_DIR": "0", "PYTHONPATH": pythonpath}}


def connect() -> None:
    """Join the cluster named by RAY_ADDRESS (e.g. under `ray job submit`), else start a local one."""
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # read when ray.train is first imported
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        # A cluster (e.g. under `ray job submit`): the job's own runtime_env applies; nodes have the project
        # installed (cluster.yaml setup_commands) and Train V2 is Ray 2.60's default.
        ray.init(address=address)
    else:
        ray.init(runtime_env=ray_runtime_env())


def _check_cluster(spec: ExperimentSpec) -> dict[str, float]:
    resources = ray.cluster_resources()
    check_gpus(spec, resources.get("GPU", 0.0), "the connected Ray cluster")
    need_cpu = spec.run.workers * spec.run.cpus_per_worker
    if need_cpu > resources.get("CPU", 0.0):
        raise SpecError(
            f"run.workers={spec.run.workers} x run.cpus_per_worker={spec.run.cpus_per_worker:g} asks for "
            f"{need_cpu:g} CPUs but the Ray cluster has {resources.get('CPU', 0.0):g}; lower one of them"
        )
    return resources


def max_concurrent_trials(spec: ExperimentSpec, resources: Mapping[str, float]) -> int:
    """Trials that fit at once: total GPUs / GPUs per trial; on CPU, CPUs / (workers x cpus + 1 driver CPU)."""
    if spec.tune.max_concurrent is not None:
        return spec.tune.max_concurrent
    if spec.run.gpus_per_run > 0:
        return max(1, int(resources.get("GPU", 0.0) // spec.run.gpus_per_run))
    per_trial = spec.run.workers * spec.run.cpus_per_worker + 1
    return max(1, int(resources.get("CPU", 1.0) // per_trial))


# --- storage metadata ---------------------------------------------------------------------------------


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def _fs(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    return pyarrow.fs.FileSystem.from_uri(uri)


def read_meta(storage_path: str, name: str) -> dict[str, Any] | None:
    fs, path = _fs(_join(storage_path, name, META_FILE))
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read().decode())


def write_meta(storage_path: str, name: str, meta: Mapping[str, Any]) -> None:
    fs, path = _fs(_join(storage_path, name, META_FILE))
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(json.dumps(meta, indent=2).encode())


def cache_dir_of(storage_path: str) -> str:
    """Tokenizers and prepared data: next to the runs when storage is local, else in the user's cache."""
    if "://" not in storage_path:
        return str(Path(storage_path) / ".cache")
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attention-orchestrator")


def _cache_dir(spec: ExperimentSpec) -> str:
    return cache_dir_of(spec.run.storage_path)


def _tracker(spec: ExperimentSpec) -> MlflowTracker:
    return MlflowTracker(spec.tracking.uri, retries=spec.tracking.retries, timeout_s=spec.tracking.timeout_s)


# --- one run -------------------------------------------------------------------------------------------


def build_trainer(spec: ExperimentSpec, *, run_name: str, storage_path: str, worker: WorkerConfig,
                  callbacks: list | None = None):
    """The TorchTrainer of one run: DDP over `run.workers` ranks; Ray keeps the `run.keep_checkpoints` best
    checkpoints by the spec's metric plus always the latest (for resume)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from orchestrator.worker import train_loop_per_worker

    resources = {"CPU": spec.run.cpus_per_worker}
    if spec.run.gpus_per_worker:
        resources["GPU"] = spec.run.gpus_per_worker
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={WORKER_CONFIG: worker},
        scaling_config=ScalingConfig(num_workers=spec.run.workers, use_gpu=spec.run.gpus_per_worker > 0,
                                     resources_per_worker=resources),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=spec.run.max_failures),
            # Every checkpoint step is an evaluation step (trainer.Cadence), so every checkpoint has the score.
            checkpoint_config=CheckpointConfig(num_to_keep=spec.run.keep_checkpoints,
                                               checkpoint_score_attribute=spec.metric,
                                               checkpoint_score_order=spec.mode),
            callbacks=callbacks or [],
        ),
    )


def _handle(spec: ExperimentSpec, *, run_name: str, role: str, commit: str, key: tuple[str, str],
            parent_run_id: str | None = None) -> RunHandle:
    return run_handle(flatten(spec.model_dump(mode="json")), spec_to_yaml(spec), experiment=spec.tracking.experiment or spec.name,
                      run_name=run_name, role=role, kind=spec.model.attention.kind, commit=commit, key=key,
                      parent_run_id=parent_run_id)


def _fit_and_finish(spec: ExperimentSpec, trainer: Any, handle: RunHandle, tracker: MlflowTracker,
                    cache_dir: str) -> tuple[Any, str | None, dict[str, float]]:
    """Fit, score the best checkpoint on the test split, and end the MLflow run (FAILED if anything raised).
    The run id is looked up again: the worker may have created the run after an outage at launch."""
    status, run_id = "FAILED", handle.run_id
    try:
        result = trainer.fit()
        run_id = run_id or tracker.ensure_run(handle)
        try:
            final = final_evaluation(spec, result, cache_dir=cache_dir, run_id=run_id)
        except Exception as err:  # noqa: BLE001 - training is done and checkpointed: say how to score it later
            final = {}
            message = f"{type(err).__name__}: {str(err)[:500]}"
            print(f"[{spec.name}] final evaluation failed ({message}); the trained checkpoints are kept: "
                  f"score them with `orchestrator evaluate {spec.name} --storage-path {spec.run.storage_path}`")
            if run_id is not None:
                tracker.set_tags(run_id, {"test.error": message})
        status = "FINISHED"
        return result, run_id, final
    finally:
        run_id = run_id or tracker.ensure_run(handle)
        if run_id is not None:
            tracker.end_run(run_id, status)


@dataclass(frozen=True)
class RunOutcome:
    name: str
    path: str
    """Storage folder of the Train run (checkpoints, Ray's state)."""
    metrics: dict[str, Any]
    """The last report of rank 0."""
    checkpoint: str | None
    mlflow_run_id: str | None


def _existing_meta(storage: str, name: str, resume: bool) -> dict[str, Any] | None:
    """The stored metadata of run/sweep `name`, refusing to start a new one over it unless resuming."""
    meta = read_meta(storage, name)
    if meta is not None and not resume:
        raise LaunchError(
            f"a {meta.get('kind', 'run')} named {name!r} already exists in {storage}; continue it with "
            f"`orchestrator resume {name} --storage-path {storage}`, or give this one another name (name=...)"
        )
    return meta


def run_training(spec: ExperimentSpec, *, resume: bool = False, fail_at_step: int | None = None) -> RunOutcome:
    """Train one run under Ray Train. `resume=True` continues the run of the same name from its latest
    checkpoint (same RunConfig(name, storage_path), same MLflow run). `fail_at_step` raises inside the
    worker after that step's report: a fault-injection hook for testing resume."""
    from ray.train import TrainingFailedError

    storage = spec.run.storage_path
    meta = _existing_meta(storage, spec.name, resume)
    if meta is None and resume:
        raise LaunchError(f"no run named {spec.name!r} in {storage}; start it with `orchestrator train`")
    connect()
    _check_cluster(spec)
    commit = (meta or {}).get("commit") or git_commit()
    tracker = _tracker(spec)
    handle = _handle(spec, run_name=spec.name, role="run", commit=commit,
                     key=(RUN_KEY_TAG, _join(storage, spec.name))).with_run_id((meta or {}).get("mlflow_run_id"))
    handle = handle.with_run_id(tracker.ensure_run(handle))
    write_meta(storage, spec.name, {"kind": "run", "name": spec.name, "spec": spec.model_dump(mode="json"),
                                    "mlflow_run_id": handle.run_id, "commit": commit})
    worker = WorkerConfig(spec=spec.model_dump(mode="json"), run=handle, label=spec.name,
                          cache_dir=_cache_dir(spec), fail_at_step=fail_at_step)
    trainer = build_trainer(spec, run_name=spec.name, storage_path=storage, worker=worker)
    try:
        result, run_id, final = _fit_and_finish(spec, trainer, handle, tracker, _cache_dir(spec))
    except TrainingFailedError as err:
        raise LaunchError(
            f"run {spec.name!r} failed after {spec.run.max_failures} restart(s): {err}\n"
            f"continue it from its last checkpoint with `orchestrator resume {spec.name} --storage-path {storage}`"
        ) from err
    return RunOutcome(name=spec.name, path=result.path, metrics={**dict(result.metrics or {}), **final},
                      checkpoint=result.checkpoint.path if result.checkpoint else None, mlflow_run_id=run_id)


# --- sweeps --------------------------------------------------------------------------------------------


def _trial_driver(config: dict[str, Any], *, study_raw: dict[str, Any], parent_run_id: str | None,
                  commit: str, fail_at_step: int | None = None) -> None:
    """One Tune trial: resolve its spec, open its child MLflow run, build and fit its TorchTrainer."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    trial_id = tune.get_context().get_trial_id()
    spec = validate_spec(resolve(study_raw, config), where=f"trial {trial_id}")
    run_name = f"{spec.name}-{trial_id}"
    tracker = _tracker(spec)
    # Found by trial id first: a retried or restored trial keeps its child run.
    handle = _handle(spec, run_name=run_name, role="trial", commit=commit, key=(TRIAL_TAG, trial_id),
                     parent_run_id=parent_run_id)
    handle = handle.with_run_id(tracker.ensure_run(handle))
    worker = WorkerConfig(spec=spec.model_dump(mode="json"), run=handle, label=f"{spec.name} {trial_id}",
                          cache_dir=_cache_dir(spec), fail_at_step=fail_at_step)
    trainer = build_trainer(spec, run_name=f"train-{trial_id}",
                            storage_path=_join(spec.run.storage_path, spec.name, TRIALS_DIR),
                            worker=worker, callbacks=[TuneReportCallback()])
    _fit_and_finish(spec, trainer, handle, tracker, _cache_dir(spec))


def _tune_config(study: Study, resources: Mapping[str, float]):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    spec = study.base
    settings = spec.tune
    if settings.scheduler == "asha":
        # One ASHA time unit = one report = one evaluation; max_t is the last one.
        # stop_last_trials=False: a trial that reaches max_t ends by itself. Stopping it from Tune at its last
        # report would kill its driver while the Train run is still shutting down (cf. ray#54305).
        scheduler = ASHAScheduler(time_attr="training_iteration", max_t=Cadence.of(spec).report_count(),
                                  grace_period=settings.grace_period, reduction_factor=settings.reduction_factor,
                                  stop_last_trials=False)
    else:
        scheduler = FIFOScheduler()
    search_alg = None
    if settings.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search_alg = OptunaSearch(seed=spec.optim.seed)
    return tune.TuneConfig(metric=spec.metric, mode=spec.mode, scheduler=scheduler, search_alg=search_alg,
                           num_samples=settings.num_samples,
                           max_concurrent_trials=max_concurrent_trials(spec, resources),
                           trial_name_creator=_trial_name, trial_dirname_creator=_trial_name)


def _trial_name(trial: Any) -> str:
    """`trial_<id>`: the id alone names a trial everywhere (Tune folder, Train run, MLflow child run)."""
    return f"trial_{trial.trial_id}"


@dataclass(frozen=True)
class SweepOutcome:
    name: str
    path: str
    parent_run_id: str | None
    trials: list[dict[str, Any]]
    """Per trial: id, config, status, last metrics."""
    best: dict[str, Any] | None
    errors: int
    interrupted: bool = False
    """Tuner.fit returned before every trial ended (Ctrl-C); `orchestrator resume NAME` continues it."""


def _trainable(study: Study, parent_run_id: str | None, commit: str, fail_at_step: int | None = None):
    from ray import tune

    driver = tune.with_parameters(_trial_driver, study_raw=study.raw, parent_run_id=parent_run_id, commit=commit,
                                  fail_at_step=fail_at_step)
    # The driver only waits on its Train run; its 1 CPU is the "+1" of max_concurrent_trials.
    return tune.with_resources(driver, {"CPU": 1})


def run_sweep(study: Study, *, resume: bool = False, fail_at_step: int | None = None) -> SweepOutcome:
    """A Tune sweep: one driver trial per configuration, a parent MLflow run with a child per trial.
    `resume=True` restores the Tuner: unfinished and errored trials resume under their own trial ids, so each
    driver reopens its child MLflow run and its Train run restores from its own latest checkpoint.
    `fail_at_step` makes every trial's worker raise after that step, as in run_training: a fault-injection
    hook for testing resume. The trainable is rebuilt on restore, so a resumed sweep runs without it."""
    from ray import tune

    spec = study.base
    storage = spec.run.storage_path
    meta = _existing_meta(storage, spec.name, resume)
    connect()
    resources = _check_cluster(spec)
    commit = (meta or {}).get("commit") or git_commit()
    tracker = _tracker(spec)
    sweep_params = {f"tune.{k}": v for k, v in flatten(spec.tune.model_dump(mode="json")).items()}
    sweep_params.update({"sweep.domains": ", ".join(d.path for d in study.domains) or "(none)"})
    parent = run_handle(sweep_params, yaml.safe_dump(study.raw, sort_keys=False),
                        experiment=spec.tracking.experiment or spec.name, run_name=spec.name, role="sweep",
                        kind=None, commit=commit, key=(RUN_KEY_TAG, _join(storage, spec.name)))
    parent_run_id = tracker.ensure_run(parent.with_run_id((meta or {}).get("parent_run_id")))
    write_meta(storage, spec.name, {"kind": "sweep", "name": spec.name, "raw": study.raw,
                                    "parent_run_id": parent_run_id, "commit": commit})

    trainable = _trainable(study, parent_run_id, commit, fail_at_step)
    sweep_path = _join(storage, spec.name)
    if resume and tune.Tuner.can_restore(sweep_path):
        # resume_errored, not restart_errored: a restarted trial is reset to a new trial id, which would start a
        # new Train run from scratch under a new child MLflow run.
        tuner = tune.Tuner.restore(sweep_path, trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=to_param_space(study.domains, spec.tune.search),
            tune_config=_tune_config(study, resources),
            run_config=tune.RunConfig(name=spec.name, storage_path=storage,
                                      failure_config=tune.FailureConfig(max_failures=spec.tune.max_failures)),
        )
    grid = tuner.fit()
    trials = []
    for result in grid:
        metrics = dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or Path(result.path).name
        trials.append({"trial_id": trial_id, "config": {k: v for k, v in (result.config or {}).items()},
                       "error": repr(result.error) if result.error else None,
                       "metrics": {k: v for k, v in metrics.items() if "/" in k or k in ("step", "training_iteration")}})
    _close_children(tracker, spec, trials)
    # Ctrl-C (or a lost driver) makes Tuner.fit return early: fewer trials ended than the sweep holds.
    interrupted = grid.num_terminated + grid.num_errors < max(len(grid), expected_trials(study))
    if parent_run_id and not interrupted:
        tracker.end_run(parent_run_id, "FAILED" if grid.num_errors else "FINISHED")
    best = None
    try:
        best_result = grid.get_best_result(metric=spec.metric, mode=spec.mode, scope="all")
        best = {"config": best_result.config, "metrics": dict(best_result.metrics or {})}
    except RuntimeError:
        best = None  # no trial reported the metric
    return SweepOutcome(name=spec.name, path=grid.experiment_path, parent_run_id=parent_run_id, trials=trials,
                        best=best, errors=grid.num_errors, interrupted=interrupted)


def expected_trials(study: Study) -> int:
    """Trials the sweep runs: every grid combination num_samples times, or num_samples draws."""
    settings = study.base.tune
    per_sample = len(grid_points(study.domains)) if settings.search == "grid" else 1
    return per_sample * settings.num_samples


def _close_children(tracker: MlflowTracker, spec: ExperimentSpec, trials: list[dict[str, Any]]) -> None:
    """Trials ASHA stopped were killed mid-run: mark their still-RUNNING child runs KILLED."""
    experiment_id = tracker.experiment_id(spec.tracking.experiment or spec.name)
    if experiment_id is None:
        return
    for trial in trials:
        run_id = tracker.find_run(experiment_id, TRIAL_TAG, str(trial["trial_id"]))
        if run_id is None:
            continue
        trial["mlflow_run_id"] = run_id
        if tracker.run_status(run_id) == "RUNNING":
            tracker.end_run(run_id, "FAILED" if trial["error"] else "KILLED")


# --- resume --------------------------------------------------------------------------------------------


def resume(name: str, storage_path: str) -> RunOutcome | SweepOutcome:
    """Continue the run or sweep `name` stored under `storage_path`, from what it stored there."""
    storage = storage_path if "://" in storage_path else str(Path(storage_path).expanduser().resolve())
    meta = read_meta(storage, name)
    if meta is None:
        raise LaunchError(f"nothing named {name!r} in {storage} (no {META_FILE}); check the name and --storage-path")
    if meta["kind"] == "run":
        return run_training(validate_spec(meta["spec"], where=f"stored spec of {name}"), resume=True)
    return run_sweep(study_from_raw(meta["raw"]), resume=True)
