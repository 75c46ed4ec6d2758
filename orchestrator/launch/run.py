"""One training run: a Ray Train TorchTrainer of the spec's workers, its MLflow run, and its stages.

Names come from the spec, never timestamps, so re-running with the same (storage_path, name) resumes instead of
starting over. The launcher owns every MLflow run's lifecycle: it describes the run (`RunHandle`), creates or
finds it, and ends it on every exit path; the workers only log to it. A sweep's trial drivers
(orchestrator/launch/sweep.py) train through the same pieces.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import ray

from orchestrator.cluster.ray_env import (
    joined_runtime_env,
    start_local_ray,
    stored_result,
    train_worker_env,
    use_train_v2,
)
from orchestrator.cluster.resources import ClusterView, view_cluster
from orchestrator.console.progress import failure_reason, next_step, verbose
from orchestrator.launch.deliver import deliver_outputs, outputs_owed
from orchestrator.launch.evaluate import final_evaluation
from orchestrator.launch.name_lock import name_lock
from orchestrator.launch.preflight import (
    LaunchError,
    NameNotFound,
    check_data_files,
    check_labelled_data,
    check_multi_node,
    check_storage,
    check_tracking,
)
from orchestrator.launch.pretrained import CHECKPOINTS_TAG
from orchestrator.launch.pretrained import preflight as check_init_from
from orchestrator.spec.vocabulary import check_adaptive_bands
from orchestrator.launch.worker_config import WORKER_CONFIG, WorkerConfig
from orchestrator.spec import ExperimentSpec, check_gpus, spec_to_yaml
from orchestrator.spec.resources import check_cpus, check_worker_fits, check_workers_placed
from orchestrator.storage.layout import (
    META_FILE,
    PRETRAIN_DIR,
    RunLayout,
    diverged,
    record_error,
    set_aside_unreadable_snapshot,
    spool_of,
    trained_to,
)
from orchestrator.storage.locations import join, ray_storage, uri_of
from orchestrator.tracking.describe import (
    RUN_KEY_TAG,
    RunHandle,
    failure_tags,
    git_commit,
    portable_params,
    run_handle,
)
from orchestrator.tracking.write import MlflowTracker, open_tracker

# --- Ray ---------------------------------------------------------------------------------------------


def connect() -> None:
    """Join the cluster named by RAY_ADDRESS (e.g. under `ray job submit`), else start a local one
    (orchestrator/cluster/ray_env.py says what its processes get); Ray's own logs as quiet as the launcher's verbosity
    says (orchestrator/launch/ray_console.py)."""
    use_train_v2()
    # Tune copies this variable from the launcher's environment into every trial actor's (tune/execution/
    # class_cache.py), on a local Ray and on a cluster joined through RAY_ADDRESS alike, where the job's runtime
    # env applies: trial drivers then stay in the launcher's working directory.
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    if ray.is_initialized():
        return
    # Deferred: ray_console imports ray.train, which must be imported as V2 (use_train_v2 above) first.
    from orchestrator.launch.ray_console import ray_init_kwargs

    address = os.environ.get("RAY_ADDRESS")
    if address:
        # A cluster (e.g. under `ray job submit`): the job's own runtime_env applies; nodes have the project
        # installed (cluster.yaml setup_commands) and Train V2 is Ray 2.60's default.
        ray.init(address=address, runtime_env=joined_runtime_env(address), **ray_init_kwargs())
    else:
        start_local_ray(**ray_init_kwargs())


def check_cluster(spec: ExperimentSpec) -> ClusterView:
    """The connected cluster can run `spec`, its pretraining stage too: their GPUs and CPUs, counting what the
    autoscaler may add (a run that fits only after scale-up is let through: its worker group's request makes the
    autoscaler add the nodes), each worker on one node, all workers at once on the nodes of a cluster that cannot
    grow, and storage and tracking every node reaches when there are several."""
    cluster = view_cluster()
    where = "the connected Ray cluster" + (" at its autoscaler's largest" if cluster.autoscaling else "")
    check_gpus(spec, cluster.most("GPU"), where)
    check_cpus(spec, cluster.most("CPU"), where)
    check_worker_fits(spec, cluster.node_kinds, "the connected Ray cluster"
                      + (" with the node types its autoscaler may add" if cluster.autoscaling else ""))
    if not cluster.autoscaling:  # a cluster that grows adds the nodes the group asks for
        check_workers_placed(spec, cluster.alive_nodes, "the nodes of the connected Ray cluster")
    check_multi_node(spec, cluster.nodes, cluster.autoscaling, one_machine=cluster.one_machine)
    return cluster


# --- a name in storage ---------------------------------------------------------------------------------


def claim(spec: ExperimentSpec, resume: bool, tracker: MlflowTracker) -> dict[str, Any] | None:
    """The stored metadata of `spec.name` when resuming; None for a new start. A name with a checkpoint is
    taken (refused with the resume command); one whose every attempt stopped before its first checkpoint is
    free: that attempt's folder is cleared and its MLflow run, marked FAILED, no longer answers to the name."""
    layout = RunLayout(spec.run.storage_path, spec.name)
    storage, name = layout.storage, layout.name
    meta = layout.read_meta()
    started = meta is not None and layout.has_checkpoint()
    if resume:
        if meta is None:
            raise NameNotFound(f"nothing named {name!r} in {storage} (no {META_FILE}); check the name and --storage-path")
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
        tracker.set_tags(run_id, {RUN_KEY_TAG: f"{layout.folder} (abandoned before its first checkpoint)"})
        if tracker.run_status(run_id) == "RUNNING":
            tracker.end_run(run_id, "FAILED")
    layout.clear()
    return None


