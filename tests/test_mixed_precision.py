"""Mixed precision on CPU, the GPU path's arithmetic without a GPU: every attention kind trains under bf16 and
fp16 autocast (torch's CPU autocast) and under bf16 parameters (FSDP's mixed-precision policy), and the parts that
must stay fp32 do.

What must stay fp32: the softmax, its log-sum-exp, the merges of attention parts through their lse (Reformer's
hash rounds, HyperAttention's parts: models/attention/lse.py) and the loss. `HalfPrecisionOps` watches the ATen
ops those are made of as they are dispatched (below autocast, so it sees the dtype that is actually computed) and
records every one that receives a bf16 or fp16 tensor. Fused attention (SDPA, the Triton kernels) is not on the
list: it keeps its softmax in fp32 accumulators internally.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kernels.reference
from models.attention import ATTENTION_KINDS
from orchestrator.launch.local_run import train_locally
from orchestrator.spec import validate_spec
from orchestrator.training.optimizer_step import Optimization, train_step
from orchestrator.training.trainer import Trainer
from tasks import WorkerContext
from tests.attention_cases import tiny_knobs
from tests.test_trainer import tiny_raw

SENSITIVE_OPS = frozenset({
    "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "logsumexp",
    "exp", "log", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
})
HALF = (torch.bfloat16, torch.float16)
NON_CAUSAL = {"linformer"}
"""Kinds that mix future positions, trained as masked LM instead of causal LM."""


class HalfPrecisionOps(TorchDispatchMode):
    """Records sensitive ATen ops that receive a half-precision tensor: {op name: count}."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SENSITIVE_OPS and any(isinstance(t, torch.Tensor) and t.dtype in HALF
                                         for t in tree_leaves((args, kwargs))):
            self.seen[name] = self.seen.get(name, 0) + 1
        return func(*args, **kwargs)


def kind_raw(kind: str, **optim) -> dict:
    raw = tiny_raw(**optim)
    raw["model"] = {**raw["model"], "d_model": 32, "attention": {"kind": kind, "heads": 4, **tiny_knobs(kind)}}
    if kind in NON_CAUSAL:
        raw["task"] = {**raw["task"], "kind": "mlm"}
    return raw


def trainer_of(raw: dict, tmp_path, **run) -> Trainer:
    spec = validate_spec({**raw, "run": {**raw["run"], "prefetch_batches": 0, **run}})
    return Trainer.create(spec, WorkerContext(seed=spec.optim.seed, cache_dir=tmp_path / "cache"))


def steps_under_watch(trainer: Trainer, steps: int) -> tuple[HalfPrecisionOps, list[float]]:
    """`steps` optimizer steps of the core's own train_step (task loss, backward, clipping, AdamW) with the
    sensitive ops watched; returns the watch and the losses."""
    batches = (batch for batch, _ in trainer.task.train_batches(None))
    losses: list[float] = []
    watch = HalfPrecisionOps()
    with watch:
        for _ in range(steps):
            micro = iter([next(batches)])
            loss_fn = trainer.task.loss

            def recorded(model, batch, loss_fn=loss_fn):
                loss = loss_fn(model, batch)
                losses.append(float(loss.detach()))
                return loss

            train_step(trainer.model, micro, recorded, trainer.opt, trainer.device)
    return watch, losses


