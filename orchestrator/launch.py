"""Launching: a TorchTrainer for one run, a Tuner of driver trials for a sweep, and resume of both.

Ray Train V2 (default since Ray 2.51, pinned on here) refuses `Tuner(trainer)`: a sweep trial is a
*driver function* that builds and fits its own TorchTrainer and forwards rank 0's reports to Tune with
`TuneReportCallback` (Ray doc_code/train_tune_interop.py). Names come from the spec and trial ids,
never timestamps, so re-running with the same (storage_path, name) resumes instead of starting over.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray
import yaml

from orchestrator.checkpoint import cache_dir_of, checkpoint_steps, diverged
from orchestrator.checkpoint import join as _join
from orchestrator.checkpoint import storage_fs as _fs
from orchestrator.cluster_resources import HEAD_RESOURCE, ClusterView, view_cluster
from orchestrator.finalize import final_evaluation
from orchestrator.preflight import (
    LOCK_FILE,
    LaunchError,
    check_data_files,
    check_labelled_data,
    check_multi_node,
    check_tracking,
    name_lock,
)
from orchestrator.pretrained import CHECKPOINTS_TAG
from orchestrator.pretrained import preflight as check_init_from
from orchestrator.progress import SweepProgress, describe_config, set_verbose, verbose
from orchestrator.ray_env import start_local_ray, train_worker_env, use_train_v2
from orchestrator.search_space import (
    grid_points,
    resolve,
    to_param_space,
    validation_points,
)
from orchestrator.spec import (
    ExperimentSpec,
    SpecError,
    Study,
    apply_resume_overrides,
    check_gpus,
    spec_to_yaml,
    study_from_raw,
    validate_spec,
)
from orchestrator.sweep_summary import summarize_sweep
from orchestrator.tracking import (
    RUN_KEY_TAG,
    SPOOL_FILE,
    TRIAL_TAG,
    MlflowTracker,
    RunHandle,
    flatten,
    git_commit,
    portable_params,
    run_handle,
)
from orchestrator.worker_config import WORKER_CONFIG, WorkerConfig

META_FILE = "orchestrator.json"
"""Written next to a run's or sweep's Ray files: what `orchestrator resume NAME` needs (spec, MLflow ids)."""
TRIALS_DIR = "trials"
"""Sub-folder of a sweep holding the Train run of each trial."""
PRETRAIN_DIR = "pretrain"
"""Sub-folder of a two-stage run holding its pretraining stage's Train run (a trial's is trials/pretrain-<id>)."""


# --- Ray ---------------------------------------------------------------------------------------------


def connect() -> None:
    """Join the cluster named by RAY_ADDRESS (e.g. under `ray job submit`), else start a local one
    (orchestrator/ray_env.py says what its processes get); Ray's own logs as quiet as the launcher's verbosity
    says (orchestrator/ray_console.py)."""
    use_train_v2()
    # Tune copies this variable from the launcher's environment into every trial actor's (tune/execution/
    # class_cache.py), on a local Ray and on a cluster joined through RAY_ADDRESS alike, where the job's runtime
    # env applies: trial drivers then stay in the launcher's working directory.
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    if ray.is_initialized():
        return
    from orchestrator.ray_console import ray_init_kwargs  # imports ray.train, as V2 since use_train_v2()

    address = os.environ.get("RAY_ADDRESS")
    if address:
        # A cluster (e.g. under `ray job submit`): the job's own runtime_env applies; nodes have the project
        # installed (cluster.yaml setup_commands) and Train V2 is Ray 2.60's default.
        ray.init(address=address, **ray_init_kwargs())
    else:
        start_local_ray(**ray_init_kwargs())


def _check_cluster(spec: ExperimentSpec) -> ClusterView:
    """The connected cluster can run `spec`: its GPUs and CPUs, counting what the autoscaler may add (a run
    that fits only after scale-up is let through: its worker group's request makes the autoscaler add the
    nodes), and storage and tracking every node reaches when there are several."""
    cluster = view_cluster()
    where = "the connected Ray cluster" + (" at its autoscaler's largest" if cluster.autoscaling else "")
    check_gpus(spec, cluster.most("GPU"), where)
    need_cpu = spec.run.workers * spec.run.cpus_per_worker
    if need_cpu > cluster.most("CPU"):
        raise SpecError(
            f"run.workers={spec.run.workers} x run.cpus_per_worker={spec.run.cpus_per_worker:g} asks for "
            f"{need_cpu:g} CPUs but {where} has {cluster.most('CPU'):g}; lower one of them"
        )
    check_multi_node(spec, cluster.nodes, cluster.autoscaling)
    return cluster


DRIVER_RESOURCES = {HEAD_RESOURCE: 0.001}
"""What a sweep's trial driver reserves: a sliver of the head node, and no CPU. On the head, a driver outlives
the loss of any worker node (spot GPU nodes), so a lost node costs its Train workers only, which Ray Train
restarts from the latest checkpoint under the same driver and MLflow child run; the head's CPUs may be 0
(kept free of training). Ray Train V2 puts a run's workers in a placement group of its own, made by the run's
controller: a Tune trial's placement group cannot hold them (Ray has no nested placement groups), so bundles
for them there would reserve every worker twice. The driver only waits on its Train run; holding a whole CPU,
drivers admitted on `resume` (Tune restarts every unfinished trial at once) took the CPUs their own workers
needed and no worker group ever started. Holding none, trials beyond what fits wait for their worker group,
and start as others end (or as the autoscaler adds nodes for them). 0.001 of the head: up to 1000 drivers."""


def max_concurrent_trials(spec: ExperimentSpec, cluster: ClusterView) -> int:
    """Trials that fit at once when the autoscaler has added every node it may: GPUs / GPUs per trial; on
    CPU, CPUs / (workers x cpus per worker). More would only wait for their worker groups."""
    if spec.tune.max_concurrent is not None:
        return spec.tune.max_concurrent
    if spec.run.gpus_per_run > 0:
        return max(1, int(cluster.most("GPU") // spec.run.gpus_per_run))
    per_trial = spec.run.workers * spec.run.cpus_per_worker
    return max(1, int(cluster.most("CPU") // per_trial))


# --- storage metadata ---------------------------------------------------------------------------------


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


def _cache_dir(spec: ExperimentSpec) -> str:
    return cache_dir_of(spec.run.storage_path)


def spool_of(run_path: str) -> str | None:
    """The metric spool of a Train run's folder; None on remote storage (the buffer stays in memory)."""
    return None if "://" in run_path else str(Path(run_path) / SPOOL_FILE)


