"""Ray Train glue around the training core (orchestrator/training/trainer.py): what only a Ray worker does.

Rank and device from Ray's context, DDP or FSDP through `ray.train.torch.prepare_model` (run.strategy), resume
from `ray.train.get_checkpoint()`, and at every report step one `ray.train.report` on all ranks, with a
checkpoint written by rank 0 when one is due (Ray docs, train/user-guides/checkpoints), uploaded to storage
before the report returns or, with run.checkpoint_upload=async, in Ray's background thread. Rank 0 logs to the
console and to the MLflow run the launcher described (`WorkerConfig.run`); the worker never creates, tags or
ends runs.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from orchestrator.console.progress import quiet_exit_in_finalizers, verbose
from orchestrator.launch.deliver import store_task_files
from orchestrator.launch.pretrained import load as load_pretrained
from orchestrator.launch.worker_config import WORKER_CONFIG, WorkerConfig
from orchestrator.spec import ExperimentSpec, spec_to_yaml
from orchestrator.spec.counting import flops_per_token
from orchestrator.storage.layout import (
    checkpoint_order,
    checkpoint_steps,
    diverged,
    fresh_checkpoint_name,
    mark_diverged,
)
from orchestrator.storage.locations import join, remove_folder, storage_fs
from orchestrator.storage.object_store import use_storage
from orchestrator.tracking.describe import RunHandle, device_tags
from orchestrator.tracking.loggers import ConsoleLogger, MetricsLogger, MlflowLogger
from orchestrator.tracking.system_metrics import start_system_metrics
from orchestrator.tracking.write import MlflowTracker
from orchestrator.training.checkpoint import (
    TrainingState,
    read_checkpoint,
    write_checkpoint,
)
from orchestrator.training.sharding import SHARDS_DIR, ShardIndexError, ShardReadError, shard_model
from orchestrator.training.trainer import Cadence, NonFiniteLoss, Trainer, unwrap
from tasks.base import WorkerContext


class InjectedFailure(RuntimeError):
    """Raised at `fail_at_step` (a fault-injection knob of run.run_training) to exercise resume."""


def _gather(obj: Any, world_size: int) -> list[Any]:
    """Every rank's `obj`, on every rank (the checkpoint keeps each rank's RNG and data position)."""
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def prepare(model: nn.Module, spec: ExperimentSpec, device: torch.device, world_size: int) -> nn.Module:
    """DDP through Ray's prepare_model, without a search for unused parameters (a graph traversal every step):
    every step gives every trainable parameter a gradient (tests/test_scale_features.py probes each embedding,
    tied and untied); FSDP2 by the project itself (Ray's prepare_model would wrap in FSDP1, which refuses CPUs):
    orchestrator/training/sharding.py."""
    if spec.run.strategy == "fsdp":
        return shard_model(model.to(device), device, spec.run.precision, world_size)
    return ray.train.torch.prepare_model(model, parallel_strategy="ddp")


class RayHooks:
    """The core's hooks under Ray Train: console + MLflow on rank 0, `ray.train.report` on every rank."""

    def __init__(self, cfg: WorkerConfig, spec: ExperimentSpec, run: RunHandle, rank: int):
        self.cfg, self.spec, self.rank = cfg, spec, rank
        self.tracker: MlflowTracker | None = None
        self.mlflow: MlflowLogger | None = None
        self.logger = MetricsLogger()
        self._uploading: list[Path] = []
        """Temporary folders of checkpoints Ray may still be uploading (run.checkpoint_upload=async)."""
        self.taken_names: set[str] = set()
        """Checkpoint folder names in storage when this attempt started (`_restore_point`)."""
        self.sizes: dict[str, float] = {}
        """params.attention / params.total, in every result reported to Tune (not logged as MLflow metrics: they
        are params there), so a further objective of tune.metric may be a size (spec COST_OBJECTIVES)."""
        if rank == 0:
            tracking = spec.tracking
            self.tracker = MlflowTracker(tracking.uri, retries=tracking.retries, timeout_s=tracking.timeout_s,
                                         spool=cfg.spool)
            self.mlflow = MlflowLogger(self.tracker, lambda: self.tracker.ensure_run(run))
            self.logger = MetricsLogger([ConsoleLogger(cfg.label, spec.optim.max_steps), self.mlflow])

    @property
    def run_id(self) -> str | None:
        return self.mlflow.run_id if self.mlflow is not None else None

    # Deferred, not sent directly: a run the server has not opened yet (or that does not answer now) gets them
    # from the spool with its points, whoever opens it (MlflowTracker.defer).
    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.tracker is not None:
            self.tracker.defer(self.run_id, "params", params)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self.tracker is not None:
            self.tracker.defer(self.run_id, "tags", tags)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.logger.log(metrics, step)

    def report(self, trainer: Trainer, step: int, metrics: Mapping[str, float], checkpoint: bool) -> None:
        self.logger.log(metrics, step)
        # `evaluations` is ASHA's time unit: counted from the step, so a resumed trial keeps its rung even
        # though Tune's training_iteration restarts at 1 (a function trial has no Tune checkpoint).
        report = {"step": step, "evaluations": Cadence.of(self.spec).reports_until(step), **self.sizes, **metrics}
        # Every rank gathers (positions and RNG of all ranks); rank 0 alone gets a state to write. A sharded run's
        # ranks each write their shards too.
        state, shards = trainer.checkpoint_parts(self.run_id) if checkpoint else (None, None)
        if not checkpoint:
            ray.train.report(report)
            return
        asynchronous = self.spec.run.checkpoint_upload == "async"
        if asynchronous:
            # One upload in flight: the previous checkpoint is committed before the next is handed over.
            self.wait_for_uploads()
        tmp = Path(tempfile.mkdtemp(prefix="orchestrator-ckpt-"))
        try:
            ckpt = None
            if state is not None or shards is not None:
                folder = write_checkpoint(tmp, state, spec_to_yaml(self.spec), trainer.task.artifacts().get("tokenizer"),
                                          shards=shards, step=step)
                ckpt = ray.train.Checkpoint.from_directory(str(folder))
            # Named by step, not Ray's timestamp default, so storage listings read as a training history.
            name = fresh_checkpoint_name(step, self.taken_names)
            upload = partial(ray.train.report, report, checkpoint=ckpt, checkpoint_dir_name=name)
            if asynchronous:
                # Ray copies the folder to storage on its own thread and deletes it afterwards; the training
                # thread goes on as soon as the report is queued.
                upload(checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                       delete_local_checkpoint_after_upload=True)
            else:
                try:
                    upload()
                except OSError:
                    # Ray copies into the final folder file by file: a full disk or a dropped connection leaves a
                    # part of it (a truncated state.pt), never registered. It goes, so no reader meets it.
                    remove_folder(join(self.cfg.run_path, name))
                    raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if asynchronous:
            self._uploading.append(tmp)
            return
        shutil.rmtree(tmp, ignore_errors=True)
        self._wait_for_commit()

    def _wait_for_commit(self) -> None:
        if self.rank == 0:
            # The controller registers a reported checkpoint (and saves its snapshot) on its next poll of the
            # workers; until then a killed run would resume from the one before. Waiting for the commit keeps
            # "on disk" and "registered" one step apart, so a resume recomputes at most checkpoint_every steps.
            ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)

    def wait_for_uploads(self) -> None:
        """Block until the checkpoints reported asynchronously are uploaded and registered (a no-op when none
        are), then drop their emptied temporary folders."""
        if not self._uploading:
            return
        self._wait_for_commit()
        for tmp in self._uploading:
            shutil.rmtree(tmp, ignore_errors=True)
        self._uploading.clear()

    def after_step(self, step: int) -> None:
        if self.cfg.fail_at_step is not None and step == self.cfg.fail_at_step:
            raise InjectedFailure(f"injected failure after step {step} (the fail_at_step hook of "
                                  "run.run_training and sweep.run_sweep)")

    def store_task_files(self, files: Mapping[str, Path]) -> None:
        """Rank 0: the task's files into the run's storage, which the launcher sends to MLflow when the run ends
        (orchestrator/launch/deliver.py: an outage then does not lose them)."""
        if self.rank == 0:
            store_task_files(self.cfg.run_path, files)

    def close(self, status: str) -> None:
        self.logger.close(status)


