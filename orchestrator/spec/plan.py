"""`orchestrator plan`: what each trial of a study costs before a GPU is spent on it.

Each distinct model's training step is counted once (orchestrator/spec/counting.py: FLOPs and peak memory on fake
tensors); a run.strategy=fsdp trial's step is counted sharded by FSDP2 over its workers, so its memory is one GPU's.
Step time = FLOPs of one optimizer step (grad_accum micro-batches) / (the GPU's dense bf16 peak x MFU);
GPU-hours = step time x optim.max_steps x the GPUs a trial holds.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from orchestrator.spec.counting import StepCount, count_by_depth, count_step, workload
from orchestrator.spec.gpus import DEFAULT_GPU, FIT_FRACTION, GpuKind, gpu_kind
from orchestrator.spec.loading import Study, expected_trials
from orchestrator.spec.models import ExperimentSpec
from orchestrator.spec.search_space import validation_points
from orchestrator.spec.vocabulary import Vocabulary, counted_spec

DEFAULT_MFU = 0.4
"""Model FLOP utilisation assumed for step times: about what torchtitan reports for dense bf16 training of
models of this size on H100s; `--mfu` sets another."""
GIB = 2**30
SHARDED_PROBE_START = 3
"""A sharded step's depth probes start at three layers: what FSDP2 holds unsharded at once (the layer computing,
the one prefetched, the one whose gradients are being reduced) fills up over the first layers, and from three on
each layer adds the same (its shards and activations). Probes from one or two layers put part of that one-off in
every layer's slope: an 8-layer model's peak came out 27% and 15% too high (tests/test_plan.py)."""

@dataclass(frozen=True)
class TrialPlan:
    """One trial of a study, planned on one GPU kind."""

    values: dict[str, Any]
    gpu: GpuKind
    step: StepCount
    tokens: int
    """Positions of one micro-batch on one worker."""
    memory_bytes: int
    """Peak per GPU, after FSDP's sharding."""
    step_s: float
    gpu_hours: float
    fixes: tuple[str, ...]
    """What would make it fit; empty when it fits."""
    gpu_share: float = 1.0
    """The part of a GPU the trial's worker holds (run.gpus_per_worker below 1 packs runs onto one GPU): its peak
    must fit that part of the GPU's memory, beside the runs it shares the GPU with."""
    vocabulary: Vocabulary | None = None
    """The vocabulary the model was counted at, and where its size came from (orchestrator/spec/vocabulary.py)."""

    @property
    def flops_per_token(self) -> float:
        return self.step.flops / self.tokens

    @property
    def fits(self) -> bool:
        return not self.fixes


def gpu_share(spec: ExperimentSpec) -> float:
    """The part of one GPU a worker of `spec` holds: run.gpus_per_worker below 1 (Ray places that many runs on a
    GPU side by side), else the whole GPU (a worker trains on one)."""
    return spec.run.gpus_per_worker if 0 < spec.run.gpus_per_worker < 1 else 1.0


def _fixes(spec: ExperimentSpec, memory: int, gpu: GpuKind) -> tuple[str, ...]:
    share = gpu_share(spec)
    if memory <= FIT_FRACTION * share * gpu.memory_gib * GIB:
        return ()
    fixes = []
    if share < 1:
        fixes.append(f"run.gpus_per_worker=1 (a whole GPU per run, where {spec.run.gpus_per_worker:g} shares it)")
    batch = getattr(spec.task, "batch_size", None)
    if batch and batch > 1:
        fixes.append(f"task.batch_size={batch // 2} optim.grad_accum={spec.optim.grad_accum * 2} (same tokens per "
                     "step, half the activations)")
    if not spec.run.activation_checkpointing and not spec.model.reversible:
        fixes.append("run.activation_checkpointing=true (recompute each layer in backward)")
    if not spec.model.reversible and not spec.run.activation_checkpointing and spec.task.kind != "translation":
        fixes.append("model.reversible=true (RevNet layers: activation memory flat in depth)")
    mem_len = spec.model.memory.mem_len if spec.model.memory is not None else 0
    # Only a causal LM has a memory (and a seq_len: translation and classify do not); Transformer-XL's own runs
    # cache about a segment (mem_len = seq_len or so).
    if mem_len and mem_len > spec.task.seq_len:
        fixes.append(f"model.memory.mem_len={spec.task.seq_len} (each layer's cache and the attention over it grow "
                     f"with mem_len={mem_len})")
    if spec.run.strategy != "fsdp" or spec.run.workers == 1:
        fixes.append("run.strategy=fsdp with run.workers>1 (weights, gradients and AdamW state sharded)")
    fixes.append(f"--gpu with more memory than {gpu.name}'s {gpu.memory_gib:g} GB")
    return tuple(fixes)


