"""The per-worker training loop that Ray Train runs on every rank.

Shape of a step (nanoGPT's train.py, distributed by Ray Train): `grad_accum` micro-batches from this
rank's shard of the task's stream -> bf16 autocast on GPU -> DDP gradient all-reduce on the last
micro-batch only -> clip -> AdamW -> warmup/decay LR. Every `eval_every` and `checkpoint_every` steps
(and at the end) all ranks evaluate and call `ray.train.report` together; rank 0 alone writes the
checkpoint files and logs to MLflow (Ray docs, train/user-guides/checkpoints).
"""

from __future__ import annotations

import random
import resource
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from orchestrator.checkpoint import (
    TrainingState,
    capture_rng,
    read_checkpoint,
    restore_rng,
    write_checkpoint,
)
from orchestrator.schedules import lr_lambda
from orchestrator.spec import ExperimentSpec, spec_to_yaml
from orchestrator.tracking import (
    COMMIT_TAG,
    KIND_TAG,
    TRIAL_TAG,
    ConsoleLogger,
    MetricsLogger,
    MlflowLogger,
    MlflowTracker,
    flatten,
)
from tasks import build_task
from tasks.base import WorkerContext


class InjectedFailure(RuntimeError):
    """Raised at `fail_at_step` (a fault-injection knob of launch.run_training) to exercise resume."""


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    # On CPU: the worker process's peak resident set (ru_maxrss is in KiB on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def _gather(obj: Any, world_size: int) -> list[Any]:
    """Every rank's `obj`, on every rank (the checkpoint keeps each rank's RNG and data position)."""
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _is_report_step(step: int, spec: ExperimentSpec) -> bool:
    run = spec.run
    return step % run.eval_every == 0 or step % run.checkpoint_every == 0 or step == spec.optim.max_steps


