"""What one training step of a trial's model costs, counted without running it on a GPU.

The step (forward, loss, backward, AdamW) of the trial's model at its batch and sequence length runs on fake
tensors (`FakeTensorMode`: shapes and dtypes, no storage), so a 16k-token model is measured without allocating it:
- FLOPs from PyTorch's own counter (`torch.utils.flop_counter.FlopCounterMode`), attention at the trial's n, k,
  buckets and blocks included, because the attention kind's own code runs;
- peak memory from PyTorch's tracker (`torch.distributed._tools.mem_tracker.MemTracker`, the pattern of
  torchtitan's former scripts/estimate/estimation.py): two steps, so the second holds AdamW's state and the
  gradients the first made, under the trial's autocast, activation checkpointing and reversible layers.
A model's layers are identical, so every count is affine in depth: a trial deeper than a few layers is counted at
depth 1 and at depth 2 (per stack, for translation's encoder and decoder) and extrapolated (`depth_probes`), which
keeps a 6-layer, 16k-token trial's count to the cost of three layers. tests/test_plan.py checks the FLOPs against a
real CPU run, the memory against the benchmark harness's allocator-based peak, and the extrapolation against a
count of the whole model. orchestrator/spec/plan.py turns the counts into a study's plan on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from orchestrator.spec.models import ExperimentSpec
from orchestrator.spec.vocabulary import counted_spec, with_vocab_size

ATTENTION_BLOCKS = 8
"""Row blocks of one exact-attention call in a count (kernels.blockwise.at_most_blocks). A GPU run's fused kernel
keeps no block of logits; this keeps one of 1/8 of the rows: at n = 16384, 8 heads and batch 1, 1 GiB per fp32
buffer (4 GiB with the backward's four) if a call spans the whole sequence."""
PLANNED_TASKS = ("mlm", "clm", "bytelm", "mqar", "classify", "listops", "translation")
"""Task kinds `workload` builds; a run of another kind logs no FLOPs per token."""
STATE_KINDS = ("Parameter", "Buffer", "Gradient", "Optstate")
"""MemTracker's kinds of memory that do not grow with the batch (and that FSDP shards)."""


@dataclass(frozen=True)
class Workload:
    """A trial's model, one micro-batch of inputs (made in the caller's mode, fake or real) and its loss."""

    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[torch.Tensor, ...]]
    """Inputs of a batch of this many rows; the last tensor is the target."""
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    batch: int
    positions: int
    """Positions of one row: batch x positions is the denominator of FLOPs per token."""

    @property
    def tokens(self) -> int:
        return self.batch * self.positions


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    *inputs, targets = batch
    logits = model(*inputs)
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _segment_loss(mem_len: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]:
    """A Transformer-XL segment's loss in the steady state (model.memory): every layer attends to mem_len cached
    states of the previous segments besides the segment (tasks/lm.py `_loss_sum`), so the count holds the cache and
    the attention over mem_len + seq_len keys; a row's first segment, with none, costs less."""

    def loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        tokens_BT, targets_BT = batch
        dtype = next(model.parameters()).dtype  # the cache's dtype: the model's, as `empty_memory` makes it
        memory = [torch.zeros(tokens_BT.shape[0], mem_len, model.cfg.d_model, dtype=dtype)
                  for _ in model.stack.layers]
        logits_BTV, _ = model(tokens_BT, memory=memory)
        return F.cross_entropy(logits_BTV.flatten(0, -2).float(), targets_BT.flatten())

    return loss


