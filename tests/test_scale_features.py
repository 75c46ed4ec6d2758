"""Training at scale, on CPU and without Ray: fp16 loss scaling, activation checkpointing, torch.compile,
batch prefetching, the DDP unused-parameter rule and the run.* validation of these knobs.

Each test compares against the plain path (fp32, no checkpointing, eager, no prefetching) on tiny models, so a
subtly wrong feature shows as a difference rather than as a crash.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models import LanguageModel, ModelConfig, checkpoint_activations
from models.attention import ATTENTION_KINDS
from orchestrator.launch.local_run import LocalHooks, latest_checkpoint, train_locally
from orchestrator.spec import SpecError, validate_spec
from orchestrator.training.checkpoint import read_checkpoint
from orchestrator.training.optimizer_step import train_step
from orchestrator.training.trainer import Prefetcher, Trainer
from tasks import WorkerContext
from tests.attention_cases import tiny_knobs
from tests.local_training import FailAtStep3
from tests.test_trainer import tiny_raw


def spec_of(raw: dict, **run):
    return validate_spec({**raw, "run": {**raw["run"], **run}})


def trainer_of(spec, cache: Path) -> Trainer:
    return Trainer.create(spec, WorkerContext(seed=spec.optim.seed, cache_dir=cache))


def curve(hooks: LocalHooks, key: str) -> dict[int, float]:
    return {step: m[key] for step, m in hooks.history if key in m}


# --- fp16 and loss scaling ---------------------------------------------------------------------------------


def test_fp16_step_with_inf_gradients_is_skipped_counted_and_logged(tmp_path):
    """An overflowing fp16 step leaves weights, optimizer and schedule untouched, lowers the scale, and its
    window logs train/skipped_steps = 1; the next window logs 0 and training goes on."""
    spec = spec_of(tiny_raw(max_steps=4), precision="fp16", log_every=1, eval_every=4, checkpoint_every=4)
    trainer = trainer_of(spec, tmp_path / "cache")
    loss, calls = trainer.task.loss, []

    def overflow_on_step_2(model, batch):
        calls.append(1)
        out = loss(model, batch)
        if len(calls) == 2:  # a finite loss whose gradients overflow, as fp16 overflow happens in backward
            out.register_hook(lambda grad: grad * math.inf)
        return out

    trainer.task.loss = overflow_on_step_2
    before: dict[str, torch.Tensor] = {}

    class Watch(LocalHooks):
        def log(self, metrics, step):
            super().log(metrics, step)
            if step == 1:
                before.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
            if step == 2:
                after = dict(trainer.model.named_parameters())
                assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step moved the weights"

    hooks = Watch(spec)
    scale = trainer.opt.scaler.get_scale()
    trainer.fit(hooks)
    assert curve(hooks, "train/skipped_steps") == {1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0}
    assert curve(hooks, "train/loss_scale")[2] == scale * trainer.opt.scaler.get_backoff_factor()
    assert trainer.opt.skipped_steps == 1
    # The schedule did not advance on the skipped step: step 3 used the lr step 2 would have used.
    lrs = curve(hooks, "lr")
    assert lrs[3] == lrs[2]
    assert trainer.opt.optimizer.state_dict()["state"][0]["step"] == 3  # AdamW stepped 3 times out of 4


def _one_step_params(precision: str, clip: float, tmp_path: Path) -> list[torch.Tensor]:
    """Weights after two optimizer steps on the same batches, with fp32 arithmetic either way; fp16 only turns
    the scaler on (autocast off), so any difference comes from where the scale is applied and removed."""
    spec = spec_of(tiny_raw(grad_clip=clip, max_steps=2), precision="fp16" if precision == "fp16" else "fp32")
    trainer = trainer_of(spec, tmp_path / "cache")
    opt = replace(trainer.opt, autocast_dtype=None)
    batches = (b for b, _ in trainer.task.train_batches(None))
    torch.manual_seed(0)
    for _ in range(2):
        train_step(trainer.model, batches, trainer.task.loss, opt, trainer.device)
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_clipping_sees_unscaled_gradients(tmp_path):
    """With a clip far below the gradient norm (so it always acts), the loss-scaled run updates the weights as
    the fp32 run does: the gradients are unscaled before clipping, not after."""
    reference = _one_step_params("fp32", 1e-3, tmp_path)
    scaled = _one_step_params("fp16", 1e-3, tmp_path)
    for ref, got in zip(reference, scaled):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_fp16_autocast_trains_close_to_fp32(tmp_path):
    """fp16 autocast with loss scaling, end to end on CPU: the same loss curve as fp32 within fp16 rounding."""
    fp32 = spec_of(tiny_raw(max_steps=4), log_every=1)
    fp16 = spec_of(tiny_raw(max_steps=4), log_every=1, precision="fp16")
    _, ref = train_locally(fp32, cache_dir=tmp_path / "cache")
    _, half = train_locally(fp16, cache_dir=tmp_path / "cache")
    for step, value in curve(ref, "train/loss").items():
        assert curve(half, "train/loss")[step] == pytest.approx(value, rel=2e-2)
    assert set(curve(half, "train/skipped_steps").values()) == {0.0}
    assert "train/skipped_steps" not in ref.history[0][1]  # fp32 has no scaler to report on


@pytest.mark.parametrize("embedding", ["standard", "define", "adaptive"])
def test_every_embedding_trains_under_fp16_autocast(embedding, tmp_path):
    raw = tiny_raw(max_steps=2)
    raw["model"] = {**raw["model"], "embedding": EMBEDDINGS[embedding], "tie_output": False}
    _, hooks = train_locally(spec_of(raw, precision="fp16", log_every=1), cache_dir=tmp_path / "cache")
    assert all(math.isfinite(v) for v in curve(hooks, "train/loss").values())


# --- activation checkpointing ------------------------------------------------------------------------------


def _model(kind: str, *, causal: bool, reversible: bool = False) -> LanguageModel:
    cfg = ModelConfig(d_model=32, layers=2, ffn=64, max_seq_len=32, dropout=0.1, reversible=reversible,
                      attention={"kind": kind, "heads": 4, **tiny_knobs(kind)})
    torch.manual_seed(0)
    return LanguageModel(cfg, vocab_size=50, causal=causal)


def _loss_and_grads(model: LanguageModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(1))
    padding = torch.zeros(2, 32, dtype=torch.bool)
    padding[1, 28:] = True
    model.train()
    torch.manual_seed(7)  # dropout and LSH draw the same stream in both runs
    logits = model(tokens, padding)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CHECKPOINT_CASES = [(kind, False) for kind in ATTENTION_KINDS] + [("lsh", True), ("mha", True)]


@pytest.mark.parametrize("kind, reversible", CHECKPOINT_CASES,
                         ids=[f"{k}{'-reversible' if r else ''}" for k, r in CHECKPOINT_CASES])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(kind, reversible):
    """Every attention kind (dropout on, so the recompute must replay the RNG), and reversible stacks, which
    recompute by themselves and are left as they are."""
    causal = _model(kind, causal=False).stack.layers[0].attn.supports_causal
    plain = _model(kind, causal=causal, reversible=reversible)
    checkpointed = copy.deepcopy(plain)
    assert checkpoint_activations(checkpointed) == 1
    loss, grads = _loss_and_grads(plain)
    loss_ckpt, grads_ckpt = _loss_and_grads(checkpointed)
    torch.testing.assert_close(loss_ckpt, loss, rtol=1e-6, atol=1e-6)
    assert grads_ckpt.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_stores_fewer_activations():
    """What it is for: the autograd graph keeps only layer inputs, not every intermediate tensor."""
    def saved_bytes(model: LanguageModel) -> int:
        total = 0

        def pack(t: torch.Tensor):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        tokens = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens).sum()
        return total

    plain = _model("mha", causal=False)
    checkpointed = copy.deepcopy(plain)
    checkpoint_activations(checkpointed)
    assert saved_bytes(checkpointed) < 0.6 * saved_bytes(plain)


def test_run_activation_checkpointing_trains_like_the_plain_run(tmp_path):
    """Through the spec and the training core: same loss curve (the recompute replays dropout)."""
    _, ref = train_locally(spec_of(tiny_raw(max_steps=3), log_every=1), cache_dir=tmp_path / "cache")
    _, ckpt = train_locally(spec_of(tiny_raw(max_steps=3), log_every=1, activation_checkpointing=True),
                            cache_dir=tmp_path / "cache")
    for step, value in curve(ref, "train/loss").items():
        assert curve(ckpt, "train/loss")[step] == pytest.approx(value, rel=1e-5)


# --- torch.compile ------------------------------------------------------------------------------------------


def test_compiled_model_matches_eager_loss_and_keeps_its_state_dict(tmp_path):
    """run.compile with a tracing backend (aot_eager: the dynamo + AOTAutograd path without inductor's code
    generation, which benchmarks/system/compile_speed.py measures): the same losses as eager, and checkpoints with
    the eager model's parameter names."""
    raw = tiny_raw(max_steps=3)
    raw["model"]["dropout"] = 0.0  # compiled dropout draws its RNG differently from eager
    eager, ref = train_locally(spec_of(raw, log_every=1), cache_dir=tmp_path / "cache")
    compiled, got = train_locally(spec_of(raw, log_every=1, compile=True, compile_backend="aot_eager"),
                                  cache_dir=tmp_path / "cache")
    assert compiled.model._compiled_call_impl is not None  # nn.Module.compile ran
    for step, value in curve(ref, "train/loss").items():
        assert curve(got, "train/loss")[step] == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert curve(got, "val/loss") == pytest.approx(curve(ref, "val/loss"), rel=1e-5)
    assert compiled.model.state_dict().keys() == eager.model.state_dict().keys()