def _tracker(spec: ExperimentSpec, run_path: str | None = None) -> MlflowTracker:
    spool = spool_of(run_path) if run_path else None
    return MlflowTracker(spec.tracking.uri, retries=spec.tracking.retries, timeout_s=spec.tracking.timeout_s,
                         spool=Path(spool) if spool else None)


def _subfolders(path: str) -> list[str]:
    fs, fs_path = _fs(path)
    return [info.base_name for info in fs.get_file_info(pyarrow.fs.FileSelector(fs_path, allow_not_found=True))
            if info.type == pyarrow.fs.FileType.Directory]


def has_checkpoint(storage: str, name: str) -> bool:
    """Run `name`, or a trial of sweep `name`, wrote a checkpoint: it can be resumed, and its name is taken."""
    folder = _join(storage, name)
    if checkpoint_steps(folder) or checkpoint_steps(_join(folder, PRETRAIN_DIR)):
        return True
    trials = _join(folder, TRIALS_DIR)
    return any(checkpoint_steps(_join(trials, trial)) for trial in _subfolders(trials))


def next_step(storage: str, name: str) -> str:
    """What to do after a failure: resume only when there is a checkpoint to resume from."""
    if has_checkpoint(storage, name):
        return f"continue it from its last checkpoint with `orchestrator resume {name} --storage-path {storage}`"
    return "it stopped before its first checkpoint, so its name is free: fix the cause and start it again"


def failure_reason(err: BaseException) -> str:
    """One line: the exception a Ray worker (or trial) raised, without Ray's wrapping and tracebacks."""
    causes = list(getattr(err, "worker_failures", {}).values()) or [getattr(err, "controller_failure", None) or err]
    lines = [line.strip() for line in str(causes[0]).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Loss|Failure|Interrupt)\b.*:", line)]
    text = (named or lines or [type(causes[0]).__name__])[-1]
    return text if len(text) <= 400 else text[:400] + "..."