def _shortened(message: str, width: int = 120) -> str:
    """A message's first line in `width` characters, its middle left out: a long path's start and, at its end,
    the file or reason that names what failed."""
    line = message.splitlines()[0] if message else ""
    return line if len(line) <= width else f"{line[:width // 2 - 3]}...{line[-(width // 2):]}"


def _restore_point(registered: Any, run_path: str, label: str, rank: int,
                   restore: Callable[[TrainingState, Path | None], None]) -> tuple[TrainingState | None, set[str]]:
    """Restore the newest readable checkpoint of this run (`restore`: Trainer.restore): Ray's registered latest, or
    a newer complete one on disk that a kill kept Ray from registering; an unreadable one (truncated, corrupt, a
    shard missing) is skipped, said, and the one before it is taken. Also the checkpoint names already in storage,
    which new checkpoints must not reuse (`fresh_checkpoint_name`): every rank lists them here, before any rank can
    write one."""
    fs, path = storage_fs(run_path)
    candidates = {name: ray.train.Checkpoint(join(path, name), filesystem=fs) for name in checkpoint_steps(run_path)}
    if registered is not None:
        candidates.setdefault(Path(registered.path).name, registered)
    taken = set(candidates)
    skipped: list[str] = []
    for name in sorted(candidates, key=checkpoint_order, reverse=True):
        restoring = False
        try:
            with candidates[name].as_directory() as directory:
                state = read_checkpoint(Path(directory), in_full=False)
                if state.sharded:  # each rank reads its own shards, while the folder is here (from S3: a download)
                    restoring = True
                    restore(state, Path(directory) / SHARDS_DIR)
        except Exception as err:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous one
            if restoring and not isinstance(err, (ShardReadError, ShardIndexError)):
                raise  # another model's checkpoint, another strategy's: an older checkpoint would not do either
            skipped.append(f"{name} ({type(err).__name__}: {_shortened(str(err))})")
            continue
        if rank == 0 and skipped:
            sys.stdout.write(f"[{label}] checkpoint {', '.join(skipped)} is unreadable; resuming from the "
                             f"previous intact checkpoint {name} instead (the unreadable folder is left as it "
                             "is; the steps after it are checkpointed under new names)\n")
        if not state.sharded:
            restore(state, None)
        return state, taken
    if rank == 0 and skipped:
        sys.stdout.write(f"[{label}] no readable checkpoint ({', '.join(skipped)}); starting from step 0\n")
    return None, taken