# --- prefetching -----------------------------------------------------------------------------------------


def _mlm_raw(max_steps: int) -> dict:
    raw = tiny_raw(max_steps=max_steps, grad_accum=2)
    raw["task"] = {**raw["task"], "kind": "mlm"}  # masking draws random numbers per batch
    return raw


def test_prefetcher_yields_the_stream_itself_and_raises_its_errors(tmp_path):
    trainer = trainer_of(validate_spec(_mlm_raw(4)), tmp_path / "cache")
    direct = list(itertools.islice(trainer.task.train_batches(None), 7))
    prefetcher = Prefetcher(trainer.task.train_batches(None), depth=3, pin=False)
    fetched = list(itertools.islice(prefetcher, 7))
    prefetcher.close()
    assert [pos for _, pos in fetched] == [pos for _, pos in direct]
    for (a, _), (b, _) in zip(fetched, direct):
        assert a.n_tokens == b.n_tokens and a.tensors.keys() == b.tensors.keys()
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)

    def broken():
        yield direct[0]
        raise ValueError("corrupt shard")

    failing = Prefetcher(broken(), depth=2, pin=False)
    assert next(failing)[1] == direct[0][1]
    with pytest.raises(ValueError, match="corrupt shard"):
        next(failing)
    failing.close()


def test_prefetching_trains_exactly_like_the_training_thread_and_resumes_exactly(tmp_path):
    """Same losses with and without prefetching (masked LM, grad_accum 2, dropout), and a run stopped after
    step 3 and resumed from its step-2 checkpoint continues exactly: the position saved is that of the last
    consumed batch, not of the batches built ahead."""
    raw = _mlm_raw(6)
    _, plain = train_locally(spec_of(raw, prefetch_batches=0), cache_dir=tmp_path / "cache")
    spec = spec_of(raw, prefetch_batches=3)
    _, ahead = train_locally(spec, cache_dir=tmp_path / "cache")
    assert curve(ahead, "train/loss") == curve(plain, "train/loss")
    assert curve(ahead, "val/loss") == curve(plain, "val/loss")

    folder = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="injected"):
        trainer_of(spec, tmp_path / "cache").fit(FailAtStep3(spec, folder))
    state = read_checkpoint(latest_checkpoint(folder))
    assert state.step == 2 and state.data_positions[0] is not None
    _, resumed = train_locally(spec, cache_dir=tmp_path / "cache", folder=folder)
    assert curve(resumed, "train/loss") == {s: v for s, v in curve(plain, "train/loss").items() if s > 2}