# --- one Train run -------------------------------------------------------------------------------------


def build_trainer(spec: ExperimentSpec, *, run_name: str, storage_path: str, worker: WorkerConfig,
                  callbacks: list | None = None):
    """The TorchTrainer of one run: DDP or FSDP over `run.workers` ranks, whose collectives time out after
    run.collective_timeout_s; Ray keeps the `run.keep_checkpoints` best checkpoints by the spec's metric plus
    always the latest (for resume)."""
    # Deferred: ray.train (and the worker and console modules, which import it) only after use_train_v2().
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from orchestrator.launch.ray_console import train_logging_config
    from orchestrator.launch.train_actors import torch_trainer_class
    from orchestrator.launch.worker import train_loop_per_worker

    resources = {"CPU": spec.run.cpus_per_worker}
    ray_path, filesystem = ray_storage(storage_path)
    if spec.run.gpus_per_worker:
        resources["GPU"] = spec.run.gpus_per_worker
    return torch_trainer_class()(
        train_loop_per_worker,
        train_loop_config={WORKER_CONFIG: worker},
        # Rank 0 evaluates alone while the others wait in their next collective: the timeout must outlast it.
        torch_config=TorchConfig(timeout_s=spec.run.collective_timeout_s),
        scaling_config=ScalingConfig(num_workers=spec.run.workers, use_gpu=spec.run.gpus_per_worker > 0,
                                     resources_per_worker=resources),
        run_config=RunConfig(
            name=run_name,
            storage_path=ray_path,
            storage_filesystem=filesystem,
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


def describe_run(spec: ExperimentSpec, *, run_name: str, role: str, commit: str, key: tuple[str, str],
                 run_path: str, parent_run_id: str | None = None) -> RunHandle:
    """The handle of a Train run's MLflow run: the flattened spec as params, the spec's experiment."""
    handle = run_handle(portable_params(spec.model_dump(mode="json")), spec_to_yaml(spec),
                        experiment=spec.tracking.experiment, run_name=run_name, role=role,
                        kind=spec.model.attention.kind, commit=commit, key=key, parent_run_id=parent_run_id)
    # Where the run's checkpoints are: how `model.init_from=<MLflow run id>` finds them.
    return replace(handle, tags={**handle.tags, CHECKPOINTS_TAG: run_path})


def _pretrain(spec: ExperimentSpec, *, storage_path: str, run_name: str, mlflow_name: str, commit: str,
              parent_run_id: str | None, label: str, console: str | None = None) -> ExperimentSpec:
    """Stage 1 of a two-stage spec (`pretrain:`): its own Train run in `storage_path/run_name` and its own MLflow
    run (role pretrain, next to the fine-tuning run); skipped when it already reached its last step (a resumed
    run or trial). Returns stage 2: the spec fine-tuning from that run's best checkpoint."""
    stage = spec.pretraining_spec()
    run_path = join(storage_path, run_name)
    if trained_to(run_path, stage.optim.max_steps):
        print(f"[{label}] pretraining stage done before ({run_path}); fine-tuning from it")
        return spec.finetuning_spec(run_path)
    tracker = open_tracker(stage.tracking, spool_of(run_path))
    handle = describe_run(stage, run_name=mlflow_name, role="pretrain", commit=commit, key=(RUN_KEY_TAG, run_path),
                          run_path=run_path, parent_run_id=parent_run_id)
    handle = handle.with_run_id(tracker.ensure_run(handle))
    cache_dir = RunLayout(stage.run.storage_path, stage.name).cache_dir
    worker = WorkerConfig(spec=stage.model_dump(mode="json"), run=handle, label=f"{label} pretrain",
                          cache_dir=cache_dir, run_path=run_path, spool=spool_of(run_path))
    from orchestrator.launch.ray_console import (
        RunReports,  # deferred: imports ray.train
    )

    # Its report lines like any run's: a sweep's console shows the trials' fine-tuning reports (Tune's results),
    # not this stage's, which Tune does not see.
    reports = None if verbose() else RunReports(f"{console or label} pretrain", max_steps=stage.optim.max_steps,
                                                 metric=stage.metric)
    trainer = build_trainer(stage, run_name=run_name, storage_path=storage_path, worker=worker,
                            callbacks=[reports.relay()] if reports else None)
    with reports or contextlib.nullcontext():
        fit_and_finish(stage, trainer, handle, tracker, cache_dir, label=f"{label} pretraining", advice=None,
                       console=f"{console or label} pretrain")
    return spec.finetuning_spec(run_path)


def stage_to_train(spec: ExperimentSpec, *, storage_path: str, run_name: str, mlflow_name: str, commit: str,
                   parent_run_id: str | None, label: str,
                   console: str | None = None) -> tuple[ExperimentSpec, str | None]:
    """The spec a run's workers train and the checkpoint they start from: a two-stage spec runs its pretraining
    stage first and fine-tunes from it; a spec with model.init_from starts from that checkpoint (checked again
    here: it may have changed since the launcher's preflight); any other spec trains from scratch."""
    if spec.pretrain is not None:
        spec = _pretrain(spec, storage_path=storage_path, run_name=run_name, mlflow_name=mlflow_name,
                         commit=commit, parent_run_id=parent_run_id, label=label, console=console)
    pretrained = check_init_from(spec)
    return spec, pretrained.location if pretrained is not None else None


def fit_and_finish(spec: ExperimentSpec, trainer: Any, handle: RunHandle, tracker: MlflowTracker,
                   cache_dir: str, *, label: str, advice: str | None,
                   console: str | None = None) -> tuple[Any, str | None, dict[str, float], str | None]:
    """Fit, score the best checkpoint on the test split, and end the MLflow run on every exit path: FINISHED
    only when training reached optim.max_steps, KILLED on Ctrl-C, FAILED when anything raised. A failure is a
    LaunchError of one line, with `advice` (None: the caller says what to do). The run id is looked up again:
    the worker may have created the run after an outage at launch. Returns the result, the run id, the final
    scores, and what still waits for the tracking server (None when MLflow holds everything and the run ended)."""
    from ray.train import (
        TrainingFailedError,  # deferred: ray.train only after use_train_v2()
    )

    status, run_id, failure, delivered, waiting = "FAILED", handle.run_id, None, True, None
    config = trainer.run_config  # Ray's paths on remote storage carry no scheme: the filesystem says where
    run_folder = uri_of(config.storage_filesystem, join(config.storage_path, config.name))
    hint = f"\n{advice}" if advice else ""
    try:
        try:
            # A retried trial or a resume of a run that diverged (run.stop_on_nan) would diverge again: say so now,
            # instead of starting its workers to train back to the same step.
            reason = diverged(run_folder)
            if reason is not None:
                failure = f"NonFiniteLoss: {reason}"
                raise LaunchError(f"{label} failed: {failure}{hint}")
            if (repaired := set_aside_unreadable_snapshot(run_folder)) is not None:
                print(f"[{label}] {repaired}")
            result = trainer.fit()
            if (reason := diverged(run_folder)) is not None:  # its retry ended at once (worker.py)
                failure = f"NonFiniteLoss: {reason}"
                raise LaunchError(f"{label} failed: {failure}{hint}")
        except TrainingFailedError as err:  # NaN, an exception, or Ray Train past run.max_failures (a lost node)
            failure = failure_reason(err)
            where = record_error(run_folder, str(err))
            raise LaunchError(f"{label} failed: {failure}{hint}\n(the whole error: {where})") from None
        step = (result.metrics or {}).get("step")
        scoring_only = spec.optim.max_steps == 0
        if scoring_only and step is None and result.error is None:
            step = 0  # a run that trains nothing reports no checkpoint, and Ray's Result carries a checkpoint's metrics
        if step != spec.optim.max_steps:  # Ray Train's Ctrl-C handler aborts the run and fit() returns
            status = "KILLED"
            raise LaunchError(f"{label} was stopped at step {step} of {spec.optim.max_steps}{hint}")
        run_id = run_id or tracker.ensure_run(handle)
        try:
            # A scoring-only run's one evaluation is its result (task.eval_split picks the split); no checkpoint.
            final = {} if scoring_only else final_evaluation(spec, result, run_folder, cache_dir=cache_dir,
                                                             console=console)
        except Exception as err:  # noqa: BLE001 - training is done and checkpointed: say how to score it later
            final = {}
            message = f"{type(err).__name__}: {str(err)[:500]}"
            print(f"[{spec.name}] final evaluation failed ({message}); the trained checkpoints are kept: "
                  f"score them with `orchestrator evaluate {spec.name} --storage-path {spec.run.storage_path}`")
            if run_id is not None:
                tracker.set_tags(run_id, {"test.error": message})
        delivered = deliver_outputs(tracker, run_id, run_folder)
        status = "FINISHED"
    except SystemExit:  # Ctrl-C: Ray Train's SIGINT handler aborts the run, then sys.exit(0) in this thread
        status = "KILLED"
        raise LaunchError(f"{label} was interrupted (Ctrl-C){hint}") from None
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except Exception as err:
        failure = failure or f"{type(err).__name__}: {failure_reason(err)}"
        raise
    finally:
        run_id = run_id or tracker.ensure_run(handle)
        if run_id is None:  # the server never answered this launcher: nothing of the run is in MLflow yet
            print(f"[{label}] the tracking server at {spec.tracking.uri} did not answer, so the run has no MLflow "
                  f"run yet; its metric points wait in {tracker.spool or 'memory'} and its outputs in {run_folder} "
                  "until `orchestrator resume` opens the run and sends them")
        if run_id is not None and status == "FAILED":
            tracker.set_tags(run_id, failure_tags(failure or "the launcher stopped before the run ended"))
        if run_id is not None and status == "FINISHED":
            tracker.clear_failure(run_id)  # a resumed run that failed before: its failure is history now
        if run_id is None:
            waiting = f"the MLflow run does not exist yet; its points and outputs wait in {run_folder}"
        elif not delivered:  # never FINISHED without its test scores and model
            waiting = f"the tracking server at {spec.tracking.uri} did not take every output; they wait in {run_folder}"
        elif not tracker.end_run(run_id, status):
            waiting = (f"the tracking server at {spec.tracking.uri} did not take every metric point; they wait in "
                       f"{tracker.spool or 'memory'}")
        if waiting is not None and run_id is not None:
            print(f"[{label}] {waiting}, and the MLflow run stays open until `orchestrator resume` sends them")
    return result, run_id, final, waiting


# --- `orchestrator train` ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOutcome:
    name: str
    path: str
    """Storage folder of the Train run (checkpoints, Ray's state)."""
    metrics: dict[str, Any]
    """The last report of rank 0."""
    checkpoint: str | None
    mlflow_run_id: str | None
    waiting: str | None = None
    """What of the trained run still waits for the tracking server (its MLflow run then stays open until
    `orchestrator resume` sends it); None when MLflow holds everything."""


def run_training(spec: ExperimentSpec, *, resume: bool = False, fail_at_step: int | None = None) -> RunOutcome:
    """Train one run under Ray Train. `resume=True` continues the run of the same name from its latest
    checkpoint (same RunConfig(name, storage_path), same MLflow run). `fail_at_step` raises inside the
    worker after that step's report: a fault-injection hook for testing resume."""
    layout = RunLayout(spec.run.storage_path, spec.name)
    run_path = layout.folder
    check_storage(spec)
    check_data_files(spec)
    check_labelled_data(spec, layout.cache_dir)
    check_init_from(spec)
    check_adaptive_bands(spec)  # against the tokenizer's pieces, as validate and sweep check them
    with name_lock(layout):
        tracker = open_tracker(spec.tracking, layout.spool)
        meta = claim(spec, resume, tracker)
        commit = (meta or {}).get("commit") or git_commit()
        handle = describe_run(spec, run_name=spec.name, role="run", commit=commit, key=(RUN_KEY_TAG, run_path),
                              run_path=run_path).with_run_id((meta or {}).get("mlflow_run_id"))
        check_tracking(spec, tracker)
        finished = meta is not None and meta.get("status") == "FINISHED" and not _extends(meta, spec)
        if not finished:
            connect()
            check_cluster(spec)  # before the MLflow run: a cluster that cannot run it leaves nothing behind
        handle = handle.with_run_id(tracker.ensure_run(handle))
        if finished:
            return _close_finished(spec, tracker, handle)
        record = {"kind": "run", "name": spec.name, "spec": spec.model_dump(mode="json"), "commit": commit}
        layout.write_meta({**record, "mlflow_run_id": handle.run_id})
        train_spec, init_checkpoint = stage_to_train(spec, storage_path=run_path, run_name=PRETRAIN_DIR,
                                                     mlflow_name=f"{spec.name}-pretrain", commit=commit,
                                                     parent_run_id=None, label=spec.name)
        worker = WorkerConfig(spec=train_spec.model_dump(mode="json"), run=handle, label=spec.name,
                              cache_dir=layout.cache_dir, run_path=run_path, spool=layout.spool,
                              fail_at_step=fail_at_step, init_checkpoint=init_checkpoint)
        from orchestrator.launch.ray_console import (
            RunReports,  # deferred: imports ray.train, after connect()
        )

        # The launcher prints one line per report (the worker prints every logging step only with --verbose).
        reports = None if verbose() else RunReports(spec.name, max_steps=train_spec.optim.max_steps,
                                                     metric=train_spec.metric)
        trainer = build_trainer(spec, run_name=spec.name, storage_path=layout.storage, worker=worker,
                                callbacks=[reports.relay()] if reports else None)
        try:
            with reports or contextlib.nullcontext():
                result, run_id, final, waiting = fit_and_finish(spec, trainer, handle, tracker, layout.cache_dir,
                                                                label=f"run {spec.name!r}", advice=None)
        except LaunchError as err:
            raise LaunchError(f"{err}\n{next_step(layout)}") from None
        layout.write_meta({**record, "mlflow_run_id": run_id, "status": "FINISHED"})
    return RunOutcome(name=spec.name, path=layout.folder, metrics={**dict(result.metrics or {}), **final},
                      checkpoint=uri_of(result.filesystem, result.checkpoint.path) if result.checkpoint else None,
                      mlflow_run_id=run_id, waiting=waiting)


def _extends(meta: Mapping[str, Any], spec: ExperimentSpec) -> bool:
    """A resume that trains a finished run further (`optim.max_steps` raised on the command line)."""
    return spec.optim.max_steps > meta["spec"]["optim"]["max_steps"]


def _close_finished(spec: ExperimentSpec, tracker: MlflowTracker, handle: RunHandle) -> RunOutcome:
    """`resume` of a run that had finished training: send what its spool still holds and end its MLflow run."""
    folder = RunLayout(spec.run.storage_path, spec.name).folder
    # What was waiting, asked before it goes: the line below says "sent" only of that (its launcher may have sent it).
    waiting = [what for what, owed in (("its spooled metrics", tracker.holds_unsent(handle.run_id)),
                                       ("its outputs", outputs_owed(handle.run_id, folder))) if owed]
    if handle.run_id is not None and not (deliver_outputs(tracker, handle.run_id, folder)
                                          and tracker.end_run(handle.run_id, "FINISHED")):
        raise LaunchError(f"run {spec.name!r} finished, but {spec.tracking.uri} still does not take its spooled "
                          f"metrics ({tracker.spool}) or its outputs ({folder}); try again when the server is up")
    if handle.run_id is None:  # the store did not answer (tracking.offline_ok): nothing was sent or ended
        print(f"[{spec.name}] had finished training; {spec.tracking.uri} did not open its MLflow run, so its spooled "
              f"metrics and outputs wait in {folder} for the next `orchestrator resume {spec.name}`")
    else:
        sent = f"{' and '.join(waiting)} are sent" if waiting else "nothing was waiting to be sent"
        print(f"[{spec.name}] had finished training; {sent}, and its MLflow run is ended")
    result = stored_result(folder)
    return RunOutcome(name=spec.name, path=folder, metrics=dict(result.metrics or {}),
                      checkpoint=uri_of(result.filesystem, result.checkpoint.path) if result.checkpoint else None,
                      mlflow_run_id=handle.run_id)