def _open_logger(spec: ExperimentSpec, config: dict[str, Any], run_id: str | None, resumed: bool,
                 counts: dict[str, int]) -> tuple[MetricsLogger, MlflowTracker, MlflowLogger]:
    """Rank 0's console + MLflow logger; the run is reopened (resume) or found by trial id, never duplicated."""
    tracker = MlflowTracker(spec.tracking.uri, retries=spec.tracking.retries, timeout_s=spec.tracking.timeout_s)
    trial_id = config.get("trial_id")
    tags = {KIND_TAG: spec.model.attention.kind, COMMIT_TAG: config.get("commit", "unknown"), **config.get("tags", {})}

    def open_run() -> str | None:
        opened = tracker.open_run(spec.tracking.experiment or spec.name, config.get("run_name", spec.name), tags,
                                  run_id=run_id, find_by=(TRIAL_TAG, trial_id) if trial_id else None)
        if opened is not None and not (resumed and run_id):  # a run first opened now gets its params
            params = flatten(spec.model_dump(mode="json"))
            params.update({"params.attention": counts["attention"], "params.total": counts["total"]})
            tracker.log_params(opened, params)
            tracker.set_tags(opened, tags)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "spec.yaml"
                path.write_text(spec_to_yaml(spec))
                tracker.log_artifact(opened, path)
        return opened

    label = spec.name if not trial_id else f"{spec.name} {trial_id}"
    mlflow_logger = MlflowLogger(tracker, open_run)
    return MetricsLogger([ConsoleLogger(label, spec.optim.max_steps), mlflow_logger]), tracker, mlflow_logger


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. `config`: spec (resolved, JSON), mlflow_run_id, run_name, trial_id, commit,
    tags, fail_at_step; everything else comes from the spec."""
    spec = ExperimentSpec.model_validate(config["spec"])
    optim, run = spec.optim, spec.run
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()

    # Same init on every rank (DDP also broadcasts it), then per-rank streams for dropout and masking.
    _seed_all(optim.seed)
    task = build_task(spec.task, spec.model, WorkerContext(rank=rank, world_size=world_size, seed=optim.seed,
                                                           device=device, cache_dir=Path(config["cache_dir"])))
    raw_model = task.build_model()
    counts = raw_model.parameter_counts()
    model = ray.train.torch.prepare_model(raw_model)
    _seed_all(optim.seed + 1000 * rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim))
    use_bf16 = run.precision == "bf16" and device.type == "cuda"
    # bf16 keeps fp32's exponent range, so no loss scaling; the (disabled) scaler keeps the checkpoint format
    # ready for fp16.
    scaler = torch.amp.GradScaler(device.type, enabled=False)

    step, position, run_id = 0, None, config.get("mlflow_run_id")
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = read_checkpoint(Path(directory))
        _unwrap(model).load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
        scheduler.load_state_dict(state.scheduler)
        scaler.load_state_dict(state.scaler)
        step, run_id = state.step, state.mlflow_run_id or run_id
        if rank < len(state.data_positions):
            position = state.data_positions[rank]
            restore_rng(state.rng[rank])

    logger, tracker, mlflow_logger = (
        _open_logger(spec, config, run_id, checkpoint is not None, counts) if rank == 0
        else (MetricsLogger(), None, None)
    )
    if mlflow_logger is not None and checkpoint is not None:
        sys.stdout.write(f"[{spec.name}] resumed from step {step} (MLflow run {mlflow_logger.run_id})\n")

    fail_at_step = config.get("fail_at_step")
    batches = task.train_batches(position)
    loss_sum, loss_count, tokens, window_start = 0.0, 0, 0, time.perf_counter()
    status = "FAILED"
    try:
        model.train()
        while step < optim.max_steps:
            for micro in range(optim.grad_accum):
                batch, position = next(batches)
                batch = batch.to(device)
                last = micro == optim.grad_accum - 1
                sync = model.no_sync() if isinstance(model, nn.parallel.DistributedDataParallel) and not last else nullcontext()
                with sync, torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                    loss = task.loss(model, batch)
                (loss / optim.grad_accum).backward()
                loss_sum += loss.item()
                loss_count += 1
                tokens += batch.n_tokens
            if optim.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            step += 1

            train_metrics: dict[str, float] = {}
            if step % run.log_every == 0 or _is_report_step(step, spec):
                elapsed = max(time.perf_counter() - window_start, 1e-9)
                train_metrics = {
                    "train/loss": loss_sum / max(loss_count, 1),
                    # Every rank consumes a batch of about the same size, so rank 0's rate x world size.
                    "train/tokens_per_s": tokens * world_size / elapsed,
                    "lr": lr,
                    "memory/peak_gb": _peak_memory_gb(device),
                }
                loss_sum, loss_count, tokens, window_start = 0.0, 0, 0, time.perf_counter()
            if not _is_report_step(step, spec):
                if train_metrics:
                    logger.log(train_metrics, step)
            else:
                # Task.evaluate scores the full split on its own, so only rank 0 runs it (Ray keeps rank 0's
                # metrics); the unwrapped module, because DDP's forward would wait for the other ranks.
                val_metrics: dict[str, float] = {}
                if rank == 0:
                    model.eval()
                    with torch.no_grad():
                        val_metrics = task.evaluate(_unwrap(model))
                    model.train()
                logger.log({**train_metrics, **val_metrics}, step)
                # The run id may appear late (tracking server down at the start): store the current one.
                current_run_id = mlflow_logger.run_id if mlflow_logger is not None else run_id
                _report(spec, config, step, {**train_metrics, **val_metrics}, model, optimizer, scheduler, scaler,
                        position, current_run_id, rank, world_size)
                window_start = time.perf_counter()  # evaluation time is not training throughput
            if fail_at_step is not None and step == fail_at_step:
                raise InjectedFailure(f"injected failure after step {step} (the fail_at_step hook of launch.run_training and run_sweep)")
        status = "FINISHED"
        if mlflow_logger is not None and mlflow_logger.run_id is not None:
            for name, path in task.artifacts().items():
                if Path(path).exists():
                    tracker.log_artifact(mlflow_logger.run_id, Path(path), artifact_path=f"task/{name}")
    finally:
        logger.close(status)


def _report(spec: ExperimentSpec, config: dict[str, Any], step: int, metrics: dict[str, float], model: nn.Module,
            optimizer: torch.optim.Optimizer, scheduler: Any, scaler: torch.amp.GradScaler,
            position: dict[str, Any] | None, run_id: str | None, rank: int, world_size: int) -> None:
    """One `ray.train.report` on every rank; with a checkpoint (written by rank 0 only) when it is due."""
    due = step % spec.run.checkpoint_every == 0 or step == spec.optim.max_steps
    positions = _gather(position, world_size) if due else []
    rngs = _gather(capture_rng(), world_size) if due else []
    report = {"step": step, **metrics}
    if not due:
        ray.train.report(report)
        return
    tmp = Path(tempfile.mkdtemp(prefix="orchestrator-ckpt-"))
    try:
        ckpt = None
        if rank == 0:
            state = TrainingState(
                step=step, model=_unwrap(model).state_dict(), optimizer=optimizer.state_dict(),
                scheduler=scheduler.state_dict(), scaler=scaler.state_dict(), data_positions=positions, rng=rngs,
                mlflow_run_id=run_id, spec=config["spec"],
            )
            ckpt = ray.train.Checkpoint.from_directory(str(write_checkpoint(tmp, state, spec_to_yaml(spec))))
        # Named by step, not Ray's timestamp default, so storage listings read as a training history.
        ray.train.report(report, checkpoint=ckpt, checkpoint_dir_name=f"checkpoint_{step:09d}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