def _claim(spec: ExperimentSpec, kind: str, resume: bool, tracker: MlflowTracker) -> dict[str, Any] | None:
    """The stored metadata of `spec.name` when resuming; None for a new start. A name with a checkpoint is
    taken (refused with the resume command); one whose every attempt stopped before its first checkpoint is
    free: that attempt's folder is cleared and its MLflow run, marked FAILED, no longer answers to the name."""
    storage, name = spec.run.storage_path, spec.name
    meta = read_meta(storage, name)
    started = meta is not None and has_checkpoint(storage, name)
    if resume:
        if meta is None:
            raise LaunchError(f"nothing named {name!r} in {storage} (no {META_FILE}); check the name and --storage-path")
        if not started and meta.get("status") != "FINISHED":
            raise LaunchError(f"{meta.get('kind', 'run')} {name!r} stopped before its first checkpoint: there is "
                              f"nothing to resume; start it again with `orchestrator {'train' if meta.get('kind') == 'run' else 'sweep'} "
                              "SPEC` (the name is free)")
        return meta
    if meta is None:
        return None
    if started:
        raise LaunchError(
            f"a {meta.get('kind', 'run')} named {name!r} already exists in {storage}; continue it with "
            f"`orchestrator resume {name} --storage-path {storage}`, or give this one another name (name=...)"
        )
    print(f"[{name}] an earlier {meta.get('kind', 'run')} of this name stopped before its first checkpoint; "
          "starting anew")
    for run_id in filter(None, (meta.get("mlflow_run_id"), meta.get("parent_run_id"))):
        tracker.set_tags(run_id, {RUN_KEY_TAG: f"{_join(storage, name)} (abandoned before its first checkpoint)"})
        if tracker.run_status(run_id) == "RUNNING":
            tracker.end_run(run_id, "FAILED")
    fs, path = _fs(_join(storage, name))
    for info in fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True)):
        if info.base_name == LOCK_FILE:
            continue  # ours
        if info.type == pyarrow.fs.FileType.Directory:
            fs.delete_dir(info.path)
        else:
            fs.delete_file(info.path)
    return None


# --- one run -------------------------------------------------------------------------------------------


def build_trainer(spec: ExperimentSpec, *, run_name: str, storage_path: str, worker: WorkerConfig,
                  callbacks: list | None = None):
    """The TorchTrainer of one run: DDP or FSDP over `run.workers` ranks, whose collectives time out after
    run.collective_timeout_s; Ray keeps the `run.keep_checkpoints` best checkpoints by the spec's metric plus
    always the latest (for resume)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from orchestrator.ray_console import train_logging_config
    from orchestrator.worker import train_loop_per_worker

    resources = {"CPU": spec.run.cpus_per_worker}
    if spec.run.gpus_per_worker:
        resources["GPU"] = spec.run.gpus_per_worker
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={WORKER_CONFIG: worker},
        # Rank 0 evaluates alone while the others wait in their next collective: the timeout must outlast it.
        torch_config=TorchConfig(timeout_s=spec.run.collective_timeout_s),
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
            logging_config=train_logging_config(),
            worker_runtime_env=train_worker_env(),
        ),
    )


def _handle(spec: ExperimentSpec, *, run_name: str, role: str, commit: str, key: tuple[str, str],
            run_path: str, parent_run_id: str | None = None) -> RunHandle:
    handle = run_handle(portable_params(spec.model_dump(mode="json")), spec_to_yaml(spec),
                        experiment=spec.tracking.experiment or spec.name, run_name=run_name, role=role,
                        kind=spec.model.attention.kind, commit=commit, key=key, parent_run_id=parent_run_id)
    # Where the run's checkpoints are: how `model.init_from=<MLflow run id>` finds them.
    return replace(handle, tags={**handle.tags, CHECKPOINTS_TAG: run_path})


def _trained_to(run_path: str, max_steps: int) -> bool:
    """The Train run at `run_path` checkpointed its last step (a finished stage is not run again)."""
    return max(checkpoint_steps(run_path).values(), default=-1) >= max_steps


def _pretrain(spec: ExperimentSpec, *, storage_path: str, run_name: str, mlflow_name: str, commit: str,
              parent_run_id: str | None, label: str) -> ExperimentSpec:
    """Stage 1 of a two-stage spec (`pretrain:`): its own Train run in `storage_path/run_name` and its own MLflow
    run (role pretrain, next to the fine-tuning run); skipped when it already reached its last step (a resumed
    run or trial). Returns stage 2: the spec fine-tuning from that run's best checkpoint."""
    stage = spec.pretraining_spec()
    run_path = _join(storage_path, run_name)
    if _trained_to(run_path, stage.optim.max_steps):
        print(f"[{label}] pretraining stage done before ({run_path}); fine-tuning from it")
        return spec.finetuning_spec(run_path)
    tracker = _tracker(stage, run_path)
    handle = _handle(stage, run_name=mlflow_name, role="pretrain", commit=commit, key=(RUN_KEY_TAG, run_path),
                     run_path=run_path, parent_run_id=parent_run_id)
    handle = handle.with_run_id(tracker.ensure_run(handle))
    worker = WorkerConfig(spec=stage.model_dump(mode="json"), run=handle, label=f"{label} pretrain",
                          cache_dir=_cache_dir(stage), run_path=run_path, spool=spool_of(run_path))
    trainer = build_trainer(stage, run_name=run_name, storage_path=storage_path, worker=worker)
    _fit_and_finish(stage, trainer, handle, tracker, _cache_dir(stage), label=f"{label} pretraining", advice=None)
    return spec.finetuning_spec(run_path)