def workload(spec: ExperimentSpec) -> Workload:
    """The model each task kind builds (tasks/*.py `build_model`) and a batch of the shape its loader makes, at
    task.vocab_size (plan_study and flops_per_token set it to the run's: orchestrator/spec/vocabulary.py).
    Masked LM scores all positions here (the task scores ~15%), so its vocabulary projection is overcounted;
    translation takes max_tokens / (2 x max_source_len) pairs of full length, the loader's worst batch."""
    from models import LanguageModel, Seq2SeqTransformer, SequenceClassifier
    from tasks import listops
    from tasks.long_range import BYTE_VOCAB

    task, cfg = spec.task, spec.model
    kind = task.kind
    ints = functools.partial(torch.randint, 0, 2)  # token ids below every vocabulary
    if kind in ("mlm", "clm", "bytelm", "mqar"):
        B, T = task.batch_size, task.seq_len
        vocab = getattr(task, "vocab_size", BYTE_VOCAB)  # bytelm has no task.vocab_size: its ids are bytes
        causal = kind == "clm" or getattr(task, "causal", kind == "mqar")
        loss = _lm_loss if cfg.memory is None else _segment_loss(cfg.memory.mem_len)
        return Workload(lambda: LanguageModel(cfg, vocab, causal=causal),
                        lambda b: (ints((b, T)), ints((b, T))), loss, B, T)
    if kind in ("classify", "listops"):
        B, T = task.batch_size, task.seq_len if kind == "listops" else cfg.max_seq_len
        vocab, classes = ((listops.VOCAB_SIZE, listops.NUM_CLASSES) if kind == "listops"
                          else (task.vocab_size, task.num_classes))
        return Workload(lambda: SequenceClassifier(cfg, vocab, classes, task.pooling),
                        lambda b: (ints((b, T)), ints((b,))), _lm_loss, B, T)
    if kind == "translation":
        S = task.max_source_len
        B = max(1, task.max_tokens // (2 * S))
        return Workload(lambda: Seq2SeqTransformer(cfg, task.vocab_size),
                        lambda b: (ints((b, S)), ints((b, S)), ints((b, S))), _lm_loss, B, S)
    raise ValueError(f"orchestrator plan does not know task.kind={kind!r}")


def _cpu_sdpa_flops(query, key, value, *_args, out_shape=None, **_kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flops(grad_out, query, key, value, *_args, out_shape=None, **_kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out, query, key, value)


def cpu_sdpa_flops() -> dict[Any, Any]:
    """FlopCounterMode has formulas for the CUDA attention kernels but none for the CPU one that SDPA picks here
    (it counted 0 for mha's attention); the same formulas (full n x n, causal or not, as torch counts on a GPU)
    make a plan on this host count what a GPU run would."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops}


@dataclass(frozen=True)
class StepCount:
    """What one micro-batch's training step costs on one device: unsharded, or rank 0's share of an FSDP2 step over
    `shards` workers (`count_step`'s)."""

    flops: int
    """Forward + backward FLOPs of one micro-batch (FlopCounterMode)."""
    peak_bytes: int
    """Peak bytes held over two steps (weights, gradients, AdamW state, activations, temporaries)."""
    by_kind: dict[str, int]
    """MemTracker's split of that peak: Parameter, Gradient, Optstate, Activation, Temp, ..."""
    params_total: int
    params_attention: int


def _autocast(precision: str) -> Any:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def count_step(work: Workload, *, precision: str = "fp32", checkpointing: bool = False, fake: bool = True,
               shards: int = 1) -> StepCount:
    """FLOPs and peak memory of `work`'s training step, on fake tensors (or real CPU ones, for the tests).
    CPU autocast stands in for CUDA's: both run matmuls in the low dtype and keep softmax and norms in fp32.
    With `shards` > 1 the model is sharded by FSDP2 as a run.strategy=fsdp run shards it (models/fsdp.py) over a
    fake process group of that many ranks, and the peak is rank 0's: its shards of the weights, gradients and AdamW
    state, whatever FSDP2 gathers, prefetches and reduces at once, and the activations (`fake_process_group`)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    try:
        return _count_step(work, work.batch, precision, checkpointing,
                           FakeTensorMode() if fake else torch.device("cpu"), shards)
    except DataDependentOutputException:
        # A size read back from the values (a host sync) cannot be answered by shapes alone: such a model is
        # counted on real CPU tensors for one row of the batch and scaled: FLOPs and activations grow with the
        # rows, weights, gradients and AdamW state do not. (lsh sized its layout so until its bounded layout.)
        one = _count_step(work, 1, precision, checkpointing, torch.device("cpu"), shards)
        states = sum(one.by_kind.get(k, 0) for k in STATE_KINDS)
        return dataclasses.replace(one, flops=one.flops * work.batch,
                                   peak_bytes=states + (one.peak_bytes - states) * work.batch)


class _GlobalOnly:
    """A stand-in for FlopCounterMode's module tracker that attributes every op to the total only. The tracker's
    backward hooks fail inside a backward that calls `torch.autograd.grad` (reversible layers recompute their
    blocks that way: models/reversible.py), and a plan reads the total alone."""

    parents = frozenset({"Global"})

    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def _flop_counter() -> Any:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=cpu_sdpa_flops())
    counter.mod_tracker = _GlobalOnly()
    return counter


@contextlib.contextmanager
def fake_process_group(ranks: int) -> Iterator[Any]:
    """A 1-D device mesh over a process group of `ranks` ranks that communicates nothing, this process as rank 0
    (None for one rank): torch's "fake" backend, whose collectives give tensors of the right shapes (of fake tensors,
    here), as torchtitan's memory estimation runs FSDP2 in one process (scripts/estimate/estimation.py). It is the
    default process group while it lasts, so it refuses to start where one exists (a Ray Train worker's)."""
    if ranks == 1:
        yield None
        return
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend, as torchtitan does
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError("counting a sharded step needs a process of its own: this one already has a process group")
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=ranks)
    try:
        yield init_device_mesh("cpu", (ranks,))  # outside fake mode: the mesh reads its ranks back
    finally:
        dist.destroy_process_group()


def _forward_backward(work: Workload, model: nn.Module, rows: int, precision: str,
                      blocks: int = ATTENTION_BLOCKS) -> None:
    from kernels.blockwise import at_most_blocks
    from models.attention.lsh import bounded_layout

    batch = work.inputs(rows)
    # Exact attention's CPU path (the one fake tensors take) in a few large row blocks: each block is a dozen ops,
    # each op costs the same on fake tensors at any size, and the FLOPs are the same (kernels/blockwise.py).
    # LSH's layout at its longest, whatever the hashes: fake tensors have no values to size it by.
    with at_most_blocks(blocks), bounded_layout():
        with _autocast(precision):
            loss = work.loss(model, batch)
        loss.backward()


def peak_tracker() -> Any:
    """MemTracker keeping the peak of the whole step only. Its per-module peaks, which a plan does not read,
    walk every module the tracker has seen on every op: most of a plan's time at 100 modules."""
    from torch.distributed._tools import mem_tracker

    class PeakTracker(mem_tracker.MemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[mem_tracker._TOTAL_KEY]:
                    self._peak_mem[dev] = snap[mem_tracker._TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    return PeakTracker()


@contextlib.contextmanager
def _host_seeded() -> Iterator[None]:
    """The count's model built from seed 0, leaving every random stream of the process as it was. A Train worker
    counts its FLOPs after seeding (or restoring) its run's streams, on the host only, so only the host's
    generator is forked and seeded: `torch.manual_seed` would also reseed every CUDA generator, which
    `fork_rng(devices=[])` does not give back (rank 0 of every GPU run then drew its dropout from seed 0)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)
        yield


def _count_step(work: Workload, rows: int, precision: str, checkpointing: bool, mode: Any,
                shards: int = 1) -> StepCount:
    from models import checkpoint_activations
    from models.fsdp import apply_fsdp

    with fake_process_group(shards) as mesh, _host_seeded(), mode:
        model = work.build().train()
        counts = model.parameter_counts()
        if checkpointing:  # the trainer's order: checkpointing, then the wrapper
            checkpoint_activations(model)
        if mesh is not None:
            apply_fsdp(model, mesh, precision)
            if precision == "bf16":
                precision = "fp32"  # FSDP's bf16 policy computes in bf16 without autocast, as the trainer runs it
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # The tracked step must hold AdamW's state, as every step after the first does. Without checkpointing,
        # a step on zero gradients makes it and one step is both counted and tracked. With checkpointing,
        # FlopCounterMode's module hooks keep recomputed tensors alive (inside the tracked step the peak was 1.2x
        # to 1.7x the allocator's), so a first step is counted and makes the state, and a second is tracked.
        flops = _flop_counter()
        if checkpointing:
            with flops:
                _forward_backward(work, model, rows, precision)
        else:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker = peak_tracker()
        tracker.track_external(model, opt)
        with tracker, contextlib.nullcontext() if checkpointing else flops:
            _forward_backward(work, model, rows, precision)
            opt.step()  # elementwise: no FLOPs to the counter
            opt.zero_grad(set_to_none=True)
        peak = tracker.get_tracker_snapshot("peak")
    by_device = next(iter(peak.values()), {"Total": 0})
    by_kind = {getattr(k, "value", k): int(v) for k, v in by_device.items()}
    return StepCount(int(flops.get_total_flops()), by_kind.pop("Total"), by_kind, int(counts["total"]),
                     int(counts["attention"]))


def count_flops(work: Workload, *, precision: str = "fp32", fake: bool = True) -> int:
    """Forward + backward FLOPs of one micro-batch, without a step's memory tracking and optimizer: what a run logs
    (`flops_per_token`). The same counter and step as `count_step`'s, so the two agree without checkpointing."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        FakeTensorMode,
    )

    try:
        return _count_flops(work, work.batch, precision, FakeTensorMode() if fake else torch.device("cpu"))
    except DataDependentOutputException:  # one real row, scaled (count_step says why)
        return _count_flops(work, 1, precision, torch.device("cpu")) * work.batch


def _count_flops(work: Workload, rows: int, precision: str, mode: Any) -> int:
    with _host_seeded(), mode:
        model = work.build().train()
        with _flop_counter() as flops:
            _forward_backward(work, model, rows, precision, blocks=1)  # the FLOPs do not depend on the blocks
    return int(flops.get_total_flops())


@dataclass(frozen=True)
class DepthProbes:
    """Shallow copies of a spec whose counts give the full model's by an affine combination: the spec with `start`
    layers in every stack, then once per stack with one layer more. A count c that is affine in each stack's depth
    L_i (identical layers, run one after another) is c(L) = c(s) + sum_i (L_i - s) (c(s + e_i) - c(s))."""

    specs: tuple[ExperimentSpec, ...]
    weights: tuple[int, ...]
    """The combination's weights, one per spec: 1 - sum_i (L_i - s) for the base, L_i - s for stack i's probe."""


def _stack_depths(spec: ExperimentSpec) -> dict[str, int]:
    """The model config's depth fields that the task's model builds stacks from."""
    model = spec.model
    if spec.task.kind == "translation":
        decoder = model.layers if model.decoder_layers is None else model.decoder_layers
        return {"layers": model.layers, "decoder_layers": decoder}
    return {"layers": model.layers}


def depth_probes(spec: ExperimentSpec, start: int) -> DepthProbes | None:
    """The probes from `start` layers per stack, or None where they would run as many layers as the model (or the
    layers differ: a Linformer k listed per layer). FLOPs add up layer by layer, so start 0 (no layers, then one)
    counts them exactly. A memory peak is a maximum over the step, and the largest transient of one layer (LSH's
    sort and gather, a recomputed block) adds to the activations of the layers before it once, not per layer: the
    probes of the memory count start at 1, so each holds that transient (tests/test_plan.py)."""
    depths = _stack_depths(spec)
    if isinstance(getattr(spec.model.attention, "k", None), list):
        return None
    if len(depths) > 1:
        # Without decoder layers nothing cross-attends to the encoder, whose layers then get no backward: the
        # stacks' costs add up only once each has a layer.
        start = max(start, 1)
    base = dict.fromkeys(depths, start)
    layouts = [base] + [{**base, name: start + 1} for name in depths]
    if sum(sum(layout.values()) for layout in layouts) >= sum(depths.values()):
        return None
    specs = tuple(spec.model_copy(update={"model": spec.model.model_copy(update=layout)}) for layout in layouts)
    extra = [depths[name] - start for name in depths]
    return DepthProbes(specs, (1 - sum(extra), *extra))


def _combine(counts: list[Any], weights: tuple[int, ...]) -> Any:
    """sum_j w_j counts_j for ints, and field by field (dicts key by key) for StepCounts."""
    if not dataclasses.is_dataclass(counts[0]):
        return sum(w * c for w, c in zip(weights, counts, strict=True))
    fields = {}
    for f in dataclasses.fields(counts[0]):
        values = [getattr(c, f.name) for c in counts]
        if isinstance(values[0], dict):
            keys = sorted(set().union(*values))
            fields[f.name] = {k: _combine([v.get(k, 0) for v in values], weights) for k in keys}
        else:
            fields[f.name] = _combine(values, weights)
    return type(counts[0])(**fields)


def count_by_depth(spec: ExperimentSpec, count: Callable[[Workload], Any], start: int = 1) -> Any:
    """`count(workload(spec))`, through `depth_probes(spec, start)` where they are cheaper."""
    probes = depth_probes(spec, start)
    if probes is None:
        return count(workload(spec))
    return _combine([count(workload(s)) for s in probes.specs], probes.weights)


def flops_per_token(spec: ExperimentSpec, vocab_size: int | None = None) -> float | None:
    """Training FLOPs (forward + backward) per position of `spec`'s micro-batch, the model FLOPs of `train/mfu`;
    None for a task kind `workload` does not build. Counted without activation checkpointing even when the run
    uses it: MFU does not credit the recomputed forward (PaLM, Chowdhery et al., 2022, appendix B), while `plan`'s
    step times and table include it. At `vocab_size`, the vocabulary of the model a worker built (its tokenizer's,
    or model.init_from's), else at the one its run will have, as plan counts it (`counted_spec`)."""
    if spec.task.kind not in PLANNED_TASKS:
        return None
    spec = counted_spec(spec)[0] if vocab_size is None else with_vocab_size(spec, vocab_size)
    count = functools.partial(count_flops, precision=spec.run.precision)
    return count_by_depth(spec, count, start=0) / workload(spec).tokens