def bf16_parameter_pass(trainer: Trainer) -> HalfPrecisionOps:
    """Forward, task loss and backward of the model with its parameters in bf16 and no autocast: what FSDP's
    mixed-precision policy (param_dtype=bf16) computes."""
    model = trainer.model.to(torch.bfloat16)
    batch = next(iter(trainer.task.train_batches(None)))[0]
    watch = HalfPrecisionOps()
    with watch:
        loss = trainer.task.loss(model, batch)
        loss.backward()
    assert loss.dtype == torch.float32 and math.isfinite(float(loss))
    return watch


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_kind_trains_under_cpu_autocast_with_fp32_softmax_and_loss(kind, precision, tmp_path):
    trainer = trainer_of(kind_raw(kind), tmp_path, precision=precision)
    assert trainer.opt.autocast_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    watch, losses = steps_under_watch(trainer, 3)
    assert watch.seen == {}, f"{kind} under {precision} autocast computed these in half precision: {watch.seen}"
    assert all(math.isfinite(v) for v in losses)
    moved = sum(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert moved == len(before), f"{len(before) - moved} parameter tensors were not updated"


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_every_kind_keeps_softmax_and_loss_fp32_with_bf16_parameters(kind, tmp_path):
    watch = bf16_parameter_pass(trainer_of(kind_raw(kind), tmp_path))
    assert watch.seen == {}, f"{kind} with bf16 parameters computed these in half precision: {watch.seen}"


@pytest.mark.parametrize("case", ["relative", "memory", "reversible"])
def test_the_other_mechanisms_keep_fp32_under_bf16_autocast(case, tmp_path):
    """Transformer-XL's relative attention and memory, and the reversible stack's recomputing backward."""
    raw = kind_raw("mha")
    model = {"relative": {"positional": "relative"},
             "memory": {"positional": "relative", "memory": {"mem_len": 8}},
             "reversible": {"reversible": True, "layers": 2}}[case]
    raw["model"] = {**raw["model"], **model}
    watch, losses = steps_under_watch(trainer_of(raw, tmp_path, precision="bf16"), 2)
    assert watch.seen == {} and all(math.isfinite(v) for v in losses)


# --- the checks can fail ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lsh", "hyper"])
def test_a_softmax_left_to_autocast_is_caught(kind, tmp_path, monkeypatch):
    """Without the autocast switch-off around the reference attention (kernels/reference.py), autocast casts
    the upcast logits back to bf16 and the lse and its merges run in bf16: the watch must see it."""
    monkeypatch.setattr(kernels.reference, "autocast_off", lambda device_type: nullcontext())
    watch, _ = steps_under_watch(trainer_of(kind_raw(kind), tmp_path, precision="bf16"), 1)
    assert watch.seen.get("logsumexp", 0) > 0 and watch.seen.get("exp", 0) > 0, watch.seen


def test_a_missing_upcast_is_caught_with_bf16_parameters(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels.reference, "_upcast", lambda x: x)
    watch = bf16_parameter_pass(trainer_of(kind_raw("lsh"), tmp_path))
    assert watch.seen.get("logsumexp", 0) > 0, watch.seen


def test_a_loss_computed_in_bf16_is_caught(tmp_path):
    """The tasks' losses upcast the logits (`.float()`); a loss taken on bf16 logits shows in the watch."""
    trainer = trainer_of(kind_raw("mha"), tmp_path)
    model = trainer.model.to(torch.bfloat16)
    tokens = torch.randint(0, 100, (2, 16))
    watch = HalfPrecisionOps()
    with watch:
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert watch.seen.get("_log_softmax", 0) > 0 and watch.seen.get("nll_loss_forward", 0) > 0, watch.seen


# --- the curve ----------------------------------------------------------------------------------------------

CURVE_STEPS = 50
CURVE_TOLERANCE = 0.01
"""Largest |bf16 - fp32| allowed on the 50-step training loss curve, in nats (the curve falls from 6.43 to 4.41).
bf16 keeps 8 significant bits (unit roundoff 2^-8), so the two runs' weights drift apart slowly; measured
on this spec: at most 0.0021 over the 50 steps, 0.0017 at the last (torch 2.13 CPU). A tolerance of about 5x
that passes rounding and fails a real error: a softmax or loss left in bf16 moves a step's loss by ~1e-2."""


def test_a_bf16_run_follows_the_fp32_loss_curve_over_50_steps(tmp_path):
    curves = {}
    for precision in ("fp32", "bf16"):
        raw = kind_raw("mha", max_steps=CURVE_STEPS)
        raw["run"] = {**raw["run"], "precision": precision, "log_every": 1, "eval_every": CURVE_STEPS,
                      "checkpoint_every": CURVE_STEPS}
        _, hooks = train_locally(validate_spec(raw), cache_dir=tmp_path / "cache")
        curves[precision] = {step: m["train/loss"] for step, m in hooks.history if "train/loss" in m}
    assert sorted(curves["bf16"]) == list(range(1, CURVE_STEPS + 1))
    gaps = [abs(curves["bf16"][s] - curves["fp32"][s]) for s in curves["fp32"]]
    assert max(gaps) <= CURVE_TOLERANCE, f"bf16 left the fp32 curve by {max(gaps):.4f} nats"
    assert gaps[-1] > 0  # the two runs really computed in different precisions
    assert curves["fp32"][CURVE_STEPS] < curves["fp32"][1] - 0.5  # and both learned


def test_the_curves_benchmark_writes_each_precisions_gap_to_fp32(tmp_path):
    """benchmarks/studies/cpu_curves.py at toy length (its sharding part trains through Ray: run by hand,
    RESULTS.md)."""
    from benchmarks.studies.cpu_curves import main
    from benchmarks.harness import read_csv

    rows = main(["--part", "precision", "--steps", "3", "--out", str(tmp_path)])
    assert [(r["run"], r["step"]) for r in rows] == [(p, s) for p in ("fp32", "bf16", "fp16") for s in (1, 2, 3)]
    assert all(r["gap"] == 0.0 for r in rows if r["run"] == "fp32")
    assert any(r["gap"] != 0.0 for r in rows if r["run"] == "bf16")
    written = read_csv(next(tmp_path.glob("*/cpu_curves.csv")))
    assert len(written) == 9 and next(tmp_path.glob("*/cpu_curves.png")).stat().st_size > 0


def test_the_fused_adamw_a_gpu_steps_with_follows_the_foreach_curve_under_bf16(tmp_path):
    """On a GPU the core steps AdamW fused (Optimization.build; benchmarks/gpu/training.py times it against the
    foreach one). The same update on the CPU, where torch has both: 20 bf16-autocast steps of the core's
    train_step from the same seed give the same losses, up to float rounding."""
    curves = {}
    for fused in (False, True):
        trainer = trainer_of(kind_raw("mha", max_steps=20, lr=3e-3), tmp_path, precision="bf16")
        trainer.opt = Optimization.build(trainer.model, trainer.spec.optim, trainer.device, "bf16", fused=fused)
        assert bool(trainer.opt.optimizer.defaults["fused"]) is fused
        curves[fused] = steps_under_watch(trainer, 20)[1]
    gaps = [abs(a - b) for a, b in zip(curves[False], curves[True], strict=True)]
    assert max(gaps) <= 2e-3, f"fused AdamW left the foreach curve by {max(gaps):.2e} nats"
    assert curves[True][-1] < curves[True][0] - 0.3  # the steps moved the model, so a wrong update would show