def _stage_to_train(spec: ExperimentSpec, *, storage_path: str, run_name: str, mlflow_name: str, commit: str,
                    parent_run_id: str | None, label: str) -> tuple[ExperimentSpec, str | None]:
    """The spec a run's workers train and the checkpoint they start from: a two-stage spec runs its pretraining
    stage first and fine-tunes from it; a spec with model.init_from starts from that checkpoint (checked again
    here: it may have changed since the launcher's preflight); any other spec trains from scratch."""
    if spec.pretrain is not None:
        spec = _pretrain(spec, storage_path=storage_path, run_name=run_name, mlflow_name=mlflow_name,
                         commit=commit, parent_run_id=parent_run_id, label=label)
    pretrained = check_init_from(spec)
    return spec, pretrained.location if pretrained is not None else None


def _fit_and_finish(spec: ExperimentSpec, trainer: Any, handle: RunHandle, tracker: MlflowTracker,
                    cache_dir: str, *, label: str, advice: str | None) -> tuple[Any, str | None, dict[str, float]]:
    """Fit, score the best checkpoint on the test split, and end the MLflow run on every exit path: FINISHED
    only when training reached optim.max_steps, KILLED on Ctrl-C, FAILED when anything raised. A failure is a
    LaunchError of one line, with `advice` (None: the caller says what to do). The run id is looked up again:
    the worker may have created the run after an outage at launch."""
    from ray.train import TrainingFailedError

    status, run_id = "FAILED", handle.run_id
    hint = f"\n{advice}" if advice else ""
    try:
        try:
            # A retried trial or a resume of a run that diverged (run.stop_on_nan) would diverge again: say so now,
            # instead of starting its workers to train back to the same step.
            reason = diverged(_join(trainer.run_config.storage_path, trainer.run_config.name))
            if reason is not None:
                raise LaunchError(f"{label} failed: NonFiniteLoss: {reason}{hint}")
            result = trainer.fit()
        except TrainingFailedError as err:
            raise LaunchError(f"{label} failed: {failure_reason(err)}{hint}") from None
        step = (result.metrics or {}).get("step")
        if step != spec.optim.max_steps:  # Ray Train's Ctrl-C handler aborts the run and fit() returns
            status = "KILLED"
            raise LaunchError(f"{label} was stopped at step {step} of {spec.optim.max_steps}{hint}")
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
    except SystemExit:  # Ctrl-C: Ray Train's SIGINT handler aborts the run, then sys.exit(0) in this thread
        status = "KILLED"
        raise LaunchError(f"{label} was interrupted (Ctrl-C){hint}") from None
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        run_id = run_id or tracker.ensure_run(handle)
        if run_id is not None and not tracker.end_run(run_id, status):
            print(f"[{label}] the tracking server at {spec.tracking.uri} did not take every metric point; they "
                  f"wait in {tracker.spool or 'memory'} and the MLflow run stays open until "
                  "`orchestrator resume` sends them")


@dataclass(frozen=True)
class RunOutcome:
    name: str
    path: str
    """Storage folder of the Train run (checkpoints, Ray's state)."""
    metrics: dict[str, Any]
    """The last report of rank 0."""
    checkpoint: str | None
    mlflow_run_id: str | None