def plan_spec(spec: ExperimentSpec, gpu: GpuKind, mfu: float = DEFAULT_MFU, values: dict[str, Any] | None = None,
              vocabulary: Vocabulary | None = None) -> TrialPlan:
    """Plan one trial's spec on `gpu`, its model at task.vocab_size as the spec has it (as `workload(spec)` builds
    it, which benchmarks measure against). `plan_study` sets task.vocab_size to the vocabulary the trial's run will
    have first (`counted_spec`), and passes where that came from as `vocabulary`."""
    key, shards = _step_key(spec), fsdp_shards(spec)
    if key not in _STEPS:
        _STEPS[key] = count_by_depth(spec, functools.partial(count_step, precision=spec.run.precision,
                                                             checkpointing=spec.run.activation_checkpointing,
                                                             shards=shards),
                                     start=1 if shards == 1 else SHARDED_PROBE_START)
    step = _STEPS[key]
    tokens = workload(spec).tokens
    memory = max(step.peak_bytes, rank0_evaluation_bytes(step, shards))
    step_s = step.flops * spec.optim.grad_accum / (gpu.bf16_dense_flops * mfu)
    # A worker holds one GPU (run.gpus_per_worker is at most 1); one packed onto a share of a GPU takes as much
    # longer a step, so it costs the same GPU-hours.
    hours = step_s * spec.optim.max_steps * spec.run.workers / 3600
    return TrialPlan(dict(values or {}), gpu, step, tokens, memory, step_s, hours, _fixes(spec, memory, gpu),
                     gpu_share(spec), vocabulary)


def fsdp_shards(spec: ExperimentSpec) -> int:
    """The workers FSDP shards a trial's weights, gradients and AdamW state over: 1 unless run.strategy=fsdp."""
    return spec.run.workers if spec.run.strategy == "fsdp" else 1


def rank0_evaluation_bytes(step: StepCount, shards: int) -> int:
    """What rank 0 of a sharded run holds on its device while it evaluates (orchestrator/training/sharding.py
    `evaluate_replica`): the unsharded replica in fp32 beside its shards of the fp32 weights and of AdamW's two
    moments (the gradients are freed by then, and a forward without gradients keeps nothing for a backward). On
    many workers this, not the training step, is rank 0's peak: 4 bytes a parameter whole against 16 sharded. 0 for
    an unsharded run, whose evaluation holds less than its step."""
    if shards == 1:
        return 0
    return 4 * step.params_total + 12 * step.params_total // shards


def _step_key(spec: ExperimentSpec) -> str:
    """What the step's cost depends on: trials differing only in lr or seed share one count."""
    return json.dumps({"task": spec.task.model_dump(mode="json"), "model": spec.model.model_dump(mode="json"),
                       "precision": spec.run.precision, "ac": spec.run.activation_checkpointing,
                       "shards": fsdp_shards(spec)}, sort_keys=True)


_STEPS: dict[str, StepCount] = {}
"""Counts by `_step_key`, for the process: a plan of a large grid counts each distinct model once."""


def plan_study(study: Study, gpu_name: str = DEFAULT_GPU, mfu: float = DEFAULT_MFU,
               progress: Callable[[str], None] | None = None) -> Iterator[TrialPlan]:
    """Every trial `validate` checks (each grid combination; choice values and range ends of sampled domains).
    Each model is counted at the vocabulary its run will have (orchestrator/spec/vocabulary.py). `progress` gets a
    line per trial counted (a large model's count takes seconds) and per tokenizer trained."""
    gpu = gpu_kind(gpu_name)
    points = list(validation_points(study.domains, search=study.base.tune.search)) if study.domains else [{}]
    for i, point in enumerate(points, 1):
        start, known = time.perf_counter(), len(_STEPS)
        spec, vocab = counted_spec(study.spec_for(point) if point else study.base)
        plan = plan_spec(spec, gpu, mfu, point, vocab)
        if progress is not None and vocab.trained_s is not None:
            progress(f"plan: trained the builtin corpus's tokenizer in {vocab.trained_s:.1f} s to count its pieces")
        if progress is not None and len(_STEPS) > known:
            progress(f"plan: trial {i}/{len(points)} counted in {time.perf_counter() - start:.1f} s "
                     f"({_label(point, spec.name)})")
        yield plan