def final_checkpoint_unregistered(state: TrainingState | None, registered: Any, max_steps: int) -> bool:
    """The run was restored at its last step from a checkpoint that Ray had not registered: a kill or a lost node
    between the checkpoint's upload and the controller's next poll. With nothing left to train, no report would
    register it, Ray's result would stay at the registered step before, and the launcher would call the run
    stopped there ("stopped at step 28 of 32"), on every resume again."""
    if state is None or max_steps == 0 or state.step < max_steps:
        return False
    return registered is None or checkpoint_order(Path(registered.path).name)[0] < state.step


def register_final_checkpoint(trainer: Trainer, hooks: RayHooks, label: str) -> None:
    """Report the restored last step to Ray with its checkpoint (written again, under a fresh name) and its
    validation metrics evaluated again (the same weights: the same scores). MLflow keeps the points it has of that
    step from the report Ray missed (MlflowLogger sends a metric's step once). Every rank: the checkpoint gathers."""
    step = trainer.step
    hooks.report(trainer, step, {**trainer.evaluate(), **trainer.best.as_metrics()}, True)
    if hooks.rank == 0:
        sys.stdout.write(f"[{label}] step {step}'s checkpoint had not been registered with Ray Train; "
                         "registered it again\n")


def quiet_train_reports() -> None:
    """Called first in every Train worker's loop: without --verbose, Ray Train's execution context, which logs
    each report's TrainingReport repr at INFO through a logger named by its file path (`logging.getLogger(
    __file__)`, outside `ray.train`, so Ray Train's LoggingConfig does not reach it), logs warnings only. Set
    here rather than by a job-wide setup hook: that needs a job runtime env, which a local Ray does not have
    (ray_env.py), and the loop runs on a joined cluster too. Here, not in ray_console.py, which imports Tune."""
    if verbose():
        return
    quiet_exit_in_finalizers()
    import importlib.util

    spec = importlib.util.find_spec("ray.train.v2._internal.execution.context")
    if spec is not None and spec.origin:
        logging.getLogger(spec.origin).setLevel(logging.WARNING)
    # Ray Train logs a failing training function's traceback here, at ERROR, in the worker's console: the launcher
    # prints the error's one line and writes the whole of it to the run folder's error.txt instead.
    logging.getLogger("ray.train.v2._internal.util").setLevel(logging.CRITICAL)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point; `config[WORKER_CONFIG]` is the launcher's WorkerConfig."""
    quiet_train_reports()
    cfg: WorkerConfig = config[WORKER_CONFIG]
    spec = ExperimentSpec.model_validate(cfg.spec)
    use_storage(spec.run.storage_endpoint, spec.run.storage_region)  # the launcher's store, on any node
    if diverged(cfg.run_path) is not None:
        # Ray Train's retry of a run that diverged (run.max_failures): it would diverge again from its checkpoints.
        # Every rank ends at once, without an error (an error would be retried again); the launcher finds the
        # run's record and fails it with the reason.
        return
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    ctx = WorkerContext(rank=rank, world_size=world_size, seed=spec.optim.seed,
                        device=ray.train.torch.get_device(), cache_dir=Path(cfg.cache_dir))
    pretrained = None
    if spec.model.init_from is not None:  # fine-tuning: the launcher resolved and checked the checkpoint
        assert cfg.init_checkpoint is not None, "the launcher resolves model.init_from into init_checkpoint"
        pretrained = load_pretrained(cfg.init_checkpoint, Path(tempfile.mkdtemp(prefix="init-from-")))
        ctx = replace(ctx, tokenizer_path=pretrained.tokenizer)
    trainer = Trainer.create(spec, ctx, wrap=lambda model: prepare(model, spec, ctx.device, world_size),
                             gather=lambda obj: _gather(obj, world_size),
                             initialize=pretrained.initializer(spec.model.freeze) if pretrained else None)

    run = cfg.run
    registered = ray.train.get_checkpoint()
    state, taken_names = _restore_point(registered, cfg.run_path, cfg.label, rank, trainer.restore)
    if state is not None:
        run = run.with_run_id(state.mlflow_run_id)  # the run id may have appeared only after an outage

    hooks = RayHooks(cfg, spec, run, rank)
    hooks.taken_names = taken_names
    counts = unwrap(trainer.model).parameter_counts()
    hooks.log_params({"params.attention": counts["attention"], "params.total": counts["total"]})
    hooks.sizes = {"params.attention": float(counts["attention"]), "params.total": float(counts["total"])}
    if rank == 0:
        # The one rank that logs. On fake tensors, after Trainer.create (whose AdamW already imported torch._dynamo,
        # which the counter needs): 0.4 s of CPU for a test-sized model (benchmarks/system/plan_cost.py).
        # At the vocabulary of the model built here, which a fine-tuned model takes from model.init_from's run.
        trainer.flops_per_token = flops_per_token(spec, getattr(trainer.task, "vocab_size", None))
        if trainer.flops_per_token is not None:
            hooks.log_params({"flops_per_token": trainer.flops_per_token})
    if pretrained is not None:
        hooks.set_tags(pretrained.lineage_tags())
    hooks.set_tags(device_tags(ctx.device, world_size))
    stop_system_metrics = None
    if spec.tracking.system_metrics and hooks.run_id is not None:
        stop_system_metrics = start_system_metrics(spec.tracking.uri, hooks.run_id,
                                                   spec.tracking.system_metrics_interval_s, ctx.device)
    if rank == 0 and state is not None:
        sys.stdout.write(f"[{cfg.label}] resumed from step {trainer.step} (MLflow run {hooks.run_id})\n")
    status = "FAILED"
    try:
        try:
            trainer.fit(hooks)
        except NonFiniteLoss as err:
            mark_diverged(cfg.run_path, str(err))
            raise
        if final_checkpoint_unregistered(state, registered, spec.optim.max_steps):
            register_final_checkpoint(trainer, hooks, cfg.label)
        hooks.wait_for_uploads()  # the last checkpoint is in storage before the run is called finished
        status = "FINISHED"
        hooks.store_task_files(trainer.task.artifacts())
    finally:
        if stop_system_metrics is not None:
            stop_system_metrics()
        hooks.close(status)