def run_training(spec: ExperimentSpec, *, resume: bool = False, fail_at_step: int | None = None) -> RunOutcome:
    """Train one run under Ray Train. `resume=True` continues the run of the same name from its latest
    checkpoint (same RunConfig(name, storage_path), same MLflow run). `fail_at_step` raises inside the
    worker after that step's report: a fault-injection hook for testing resume."""
    storage = spec.run.storage_path
    run_path = _join(storage, spec.name)
    check_data_files(spec)
    check_labelled_data(spec, _cache_dir(spec))
    check_init_from(spec)
    with name_lock(run_path, spec.name):
        tracker = _tracker(spec, run_path)
        meta = _claim(spec, "run", resume, tracker)
        commit = (meta or {}).get("commit") or git_commit()
        handle = _handle(spec, run_name=spec.name, role="run", commit=commit, key=(RUN_KEY_TAG, run_path),
                         run_path=run_path).with_run_id((meta or {}).get("mlflow_run_id"))
        check_tracking(spec, tracker)
        finished = meta is not None and meta.get("status") == "FINISHED" and not _extends(meta, spec)
        if not finished:
            connect()
            _check_cluster(spec)  # before the MLflow run: a cluster that cannot run it leaves nothing behind
        handle = handle.with_run_id(tracker.ensure_run(handle))
        if finished:
            return _close_finished(spec, meta, tracker, handle)
        record = {"kind": "run", "name": spec.name, "spec": spec.model_dump(mode="json"), "commit": commit}
        write_meta(storage, spec.name, {**record, "mlflow_run_id": handle.run_id})
        train_spec, init_checkpoint = _stage_to_train(spec, storage_path=run_path, run_name=PRETRAIN_DIR,
                                                      mlflow_name=f"{spec.name}-pretrain", commit=commit,
                                                      parent_run_id=None, label=spec.name)
        worker = WorkerConfig(spec=train_spec.model_dump(mode="json"), run=handle, label=spec.name,
                              cache_dir=_cache_dir(spec), run_path=run_path, spool=spool_of(run_path),
                              fail_at_step=fail_at_step, init_checkpoint=init_checkpoint)
        from orchestrator.ray_console import RunReports

        # The launcher prints one line per report (the worker prints every logging step only with --verbose).
        reports = None if verbose() else RunReports(spec.name, max_steps=train_spec.optim.max_steps,
                                                     metric=train_spec.metric)
        trainer = build_trainer(spec, run_name=spec.name, storage_path=storage, worker=worker,
                                callbacks=[reports.relay()] if reports else None)
        try:
            with reports or contextlib.nullcontext():
                result, run_id, final = _fit_and_finish(spec, trainer, handle, tracker, _cache_dir(spec),
                                                        label=f"run {spec.name!r}", advice=None)
        except LaunchError as err:
            raise LaunchError(f"{err}\n{next_step(storage, spec.name)}") from None
        write_meta(storage, spec.name, {**record, "mlflow_run_id": run_id, "status": "FINISHED"})
    return RunOutcome(name=spec.name, path=result.path, metrics={**dict(result.metrics or {}), **final},
                      checkpoint=result.checkpoint.path if result.checkpoint else None, mlflow_run_id=run_id)


def _extends(meta: Mapping[str, Any], spec: ExperimentSpec) -> bool:
    """A resume that trains a finished run further (`optim.max_steps` raised on the command line)."""
    return spec.optim.max_steps > meta["spec"]["optim"]["max_steps"]


def _close_finished(spec: ExperimentSpec, meta: Mapping[str, Any], tracker: MlflowTracker,
                    handle: RunHandle) -> RunOutcome:
    """`resume` of a run that had finished training: send what its spool still holds and end its MLflow run."""
    use_train_v2()  # Result.from_path reads V2 storage
    from ray.train import Result

    if handle.run_id is not None and not tracker.end_run(handle.run_id, "FINISHED"):
        raise LaunchError(f"run {spec.name!r} finished, but {spec.tracking.uri} still does not take its spooled "
                          f"metrics ({tracker.spool}); try again when the server is up")
    print(f"[{spec.name}] had finished training; its spooled metrics are sent and its MLflow run is ended")
    result = Result.from_path(_join(spec.run.storage_path, spec.name))
    return RunOutcome(name=spec.name, path=result.path, metrics=dict(result.metrics or {}),
                      checkpoint=result.checkpoint.path if result.checkpoint else None, mlflow_run_id=handle.run_id)


# --- sweeps --------------------------------------------------------------------------------------------