# --- DDP's unused parameters -------------------------------------------------------------------------------

EMBEDDINGS = {"standard": {"kind": "standard"}, "define": {"kind": "define", "input_dim": 8, "width": 16, "depth": 2},
              "adaptive": {"kind": "adaptive", "cutoffs": [20, 117]}}


@pytest.mark.parametrize("embedding, tied", list(itertools.product(EMBEDDINGS, [True, False])))
def test_every_step_gives_every_trainable_parameter_a_gradient(embedding, tied, tmp_path):
    """The worker's DDP does not search for unused parameters (orchestrator/launch/worker.py `prepare`), which
    holds only while no step leaves a trainable parameter without a gradient; the last adaptive band, ids 117-119,
    is rare enough to be missing from most batches (each band runs on every token, kept by a mask)."""
    raw = tiny_raw()
    raw["model"] = {**raw["model"], "embedding": EMBEDDINGS[embedding], "tie_output": tied}
    spec = validate_spec(raw)
    trainer = trainer_of(spec, tmp_path / "cache")
    unused: set[str] = set()
    for batch, _ in itertools.islice(trainer.task.train_batches(None), 10):
        trainer.model.zero_grad(set_to_none=True)
        trainer.task.loss(trainer.model, batch).backward()
        unused |= {n for n, p in trainer.model.named_parameters() if p.requires_grad and p.grad is None}
    assert not unused, sorted(unused)