def study_gpu_hours(study: Study, plans: list[TrialPlan]) -> float:
    """The study's GPU-hours: each trial planned once per sample (exact for a grid; for sampled domains, the mean
    of the planned points times the trials the sweep runs)."""
    if not plans:
        return 0.0
    return sum(p.gpu_hours for p in plans) / len(plans) * expected_trials(study)


def _value(value: Any) -> str:
    if isinstance(value, dict):  # a whole block per grid value: its kind and knobs, without the braces
        return " ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _label(values: dict[str, Any], name: str) -> str:
    return ", ".join(f"{k.split('.')[-1]}={_value(v)}" for k, v in values.items()) or name


def format_plan(study: Study, plans: list[TrialPlan], mfu: float) -> str:
    """The table `orchestrator plan` prints: one row per trial, then the study's total. Every column is as wide as
    its widest cell: a trial's whole label (trials of a grid differ at its end: `sharing=kv` vs `sharing=none`)."""
    gpu = plans[0].gpu
    header = ["trial", "params", "attn", "GFLOP/tok", "mem GB", "fits", "step s", "GPU-h"]
    rows = [[_label(p.values, study.base.name), f"{p.step.params_total:,}", f"{p.step.params_attention:,}",
             f"{p.flops_per_token / 1e9:.3g}", f"{p.memory_bytes / GIB:.2f}", "yes" if p.fits else "NO",
             f"{p.step_s:.3g}", f"{p.gpu_hours:.3g}"] for p in plans]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"plan on {gpu.name} ({gpu.memory_gib:g} GB, {gpu.bf16_dense_flops / 1e12:g} TFLOP/s dense bf16) at "
             f"{mfu:.0%} MFU; fits = peak <= {FIT_FRACTION:.0%} of the memory a run holds (a share of the GPU below "
             "run.gpus_per_worker=1)"]
    lines += [" ".join([row[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:]))])
              for row in [header, *rows]]
    lines += _vocabulary_lines(study, plans)
    lines.append(f"study: {expected_trials(study):,} trials, {study_gpu_hours(study, plans):.3g} GPU-hours on "
                 f"{gpu.name} at {mfu:.0%} MFU")
    return "\n".join(lines)


def _vocabulary_lines(study: Study, plans: list[TrialPlan]) -> list[str]:
    """The vocabulary each trial's model was counted at and where its size came from: one line for every trial, or
    one per size and source (a grid over task fields)."""
    trials: dict[Vocabulary, list[str]] = {}
    for p in plans:
        if p.vocabulary is not None:
            trials.setdefault(p.vocabulary, []).append(_label(p.values, study.base.name))
    lines = []
    for vocab, labels in trials.items():
        which = ("every trial" if len(trials) == 1 else "; ".join(labels) if len(labels) <= 3
                 else f"{len(labels)} trials: {labels[0]}; ...")
        lines.append(f"vocabulary {vocab.size:,} ({which}): {vocab.source}")
    return lines


def refusals(plans: list[TrialPlan]) -> list[str]:
    """One paragraph per trial that does not fit: its values, its peak, and the fixes."""
    out = []
    for p in plans:
        if p.fits:
            continue
        label = ", ".join(f"{k}={v!r}" for k, v in p.values.items()) or "the spec"
        held = f"{p.gpu.name}'s {p.gpu.memory_gib:g} GB"
        if p.gpu_share < 1:
            held = f"its share of {held} (run.gpus_per_worker={p.gpu_share:g}: {p.gpu_share * p.gpu.memory_gib:g} GB)"
        out.append(f"{label} needs {p.memory_bytes / GIB:.1f} GB per GPU, more than {FIT_FRACTION:.0%} of {held}; "
                   "fixes:\n" + "\n".join(f"  - {f}" for f in p.fixes))
    return out