def _trial_driver(config: dict[str, Any], *, study_raw: dict[str, Any], parent_run_id: str | None,
                  commit: str, fail_at_step: int | None = None, verbose_on: bool = False) -> None:
    """One Tune trial: resolve its spec, open its child MLflow run, build and fit its TorchTrainer."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    set_verbose(verbose_on)  # the launcher's --verbose, also on a cluster whose job env does not carry it
    trial_id = tune.get_context().get_trial_id()
    spec = validate_spec(resolve(study_raw, config), where=f"trial {trial_id}")
    # What the trial tries, then its id: the MLflow runs page lists children by name.
    run_name = f"{describe_config(config) or spec.name} ({trial_id})"
    trials_path = _join(spec.run.storage_path, spec.name, TRIALS_DIR)
    run_path = _join(trials_path, f"train-{trial_id}")
    tracker = _tracker(spec, run_path)
    # Found by trial id first: a retried or restored trial keeps its child run.
    handle = _handle(spec, run_name=run_name, role="trial", commit=commit, key=(TRIAL_TAG, trial_id),
                     run_path=run_path, parent_run_id=parent_run_id)
    handle = handle.with_run_id(tracker.ensure_run(handle))
    train_spec, init_checkpoint = _stage_to_train(spec, storage_path=trials_path, run_name=f"pretrain-{trial_id}",
                                                  mlflow_name=f"{run_name}-pretrain", commit=commit,
                                                  parent_run_id=parent_run_id, label=f"{spec.name} {trial_id}")
    worker = WorkerConfig(spec=train_spec.model_dump(mode="json"), run=handle, label=f"{spec.name} {trial_id}",
                          cache_dir=_cache_dir(spec), run_path=run_path, spool=spool_of(run_path),
                          fail_at_step=fail_at_step, init_checkpoint=init_checkpoint)
    trainer = build_trainer(spec, run_name=f"train-{trial_id}", storage_path=trials_path,
                            worker=worker, callbacks=[TuneReportCallback()])
    _fit_and_finish(spec, trainer, handle, tracker, _cache_dir(spec), label=f"trial {trial_id}", advice=None)


def _tune_config(study: Study, cluster: ClusterView):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    spec = study.base
    settings = spec.tune
    if settings.scheduler == "asha":
        # One ASHA time unit = one report = one evaluation; max_t is the last one. The worker counts them from
        # the step ("evaluations"): Tune's training_iteration restarts at 1 in a resumed trial.
        # stop_last_trials=False: a trial that reaches max_t ends by itself. Stopping it from Tune at its last
        # report would kill its driver while the Train run is still shutting down (cf. ray#54305).
        from orchestrator.trainer import Cadence  # torch.distributed with it: only a sweep's ASHA needs it here

        scheduler = ASHAScheduler(time_attr="evaluations", max_t=Cadence.of(spec).report_count(),
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
                           max_concurrent_trials=max_concurrent_trials(spec, cluster),
                           trial_name_creator=_trial_name, trial_dirname_creator=_trial_name)


def _console(study: Study):
    """The sweep's lines on the launcher's terminal: a report line per result, a progress line per change."""
    from orchestrator.ray_console import SweepConsole

    spec = study.base
    return SweepConsole(SweepProgress(name=spec.name, total=expected_trials(study), max_steps=spec.optim.max_steps,
                                      metric=spec.metric, mode=spec.mode))


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
    resumable: bool = False
    """Some trial wrote a checkpoint, so `orchestrator resume NAME` has something to continue."""
    metric: str = ""
    """The compared metric (tune.metric)."""


def pin_paths(study: Study) -> Study:
    """The study with every path its trial drivers read made absolute against the launcher's directory:
    run.storage_path and a SQLite tracking.uri as validated, and local data files (task.files.*, also a
    pretrain: stage's). Each driver validates the raw spec again in its own process, in whatever directory Ray
    started it (under Tune's chdir, its trial folder): a relative path there would name another place."""
    raw = copy.deepcopy(study.raw)
    # run and tracking cannot be searched (study_from_raw): the base spec's values are every trial's.
    raw["run"] = {**(raw.get("run") or {}), "storage_path": study.base.run.storage_path}
    raw["tracking"] = {**(raw.get("tracking") or {}), "uri": study.base.tracking.uri}
    for task in (raw.get("task"), (raw.get("pretrain") or {}).get("task")):
        files = task.get("files") if isinstance(task, dict) else None
        if isinstance(files, dict):
            for split, value in files.items():
                if isinstance(value, str) and "://" not in value:
                    files[split] = str(Path(value).expanduser().resolve())
    return replace(study, raw=raw)


def _trainable(study: Study, parent_run_id: str | None, commit: str, fail_at_step: int | None = None):
    from ray import tune

    driver = tune.with_parameters(_trial_driver, study_raw=study.raw, parent_run_id=parent_run_id, commit=commit,
                                  fail_at_step=fail_at_step, verbose_on=verbose())
    return tune.with_resources(driver, tune.PlacementGroupFactory([dict(DRIVER_RESOURCES)]))


def run_sweep(study: Study, *, resume: bool = False, fail_at_step: int | None = None) -> SweepOutcome:
    """A Tune sweep: one driver trial per configuration, a parent MLflow run with a child per trial.
    `resume=True` restores the Tuner: unfinished and errored trials resume under their own trial ids, so each
    driver reopens its child MLflow run and its Train run restores from its own latest checkpoint.
    `fail_at_step` makes every trial's worker raise after that step, as in run_training: a fault-injection
    hook for testing resume. The trainable is rebuilt on restore, so a resumed sweep runs without it.
    The parent run ends FINISHED only when every trial finished (or ASHA stopped it), FAILED when one errored,
    KILLED when the sweep was interrupted."""
    from ray import tune

    study = pin_paths(study)
    spec = study.base
    storage = spec.run.storage_path
    sweep_path = _join(storage, spec.name)
    check_data_files(spec)
    check_labelled_data(spec, _cache_dir(spec))
    for assignment in validation_points(study.domains) if study.domains else [{}]:
        check_init_from(study.spec_for(assignment))  # each trial's pretrained run, before any cluster time
    with name_lock(sweep_path, spec.name):
        tracker = _tracker(spec)
        meta = _claim(spec, "sweep", resume, tracker)
        commit = (meta or {}).get("commit") or git_commit()
        sweep_params = {f"tune.{k}": v for k, v in flatten(spec.tune.model_dump(mode="json")).items()}
        sweep_params.update({"sweep.domains": ", ".join(d.path for d in study.domains) or "(none)"})
        parent = run_handle(sweep_params, yaml.safe_dump(study.raw, sort_keys=False),
                            experiment=spec.tracking.experiment or spec.name, run_name=spec.name, role="sweep",
                            kind=None, commit=commit, key=(RUN_KEY_TAG, sweep_path))
        check_tracking(spec, tracker)
        connect()
        cluster = _check_cluster(spec)  # before the parent run: a cluster that cannot run it leaves nothing behind
        parent_run_id = tracker.ensure_run(parent.with_run_id((meta or {}).get("parent_run_id")))
        status = "FAILED"
        try:
            if resume:
                _send_trial_spools(spec, tracker)
            write_meta(storage, spec.name, {"kind": "sweep", "name": spec.name, "raw": study.raw,
                                            "parent_run_id": parent_run_id, "commit": commit})
            trainable = _trainable(study, parent_run_id, commit, fail_at_step)
            from orchestrator.ray_console import quiet_tune

            if resume and tune.Tuner.can_restore(sweep_path):
                # resume_errored, not restart_errored: a restarted trial is reset to a new trial id, which would
                # start a new Train run from scratch under a new child MLflow run.
                tuner = tune.Tuner.restore(sweep_path, trainable, resume_unfinished=True, resume_errored=True)
            else:
                tuner = tune.Tuner(
                    trainable,
                    param_space=to_param_space(study.domains, spec.tune.search),
                    tune_config=_tune_config(study, cluster),
                    run_config=tune.RunConfig(name=spec.name, storage_path=storage,
                                              failure_config=tune.FailureConfig(max_failures=spec.tune.max_failures),
                                              verbose=quiet_tune(), callbacks=[_console(study)]),
                )
            grid = tuner.fit()
            outcome = _sweep_outcome(study, grid, tracker, parent_run_id)
            _summarize(study, outcome, tracker)
            status = "KILLED" if outcome.interrupted else "FAILED" if outcome.errors else "FINISHED"
            return outcome
        except (KeyboardInterrupt, SystemExit):
            status = "KILLED"
            raise
        finally:
            if parent_run_id is not None:
                tracker.end_run(parent_run_id, status)


def _sweep_outcome(study: Study, grid: Any, tracker: MlflowTracker, parent_run_id: str | None) -> SweepOutcome:
    """Per trial: done (it returned, or ASHA stopped it: Tune's last result says done), errored, or neither
    (the sweep was interrupted); children left RUNNING are closed (KILLED, or FAILED when errored)."""
    spec = study.base
    trials = []
    for result in grid:
        metrics = dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or Path(result.path).name
        state = "error" if result.error else "done" if metrics.get("done") else "unfinished"
        trials.append({"trial_id": trial_id, "config": {k: v for k, v in (result.config or {}).items()},
                       "state": state, "error": failure_reason(result.error) if result.error else None,
                       "metrics": {k: v for k, v in metrics.items() if "/" in k or k in ("step", "evaluations")}})
    _close_children(tracker, spec, trials)
    errors = sum(t["state"] == "error" for t in trials)
    interrupted = any(t["state"] == "unfinished" for t in trials) or len(trials) < expected_trials(study)
    best = None
    try:
        best_result = grid.get_best_result(metric=spec.metric, mode=spec.mode, scope="all")
        best = {"config": best_result.config, "metrics": dict(best_result.metrics or {})}
    except RuntimeError:
        best = None  # no trial reported the metric
    return SweepOutcome(name=spec.name, path=grid.experiment_path, parent_run_id=parent_run_id, trials=trials,
                        best=best, errors=errors, interrupted=interrupted,
                        resumable=has_checkpoint(spec.run.storage_path, spec.name), metric=spec.metric)


def _summarize(study: Study, outcome: SweepOutcome, tracker: MlflowTracker) -> None:
    """The report's comparison on the sweep's parent MLflow run (orchestrator/sweep_summary.py); its files
    also in the sweep's folder (`report/`) when storage is local. Never fails the sweep."""
    spec = study.base
    sweep_path = _join(spec.run.storage_path, spec.name)
    try:
        summarize_sweep(tracking_uri=spec.tracking.uri, tracker=tracker,
                        experiment=spec.tracking.experiment or spec.name, parent_run_id=outcome.parent_run_id,
                        name=spec.name, trials=outcome.trials, metric=spec.metric, mode=spec.mode,
                        out_dir=None if "://" in sweep_path else Path(sweep_path) / "report")
    except Exception as err:  # noqa: BLE001 - the trials are done; `orchestrator report` can redo this
        print(f"[{spec.name}] the sweep's summary was not logged to MLflow ({type(err).__name__}: {str(err)[:200]})")


def _send_trial_spools(spec: ExperimentSpec, tracker: MlflowTracker) -> None:
    """Metric points a trial could not send (an outage at its end) go out before the sweep goes on; the
    trials Tune resumes send their own, and those it does not are done."""
    trials_path = _join(spec.run.storage_path, spec.name, TRIALS_DIR)
    for trial in _subfolders(trials_path):
        spool = spool_of(_join(trials_path, trial))
        if spool and Path(spool).is_file():
            trial_tracker = _tracker(spec, _join(trials_path, trial))
            trial_tracker._load_spool()
            for run_id in {rid for rid, _ in trial_tracker._pending}:
                trial_tracker.flush(run_id, force=True)


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
            tracker.end_run(run_id, "FAILED" if trial["error"] else "FINISHED" if trial["state"] == "done"
                            and trial["metrics"].get("step") == spec.optim.max_steps else "KILLED")


# --- resume --------------------------------------------------------------------------------------------


def resume(name: str, storage_path: str, overrides: Sequence[str] = ()) -> RunOutcome | SweepOutcome:
    """Continue the run or sweep `name` stored under `storage_path`, from what it stored there, with the
    overrides a resume may make (spec.RESUME_OVERRIDES; e.g. optim.max_steps trains a run further)."""
    storage = storage_path if "://" in storage_path else str(Path(storage_path).expanduser().resolve())
    meta = read_meta(storage, name)
    if meta is None:
        raise LaunchError(f"nothing named {name!r} in {storage} (no {META_FILE}); check the name and --storage-path")
    if meta["kind"] == "run":
        raw = apply_resume_overrides(meta["spec"], overrides, kind="run")
        return run_training(validate_spec(raw, where=f"stored spec of {name}"), resume=True)
    return run_sweep(study_from_raw(apply_resume_overrides(meta["raw"], overrides, kind="sweep")), resume=True)