# --- validation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run, words", [
    ({"strategy": "fsdp", "precision": "fp16"}, ["run.precision=fp16", "run.strategy=fsdp"]),
    ({"collective_timeout_s": 0}, ["run.collective_timeout_s"]),
    ({"prefetch_batches": -1}, ["run.prefetch_batches"]),
    ({"compile_backend": "tvm"}, ["compile_backend"]),
])
def test_impossible_run_settings_are_refused_naming_the_field(run, words):
    raw = tiny_raw()
    with pytest.raises(SpecError) as err:
        validate_spec({**raw, "run": {**raw["run"], **run}})
    for word in words:
        assert word in str(err.value)


def test_possible_combinations_validate():
    raw = tiny_raw()
    for run in ({"precision": "fp16"}, {"precision": "bf16"}, {"strategy": "fsdp", "precision": "bf16"},
                {"strategy": "fsdp", "gpus_per_worker": 1, "precision": "bf16"},
                {"compile": True, "activation_checkpointing": True, "checkpoint_upload": "async"}):
        validate_spec({**raw, "run": {**raw["run"], **run}})


def test_compile_benchmark_writes_a_row_per_kind_and_a_plot(tmp_path):
    """benchmarks/system/compile_speed.py at toy size with the trace-only backend (inductor's minutes are its own
    run): one row per kind with both step times, and the plot."""
    from benchmarks.system import compile_speed

    rows = compile_speed.main(["--out", str(tmp_path), "--kinds", "mha", "linformer", "--backend", "eager",
                               "--d-model", "16", "--layers", "1", "--seq-len", "32", "--batch-size", "2",
                               "--warmup", "1", "--steps", "1", "--name", "toy"])
    assert [r["kind"] for r in rows] == ["mha", "linformer"]
    assert all(r["status"] == "ok" and r["eager_step_s"] > 0 and r["compiled_step_s"] > 0 for r in rows)
    assert len(list(tmp_path.glob("*/toy.png"))) == 1 and len(list(tmp_path.glob("*/toy.csv"))) == 1


def test_tf32_switch_sets_cuda_matmul_and_conv_precision_and_leaves_cpu_alone():
    from orchestrator.training.trainer import set_tf32

    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = matmul.fp32_precision, conv.fp32_precision
    try:
        for tf32, expected in ((True, "tf32"), (False, "ieee")):
            set_tf32(validate_spec(tiny_raw()).run.model_copy(update={"tf32": tf32}), torch.device("cuda"))
            assert (matmul.fp32_precision, conv.fp32_precision) == (expected, expected)
        set_tf32(validate_spec(tiny_raw()).run, torch.device("cpu"))  # CPU: nothing changes
        assert matmul.fp32_precision == "ieee"
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved
