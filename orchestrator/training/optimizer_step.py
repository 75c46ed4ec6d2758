"""One optimizer step, the only code that steps an optimizer (orchestrator/training/trainer.py drives it): `grad_accum`
micro-batches -> bf16 / fp16 autocast -> backward of each micro-batch's loss weighted by its share of the step's
target tokens on every rank (DDP all-reduces on the last micro-batch only; fp16 scales the loss first) -> unscale
-> clip -> AdamW (skipped when fp16 gradients overflowed) -> the learning-rate schedule of `optim.schedule`
(`lr_lambda`). `LossMeter` sums the losses on the device."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.spec import OptimConfig
from orchestrator.training.sharding import is_sharded
from tasks import Batch

LossFn = Callable[[nn.Module, Batch], torch.Tensor]
"""Mean loss over a batch's `n_tokens` target tokens (Task.loss)."""


def is_wrapped(model: nn.Module) -> bool:
    """Wrapped by DDP: gradients sync on the last micro-batch only, the module is `model.module`. (FSDP2 shards
    the module in place: no wrapper, orchestrator/training/sharding.py.)"""
    return isinstance(model, nn.parallel.DistributedDataParallel)


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Inside, a backward all-reduces (DDP) or reduce-scatters (FSDP) the gradients only when `enabled`: off for
    every micro-batch but the last, which then reduces the accumulated sum once (DDP's no_sync; FSDP2's
    set_requires_gradient_sync). The backward must run inside it, since that is where the reduction hooks fire."""
    if enabled:
        yield
    elif is_wrapped(model):
        with model.no_sync():
            yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def lr_lambda(optim: OptimConfig) -> Callable[[int], float]:
    """Multiplier of optim.lr after `step` optimizer steps: linear warmup, then the chosen decay."""
    warmup, total = optim.warmup_steps, optim.max_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup  # never 0: the first step already learns
        if optim.schedule == "constant":
            return 1.0
        if optim.schedule == "inverse_sqrt":
            # Vaswani et al. (2017), eq. 3, normalised to 1 at the end of warmup.
            return math.sqrt(max(warmup, 1)) / math.sqrt(step + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if optim.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class LossMeter:
    """Token-weighted training loss and throughput over a logging window.

    The loss is summed on the device as `loss * n_tokens` and read once per window, so a step never waits
    for the device to say its loss (no host sync per micro-batch).
    """

    def __init__(self) -> None:
        self._weighted: torch.Tensor | None = None
        self.tokens = 0
        self.micro_batches = 0
        """Micro-batches of this window: what `train/mfu` counts positions by (the tokens above are targets)."""
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, n_tokens: int) -> None:
        # float64: a long window of float32 sums would round away the last digits the golden-loss test compares
        term = loss.detach().double() * n_tokens
        self._weighted = term if self._weighted is None else self._weighted + term
        self.tokens += n_tokens
        self.micro_batches += 1

    def restart_clock(self) -> None:
        """Evaluation and checkpointing are not training throughput: the window's clock starts again."""
        self.started = time.perf_counter()

    def read(self, world_size: int = 1) -> dict[str, float]:
        """`train/loss` (mean over this rank's target tokens) and `train/tokens_per_s` (every rank consumes
        about as many tokens, so this rank's rate x world size); then a new window starts."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        loss = self._weighted.item() / max(self.tokens, 1) if self._weighted is not None else math.nan
        out = {"train/loss": loss, "train/tokens_per_s": self.tokens * world_size / elapsed}
        self._weighted, self.tokens, self.micro_batches = None, 0, 0
        self.restart_clock()
        return out


@dataclass
class Optimization:
    """AdamW, its warmup + decay schedule and the gradient scaler of `optim` (enabled for fp16 only)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    grad_accum: int
    grad_clip: float | None
    autocast_dtype: torch.dtype | None
    """The autocast dtype (bf16 or fp16, on CPU as on CUDA); None trains in fp32, or in the bf16 parameters of
    FSDP's mixed-precision policy (orchestrator/training/sharding.py), which needs no autocast."""
    skipped_steps: int = 0
    """fp16 steps skipped so far in this process because a gradient overflowed (inf/NaN after unscaling)."""

    @classmethod
    def build(cls, model: nn.Module, optim: OptimConfig, device: torch.device, precision: str = "fp32",
              fused: bool | None = None) -> Optimization:
        """`fused` (None: on a GPU): AdamW's update in one kernel for every parameter, the same update as the
        multi-tensor `foreach` one, which launches several kernels per step (torchtitan trains FSDP2 models with it
        too); a small model's step spends its time outside the matmuls there (benchmarks/gpu/training.py times
        both; tests/test_mixed_precision.py holds the two to one loss curve)."""
        fused = device.type == "cuda" if fused is None else fused
        # Frozen parameters (model.freeze) stay out of the optimizer: weight decay would still move them.
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=optim.lr,
                                      betas=optim.betas, weight_decay=optim.weight_decay, fused=True if fused else None)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim))
        # bf16 keeps fp32's exponent range, so only fp16 scales the loss (its gradients would underflow); the
        # disabled scaler of the other precisions keeps one checkpoint format.
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
        if is_sharded(model) and precision == "bf16":
            dtype = None  # FSDP's mixed-precision policy already computes in bf16 (as torchtitan: no autocast)
        return cls(optimizer, scheduler, scaler, optim.grad_accum, optim.grad_clip, dtype)

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.scheduler.get_last_lr()[0]


