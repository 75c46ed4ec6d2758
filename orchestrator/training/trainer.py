"""The training core: the one loop that trains a spec's task and model, without Ray or MLflow.

Shape of a step (nanoGPT's train.py; orchestrator/training/optimizer_step.py): `grad_accum` micro-batches -> bf16 / fp16
autocast -> backward of loss x its share of the step's tokens -> unscale -> clip -> AdamW -> LR schedule. No micro-batch
waits for the device: losses are summed there, read once per logging window, and batches are built ahead on a background
thread (`Prefetcher`, pinned memory on CUDA). Around the steps, `Cadence` says when to log, evaluate, report and
checkpoint; `Best` keeps the best value of the spec's metric; `checkpoint_state` captures what resumes the run exactly
(model, optimizer, schedule, scaler, every rank's data position and RNG states incl. CUDA, best so far).

Who drives it: the Ray Train worker (orchestrator/launch/worker.py: rank, DDP, ray.train.report, checkpoints in Ray
storage), the Ray-free runner (orchestrator/launch/local_run.py: checkpoints in a folder; the benchmarks and the
golden-loss test), and the throughput benchmark (`train_step` alone). What differs between them goes through
`TrainerHooks`; nothing else is allowed to step an optimizer.
"""

from __future__ import annotations

import copy
import math
import queue
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from models import checkpoint_activations
from orchestrator.spec import ExperimentSpec, RunSettings
from orchestrator.spec.counting import workload
from orchestrator.spec.gpus import model_flops_utilization
from orchestrator.training.checkpoint import TrainingState, capture_rng, restore_rng
from orchestrator.training.optimizer_step import (
    LossMeter,
    Optimization,
    is_wrapped,
    train_step,
)
from orchestrator.training.sharding import (
    evaluate_replica,
    full_model_state,
    is_sharded,
    restore_own_shards,
    restore_sharded,
    shard_tensors,
)
from tasks import Batch, Task, WorkerContext, build_task
from tasks.device_memory import peak_memory_gb


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under a DDP wrapper: what checkpoints and evaluation see (FSDP2 shards in place, no wrapper).
    (`run.compile` compiles that module in place, so its state_dict keys stay those of the eager model.)"""
    return model.module if is_wrapped(model) else model


def set_tf32(run: RunSettings, device: torch.device) -> None:
    """TF32 matmuls and convolutions on CUDA per run.tf32 (a process-wide switch: one run per worker process)."""
    if device.type == "cuda":
        precision = "tf32" if run.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision


# --- when things happen ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cadence:
    """When a step logs, evaluates and checkpoints: the one definition (sweep.py counts ASHA's rungs with it).

    Every checkpoint step is also an evaluation step, so every checkpoint carries the metric that ranks it
    (Ray's CheckpointConfig score attribute); the last step always checkpoints.
    """

    max_steps: int
    log_every: int
    eval_every: int
    checkpoint_every: int

    @classmethod
    def of(cls, spec: ExperimentSpec) -> Cadence:
        run = spec.run
        return cls(spec.optim.max_steps, run.log_every, run.eval_every, run.checkpoint_every)

    def checkpoints(self, step: int) -> bool:
        return step % self.checkpoint_every == 0 or step == self.max_steps

    def reports(self, step: int) -> bool:
        """Evaluate and report (to Ray: one Tune iteration, one ASHA time unit)."""
        return step % self.eval_every == 0 or self.checkpoints(step)

    def logs(self, step: int) -> bool:
        """train/* metrics close a window here."""
        return step % self.log_every == 0 or self.reports(step)

    def report_count(self) -> int:
        return self.reports_until(self.max_steps)

    def reports_until(self, step: int) -> int:
        """Reports at steps 1..step: a resumed run's count continues where the uninterrupted run's would be. A run
        that trains nothing (max_steps 0) reports once, its evaluation at step 0."""
        if self.max_steps == 0:
            return 1
        return sum(1 for s in range(1, step + 1) if self.reports(s))


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite (run.stop_on_nan): the run stops before that state is checkpointed."""


def check_finite(metrics: Mapping[str, float], step: int, lr: float) -> None:
    """Raise NonFiniteLoss when a loss in `metrics` is NaN or infinite. Checked on every logging window, and
    every checkpoint step closes one, so no diverged state reaches a checkpoint."""
    for key in ("train/loss", "val/loss"):
        value = metrics.get(key)
        if value is not None and not math.isfinite(value):
            raise NonFiniteLoss(f"{key} is {value} at step {step} (lr {lr:.3g}): the run stops without "
                                "checkpointing this state (run.stop_on_nan); lower optim.lr or tighten "
                                "optim.grad_clip, or set run.stop_on_nan=false to train on regardless")


# --- accounting ----------------------------------------------------------------------------------------


@dataclass
class Best:
    """The best value of the compared metric so far, and the step that reached it."""

    metric: str
    mode: str
    value: float | None = None
    step: int | None = None

    def update(self, metrics: Mapping[str, float], step: int) -> bool:
        """Take `metrics[self.metric]` if it beats or ties the best; True when it did. NaN never wins."""
        value = metrics.get(self.metric)
        if value is None or math.isnan(value):
            return False
        # A tie goes to the later step, the one Ray's CheckpointConfig keeps (ray/train/_internal/checkpoint_manager.py
        # `_insert_into_sorted_list`); else best/step named a deleted checkpoint (accuracy ties, BLEU 0 at the start).
        better = self.value is None or (value <= self.value if self.mode == "min" else value >= self.value)
        if better:
            self.value, self.step = float(value), step
        return better

    def as_metrics(self) -> dict[str, float]:
        return {} if self.value is None else {f"best/{self.metric}": self.value, "best/step": float(self.step)}


# --- batches ahead of the device ---------------------------------------------------------------------------


def pinned(batch: Batch) -> Batch:
    """The batch in page-locked host memory, so that `Batch.to(cuda)` (non_blocking) copies asynchronously."""
    return replace(batch, tensors={k: v.pin_memory() for k, v in batch.tensors.items()})


class Prefetcher:
    """Runs a task's batch stream on a background thread, `depth` batches ahead of the training thread.

    The stream is consumed in its own order by one thread, so the batches and the positions after them are
    exactly those of the stream itself; only their construction (tokenising, masking, packing, pinning)
    overlaps the step. Batch construction draws no global RNG (tasks seed each batch by its identity), so
    dropout streams on the training thread are unchanged. An error in the stream is raised on the training
    thread at the batch it would have been.
    """

    _END = object()

    def __init__(self, stream: Iterator[tuple[Batch, Any]], depth: int, pin: bool):
        self._stream, self._pin = stream, pin
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self) -> None:
        try:
            for batch, position in self._stream:
                if not self._put((pinned(batch) if self._pin else batch, position)):
                    return
            self._put(self._END)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread, which raises it
            self._put(err)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[Batch, Any]:
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (the batches it built ahead are dropped; positions come from consumed batches)."""
        self._stop.set()
        self._thread.join(timeout=10)


# --- the loop ---------------------------------------------------------------------------------------------


class TrainerHooks(Protocol):
    """What a driver of the core does at the loop's events (every rank calls them)."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """train/* metrics of a logging step that is not a report step."""

    def report(self, trainer: Trainer, step: int, metrics: Mapping[str, float], checkpoint: bool) -> None:
        """Evaluation step: metrics (val/* on rank 0 only), and `trainer.checkpoint_state()` when `checkpoint`."""

    def after_step(self, step: int) -> None:
        """After every step's logging and reporting (fault injection, time limits)."""


@dataclass
class Trainer:
    """A task, its model (possibly DDP-wrapped) and its optimization, stepped to `optim.max_steps`."""

    spec: ExperimentSpec
    task: Task
    model: nn.Module
    device: torch.device
    rank: int = 0
    world_size: int = 1
    gather: Callable[[Any], list[Any]] = field(default=lambda obj: [obj])
    """Every rank's object on every rank (torch.distributed.all_gather_object under DDP)."""
    step: int = 0
    position: dict[str, Any] | None = None
    """The training stream's position after the last consumed batch."""
    eval_replica: nn.Module | None = None
    """Sharded runs, rank 0: an unsharded copy of the model that evaluation loads the gathered weights into
    (Task.evaluate runs on rank 0 alone, and a sharded forward is a collective of every rank)."""
    flops_per_token: float | None = None
    """Training FLOPs per position of a micro-batch (orchestrator.spec.counting.flops_per_token), set by whoever logs
    it (the Ray worker's rank 0); with it and a device in the GPU table, `train/mfu` is logged."""
    device_name: str | None = None
    """torch.cuda.get_device_name of a CUDA device (None on CPU): the GPU table's row of `train/mfu`'s peak."""

    def __post_init__(self) -> None:
        self.opt = Optimization.build(self.model, self.spec.optim, self.device, self.spec.run.precision)
        if self.device_name is None and self.device.type == "cuda":
            self.device_name = torch.cuda.get_device_name(self.device)
        self.cadence = Cadence.of(self.spec)
        self.best = Best(self.spec.metric, self.spec.mode)

    @classmethod
    def create(cls, spec: ExperimentSpec, ctx: WorkerContext, *, wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
               gather: Callable[[Any], list[Any]] | None = None,
               initialize: Callable[[nn.Module], None] | None = None) -> Trainer:
        """Build the task and model with the same initial weights on every rank (the spec's seed), let
        `initialize` change them (pretrained weights, frozen parameters: orchestrator/launch/pretrained.py), apply
        run.activation_checkpointing and run.compile to the module, wrap the model (DDP / FSDP, device
        placement), then give each rank its own stream for dropout and masking."""
        seed_everything(spec.optim.seed)
        set_tf32(spec.run, ctx.device)
        task = build_task(spec.task, spec.model, ctx)
        model = task.build_model()
        if initialize is not None:
            initialize(model)
        # Taken before compile and activation checkpointing: evaluation needs neither.
        replica = copy.deepcopy(model) if spec.run.strategy == "fsdp" and ctx.rank == 0 else None
        if spec.run.activation_checkpointing:
            checkpoint_activations(model)
        if spec.run.compile:
            # In place (nn.Module.compile): the module keeps its parameters' names, so checkpoints, evaluation
            # and DDP see the eager model's state_dict; compiled before wrapping, as torch's DDP notes advise.
            model.compile(backend=spec.run.compile_backend)
        model = wrap(model)
        seed_everything(spec.optim.seed + 1000 * ctx.rank)
        return cls(spec, task, model, ctx.device, ctx.rank, ctx.world_size, gather or (lambda obj: [obj]),
                   eval_replica=replica if is_sharded(model) else None)

    # --- state ---------------------------------------------------------------------------------------

    def restore(self, state: TrainingState, shards: Path | None = None) -> None:
        """Continue from a checkpoint of this run: weights, optimizer, schedule, step, best, and this rank's
        data position, stream state and RNG (a run resumed on fewer ranks keeps the positions it has). A sharded
        state read without its tensors (`read_checkpoint(in_full=False)`) comes with its DCP folder, `shards`."""
        if state.sharded != is_sharded(self.model):
            raise ValueError(f"checkpoint of step {state.step} was written by a {'sharded' if state.sharded else 'DDP'} "
                             f"run; this run is {'sharded' if is_sharded(self.model) else 'not sharded'}: resume it "
                             "with the run.strategy it was trained with")
        if state.sharded and not state.model:
            if shards is None:
                raise ValueError(f"checkpoint of step {state.step} was read without its shards: pass its folder")
            restore_own_shards(self.model, self.opt.optimizer, shards, state.optimizer.get("param_groups", []))
        elif state.sharded:
            # The full (FQN-keyed) state, read from every rank's shards; each rank keeps its own shard of it.
            restore_sharded(self.model, self.opt.optimizer, state.model, state.optimizer)
        else:
            unwrap(self.model).load_state_dict(state.model)
            self.opt.optimizer.load_state_dict(state.optimizer)
        self.opt.scheduler.load_state_dict(state.scheduler)
        self.opt.scaler.load_state_dict(state.scaler)
        self.step = state.step
        if state.best:
            self.best.value, self.best.step = state.best.get("value"), state.best.get("step")
        if self.rank < len(state.data_positions):
            self.position = state.data_positions[self.rank]
            restore_rng(state.rng[self.rank])
        restore_stream = getattr(self.task, "restore_stream_state", None)
        if restore_stream is not None and self.rank < len(state.stream_states):
            restore_stream(state.stream_states[self.rank])

    def checkpoint_state(self, mlflow_run_id: str | None) -> TrainingState | None:
        """The resumable state on rank 0 (None elsewhere) of a run that is not sharded; see `checkpoint_parts`."""
        return self.checkpoint_parts(mlflow_run_id)[0]

    def checkpoint_parts(self, mlflow_run_id: str | None) -> tuple[TrainingState | None, dict[str, Any] | None]:
        """The resumable state on rank 0 (None elsewhere), and a sharded run's model and optimizer tensors as this
        rank holds them (every rank writes its own, through torch.distributed.checkpoint; None when not sharded).
        Every rank must call it: positions and RNG states are gathered, and the shards' state dict is a
        collective, taken once for both parts."""
        positions, rngs = self.gather(self.position), self.gather(capture_rng())
        # A task's state between batches (Transformer-XL memory) belongs with its position; most tasks have none.
        stream_state = getattr(self.task, "stream_state", None)
        streams = self.gather(stream_state() if stream_state is not None else None)
        sharded, shards = is_sharded(self.model), None
        if sharded:
            # Rank 0's state carries the optimizer's param groups, which name parameters by FQN.
            shards, groups = shard_tensors(self.model, self.opt.optimizer)
            model_state, optim_state = {}, {"param_groups": groups}
        elif self.rank == 0:
            model_state, optim_state = unwrap(self.model).state_dict(), self.opt.optimizer.state_dict()
        if self.rank != 0:
            return None, shards
        state = TrainingState(
            step=self.step, model=model_state, optimizer=optim_state,
            scheduler=self.opt.scheduler.state_dict(), scaler=self.opt.scaler.state_dict(),
            data_positions=positions, rng=rngs, mlflow_run_id=mlflow_run_id, stream_states=streams,
            spec=self.spec.model_dump(mode="json"),
            best={"metric": self.best.metric, "value": self.best.value, "step": self.best.step}, sharded=sharded,
        )
        return state, shards

    # --- evaluation and the loop ---------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """The task's validation metrics on rank 0 ({} elsewhere: Task.evaluate scores the whole split by
        itself). The unwrapped module, because DDP's forward would wait for the other ranks."""
        model = unwrap(self.model)
        if is_sharded(self.model):
            # Gathering the full weights is a collective of every rank; rank 0 evaluates its unsharded replica.
            weights = full_model_state(self.model)
            if self.rank != 0:
                return {}
            assert self.eval_replica is not None, "Trainer.create keeps a replica on rank 0 of a sharded run"
            return evaluate_replica(self.eval_replica, weights, self.device, self.task.evaluate)
        if self.rank != 0:
            return {}
        model.eval()
        with torch.no_grad():
            metrics = self.task.evaluate(model)
        model.train()
        return metrics

    def _batches(self, stream: Iterator[tuple[Batch, dict[str, Any]]]) -> Iterator[Batch]:
        for batch, self.position in stream:
            yield batch

    def _window_metrics(self, meter: LossMeter, lr: float, skipped_before: int) -> dict[str, float]:
        micro_batches, tokens = meter.micro_batches, meter.tokens
        metrics = {**meter.read(self.world_size), "lr": lr, "memory/peak_gb": peak_memory_gb(self.device)}
        mfu = self._mfu(metrics["train/tokens_per_s"], micro_batches, tokens)
        if mfu is not None:
            metrics["train/mfu"] = mfu
        if self.opt.scaler.is_enabled():
            # fp16: steps of this window whose gradients overflowed (skipped, the scale lowered), and the scale.
            metrics["train/skipped_steps"] = float(self.opt.skipped_steps - skipped_before)
            metrics["train/loss_scale"] = self.opt.scaler.get_scale()
        return metrics

    def _mfu(self, tokens_per_s: float, micro_batches: int, tokens: int) -> float | None:
        """MFU of a window of `micro_batches` holding `tokens` target tokens, at `tokens_per_s` (train/tokens_per_s).
        FLOPs per token count every position of a micro-batch (`plan`'s workload), train/tokens_per_s the target
        tokens (a masked LM's masked ones, a classifier's examples), so the rate is scaled to positions first (for
        a causal LM the two are the same). A translation batch in the workload is the loader's worst, full-length
        one, so a translation run's MFU errs high."""
        if self.flops_per_token is None or self.device_name is None or tokens == 0:
            return None
        positions_per_s = tokens_per_s * micro_batches * workload(self.spec).tokens / tokens
        return model_flops_utilization(positions_per_s, self.flops_per_token, self.device_name, self.world_size)

    def fit(self, hooks: TrainerHooks) -> None:
        """Train from `self.step` to optim.max_steps."""
        stream = self.task.train_batches(self.position)
        depth = self.spec.run.prefetch_batches
        prefetcher = Prefetcher(stream, depth, pin=self.device.type == "cuda") if depth > 0 else None
        try:
            self._fit(hooks, self._batches(prefetcher if prefetcher is not None else stream))
        finally:
            if prefetcher is not None:
                prefetcher.close()

    def _fit(self, hooks: TrainerHooks, batches: Iterator[Batch]) -> None:
        meter, skipped_before = LossMeter(), self.opt.skipped_steps
        if self.spec.optim.max_steps == 0:
            # Scoring without training (task.kind: pretrained_lm): one evaluation, reported at step 0, and no
            # checkpoint, since the weights are the pretrained model's own.
            val_metrics = self.evaluate()
            self.best.update(val_metrics, 0)
            hooks.report(self, 0, {**val_metrics, **self.best.as_metrics()}, False)
            return
        self.model.train()
        while self.step < self.spec.optim.max_steps:
            lr = train_step(self.model, batches, self.task.loss, self.opt, self.device, meter)
            self.step += 1
            step = self.step
            train_metrics: dict[str, float] = {}
            stop_on_nan = self.spec.run.stop_on_nan
            if self.cadence.logs(step):
                train_metrics = self._window_metrics(meter, lr, skipped_before)
                skipped_before = self.opt.skipped_steps
                if stop_on_nan:
                    check_finite(train_metrics, step, lr)
            if self.cadence.reports(step):
                val_metrics = self.evaluate()
                if stop_on_nan:
                    check_finite(val_metrics, step, lr)
                self.best.update(val_metrics, step)
                hooks.report(self, step, {**train_metrics, **val_metrics, **self.best.as_metrics()},
                             self.cadence.checkpoints(step))
                meter.restart_clock()
            elif train_metrics:
                hooks.log(train_metrics, step)
            hooks.after_step(step)