def token_weights(n_tokens: list[int], device: torch.device) -> list[float] | list[torch.Tensor]:
    """Each micro-batch's weight in the step's gradient: its target tokens over the step's tokens on every rank,
    times the ranks (DDP and FSDP average the ranks' gradients), so that the step descends the mean loss over all
    of its tokens, as fairseq normalises a step by its all-reduced sample_size (fairseq/trainer.py train_step,
    `multiply_grads(numer / sample_size)`). A step whose micro-batches hold different counts (masked tokens,
    translation's max_tokens batches) would otherwise weigh a token of a short micro-batch more. Equal counts give
    1 / grad_accum. Across ranks the total is one all-reduce of a device scalar: no host sync."""
    total: int | torch.Tensor = sum(n_tokens)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return [n / max(total, 1) for n in n_tokens]
    total = torch.tensor(float(total), device=device)
    dist.all_reduce(total)
    scale = world / total.clamp_min(1.0)
    return [n * scale for n in n_tokens]


def train_step(model: nn.Module, micro_batches: Iterator[Batch], loss_fn: LossFn, opt: Optimization,
               device: torch.device, meter: LossMeter | None = None) -> float:
    """One optimizer step over `opt.grad_accum` micro-batches; returns the learning rate it used.

    The loss of each micro-batch is its mean over its own target tokens, weighted by its share of the step's
    tokens (`token_weights`): the gradient is that of the mean over every token of the step, on every rank.
    """
    batches = [next(micro_batches) for _ in range(opt.grad_accum)]
    weights = token_weights([batch.n_tokens for batch in batches], device)
    for micro, (batch, weight) in enumerate(zip(batches, weights)):
        batch = batch.to(device)
        autocast = (torch.autocast(device.type, dtype=opt.autocast_dtype) if opt.autocast_dtype is not None
                    else nullcontext())
        with gradient_sync(model, enabled=micro == opt.grad_accum - 1):
            with autocast:
                loss = loss_fn(model, batch)
            # fp16: the scaled loss keeps small gradients above fp16's underflow (a no-op when disabled).
            opt.scaler.scale(loss * weight).backward()
        if meter is not None:
            meter.add(loss, batch.n_tokens)  # n_tokens is a host int: counting tokens never syncs
    scaling = opt.scaler.is_enabled()
    if scaling:
        # Clipping must see the true gradients, so unscale first; step() then does not unscale again.
        opt.scaler.unscale_(opt.optimizer)
    if opt.grad_clip is not None:
        # Sharded (FSDP2), the gradients are DTensors and the norm is taken over every rank's shard.
        nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
    skipped = False
    if scaling:
        # GradScaler.step skips the update when unscale_ found inf/NaN, and update() then lowers the scale: a
        # lower scale is how a skipped step shows (the step already read found_inf on the host, so reading the
        # scale adds no wait of its own).
        scale = opt.scaler.get_scale()
        opt.scaler.step(opt.optimizer)
        opt.scaler.update()
        skipped = opt.scaler.get_scale() < scale
    else:
        opt.optimizer.step()
    opt.optimizer.zero_grad(set_to_none=True)
    lr = opt.lr
    if skipped:
        # No update happened, so the schedule does not advance either (as Accelerate's optimizer_step_was_skipped).
        opt.skipped_steps += 1
    else:
        opt.scheduler.step()
    return lr
