"""Tests written against survivors of a hand mutation pass over the training core (optimizer_step.py, trainer.py,
checkpoint.py, scoring.py). Each test names the mistake it catches; expected values come from a hand computation
or an independent reference (Vaswani et al. 2017 eq. 3, a gradient computed without DDP), not from the code
under test. No Ray, no servers: at most a one-process gloo group and a two-step CPU run."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from orchestrator.launch.local_run import latest_checkpoint, train_locally
from orchestrator.spec import OptimConfig, validate_spec
from orchestrator.training import optimizer_step, scoring
from orchestrator.training.checkpoint import (
    TrainingState,
    capture_rng,
    cuda_rng_of_rank,
    read_checkpoint,
    restore_rng,
    write_checkpoint,
)
from orchestrator.training.optimizer_step import LossMeter, Optimization, lr_lambda, train_step
from orchestrator.training.trainer import Best, Cadence, NonFiniteLoss, Trainer, check_finite
from tasks import Batch, WorkerContext, build_task
from tests.test_trainer import tiny_raw


def _trainer(tmp_path, raw: dict | None = None, rank: int = 0, world_size: int = 1, **run) -> Trainer:
    raw = raw or tiny_raw()
    spec = validate_spec({**raw, "run": {**raw["run"], "prefetch_batches": 0, **run}})
    ctx = WorkerContext(rank=rank, world_size=world_size, seed=spec.optim.seed, cache_dir=tmp_path / "cache")
    return Trainer.create(spec, ctx)


class Recorder:
    """TrainerHooks that keep every (step, metrics) they are given."""

    def __init__(self) -> None:
        self.history: list[tuple[int, dict[str, float]]] = []

    def log(self, metrics, step):
        self.history.append((step, dict(metrics)))

    def report(self, trainer, step, metrics, checkpoint):
        self.history.append((step, dict(metrics)))

    def after_step(self, step):
        pass


# --- optimizer_step.py ----------------------------------------------------------------------------------


def test_inverse_sqrt_is_vaswanis_eq3_normalised_to_its_peak():
    """Catches the decay read at the 0-based step (sqrt(step) for sqrt(step + 1)): Vaswani et al. (2017) eq. 3,
    lr ~ min(n^-0.5, n * w^-1.5) at the 1-based step n = step + 1, divided by its peak w^-0.5."""
    warmup = 4
    factor = lr_lambda(OptimConfig(schedule="inverse_sqrt", warmup_steps=warmup, max_steps=30))
    for step in range(30):
        n = step + 1
        expected = min(n ** -0.5, n * warmup ** -1.5) / warmup ** -0.5
        assert factor(step) == pytest.approx(expected, rel=1e-12), f"step {step}"


def test_tokens_per_s_counts_every_ranks_tokens(monkeypatch):
    """Catches the world size dropped from train/tokens_per_s (each rank consumes about as many tokens)."""
    clock = [100.0]
    monkeypatch.setattr(optimizer_step, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    meter = LossMeter()
    meter.add(torch.tensor(2.0), 30)
    clock[0] += 2.0
    assert meter.read(world_size=4)["train/tokens_per_s"] == pytest.approx(30 * 4 / 2.0)


def test_ddp_all_reduces_once_per_step_the_sum_of_every_micro_batch(tmp_path):
    """Catches the gradient sync enabled on the wrong micro-batch (e.g. the first): DDP would all-reduce a partial
    gradient and the later micro-batches would stay local to each rank. A comm hook records what is reduced; it
    must be the whole step's gradient, sum_i grad(loss_i) / grad_accum, computed here without DDP."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.manual_seed(0)
    xs, ys = torch.randn(3, 5, 4), torch.randn(3, 5, 1)
    batches = [Batch({"x": xs[i], "y": ys[i]}, n_tokens=5) for i in range(3)]

    def loss_fn(model, batch):
        return ((model(batch.tensors["x"]) - batch.tensors["y"]) ** 2).mean()

    reference = nn.Linear(4, 1)
    for batch in batches:
        (loss_fn(reference, batch) / 3).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
        model.module.load_state_dict(reference.state_dict())
        reduced: list[torch.Tensor] = []

        def hook(state, bucket):
            reduced.append(bucket.buffer().clone())
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        model.register_comm_hook(None, hook)
        opt = Optimization.build(model, OptimConfig(lr=1e-3, max_steps=4, grad_accum=3, grad_clip=None),
                                 torch.device("cpu"), fused=False)
        train_step(model, iter(batches), loss_fn, opt, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert len(reduced) == 1, f"{len(reduced)} all-reduces in one step of 3 micro-batches"
    assert torch.allclose(reduced[0].sort().values, expected.sort().values, atol=1e-6), "a partial gradient was reduced"


# --- trainer.py ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_nan_evaluation_never_becomes_the_best_nor_blocks_a_later_one(mode):
    """Catches the NaN check dropped from Best.update: a NaN first evaluation would be kept, and since every
    comparison with NaN is False, no later value could ever replace it."""
    best = Best("val/x", mode)
    assert not best.update({"val/x": math.nan}, 1)
    assert best.update({"val/x": 3.0}, 2)
    assert (best.value, best.step) == (3.0, 2)


def test_the_last_step_checkpoints_when_it_is_not_a_multiple_of_checkpoint_every():
    """Catches `or step == max_steps` dropped: a run of 7 steps checkpointing every 5 would lose its last 2."""
    cadence = Cadence(max_steps=7, log_every=10, eval_every=10, checkpoint_every=5)
    assert [s for s in range(1, 8) if cadence.checkpoints(s)] == [5, 7]
    assert [s for s in range(1, 8) if cadence.reports(s)] == [5, 7]


def test_a_nan_validation_loss_stops_the_run():
    """Catches val/loss left out of the finiteness check (only train/loss checked)."""
    with pytest.raises(NonFiniteLoss, match="val/loss"):
        check_finite({"val/loss": math.nan, "val/ppl": math.nan}, step=4, lr=1e-3)


def test_resume_restores_the_fp16_loss_scale(tmp_path):
    """Catches the grad scaler left out of Trainer.restore: a resumed fp16 run would restart at the initial
    scale (65536) and skip steps to overflow again, so its loss curve leaves the uninterrupted run's."""
    trainer = _trainer(tmp_path, precision="fp16")
    batches = (batch for batch, _ in trainer.task.train_batches(None))
    train_step(trainer.model, batches, trainer.task.loss, trainer.opt, trainer.device)
    trainer.opt.scaler.update(new_scale=128.0)
    state = trainer.checkpoint_state(None)
    resumed = _trainer(tmp_path, precision="fp16")
    resumed.restore(state)
    assert resumed.opt.scaler.get_scale() == 128.0
    assert resumed.opt.scaler.state_dict() == trainer.opt.scaler.state_dict()


def test_each_rank_starts_from_the_same_weights_but_draws_its_own_dropout(tmp_path):
    """Catches every rank seeded alike after the model is built: ranks would drop the same units (and mask the
    same tokens), correlating what should be independent noise across the data-parallel batch."""
    first = _trainer(tmp_path, rank=0, world_size=2)
    draw_0 = torch.rand(8)
    second = _trainer(tmp_path, rank=1, world_size=2)
    draw_1 = torch.rand(8)
    for (name, a), (_, b) in zip(first.model.state_dict().items(), second.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert not torch.equal(draw_0, draw_1), "rank 1 draws the same random numbers as rank 0"


def test_evaluation_time_is_not_counted_in_the_next_windows_throughput(tmp_path, monkeypatch):
    """Catches the meter's clock not restarted after a report: the evaluation's time would be charged to the
    next logging window. A fake clock: 1 s per micro-batch, 100 s per evaluation; so every window's
    train/tokens_per_s must be exactly one step's tokens per second."""
    clock = [0.0]
    monkeypatch.setattr(optimizer_step, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    trainer = _trainer(tmp_path, tiny_raw(max_steps=4), log_every=1, eval_every=2, checkpoint_every=4)
    tokens = []
    loss = trainer.task.loss

    def timed_loss(model, batch):
        clock[0] += 1.0
        tokens.append(batch.n_tokens)
        return loss(model, batch)

    def timed_evaluate():
        clock[0] += 100.0
        return {"val/ppl": 10.0, "val/loss": math.log(10.0)}

    monkeypatch.setattr(trainer.task, "loss", timed_loss)
    monkeypatch.setattr(trainer, "evaluate", timed_evaluate)
    hooks = Recorder()
    trainer.fit(hooks)
    rates = {step: m["train/tokens_per_s"] for step, m in hooks.history}
    assert rates == {step: pytest.approx(float(tokens[step - 1])) for step in (1, 2, 3, 4)}


def test_a_run_without_training_reports_its_evaluation_as_the_best(tmp_path, monkeypatch):
    """Catches the best left unset in a run of max_steps 0 (task.kind: pretrained_lm scoring): its one report
    would carry no best/<metric>, which the final evaluation and the report read."""
    trainer = _trainer(tmp_path)
    trainer.spec = trainer.spec.model_copy(update={"optim": trainer.spec.optim.model_copy(update={"max_steps": 0})})
    monkeypatch.setattr(trainer, "evaluate", lambda: {"val/ppl": 12.5, "val/loss": math.log(12.5)})
    hooks = Recorder()
    trainer.fit(hooks)
    assert len(hooks.history) == 1
    step, metrics = hooks.history[0]
    assert step == 0 and metrics[f"best/{trainer.spec.metric}"] == metrics[trainer.spec.metric]
    assert metrics["best/step"] == 0.0


# --- checkpoint.py ------------------------------------------------------------------------------------------


def test_a_legacy_per_device_cuda_state_restores_the_device_the_worker_used():
    """Catches the wrong element of a pre-change per-device list (the last instead of the first, the one a Ray
    worker's single visible GPU had)."""
    first, second = torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)
    assert cuda_rng_of_rank([first, second]) is first
    assert cuda_rng_of_rank([]) is None and cuda_rng_of_rank(second) is second


def test_numpys_cached_gaussian_survives_a_checkpoint(tmp_path):
    """Catches the cached second Gaussian of numpy's legacy generator dropped from the saved state: the first
    normal draw after a resume would differ from the uninterrupted run's."""
    np.random.seed(5)
    np.random.standard_normal()  # the Box-Muller pair leaves its second value cached
    rng = capture_rng()
    expected = np.random.standard_normal(3)
    state = TrainingState(step=1, model={}, optimizer={}, scheduler={}, scaler={}, data_positions=[None], rng=[rng],
                          mlflow_run_id=None)
    restore_rng(read_checkpoint(write_checkpoint(tmp_path, state, "name: x\n")).rng[0])
    assert np.array_equal(np.random.standard_normal(3), expected)
    random.seed()  # leave no fixed Python seed behind for other tests


def test_a_checkpoint_of_a_step_already_written_is_replaced(tmp_path):
    """Catches the existing folder not removed before the rename: rewriting a step (a resumed run writing the
    step it restarted from) would fail with 'directory not empty'."""
    def state(value: float) -> TrainingState:
        return TrainingState(step=3, model={"w": torch.tensor([value])}, optimizer={}, scheduler={}, scaler={},
                             data_positions=[None], rng=[], mlflow_run_id=None)

    write_checkpoint(tmp_path, state(1.0), "name: x\n")
    path = write_checkpoint(tmp_path, state(2.0), "name: x\n")
    assert read_checkpoint(path).model["w"].item() == 2.0


# --- scoring.py ---------------------------------------------------------------------------------------------


def test_word_level_perplexity_spreads_the_total_log_loss_over_words_and_line_ends(tmp_path, monkeypatch):
    """Catches the end-of-line not counted as a word, or the ratio pieces/words inverted: word ppl =
    exp(loss_per_piece * pieces / (words + lines)), as word-level WikiText counts <eos>."""
    lines = ["the cat sat", "on the mat today", ""]
    monkeypatch.setattr(scoring, "lm_texts", lambda cfg, splits, cache: {"test": lines})
    out = scoring.word_level_perplexity(None, "test", 1.5, 20, tmp_path)
    words = 3 + 4 + 0 + 3  # words plus one end-of-line per line
    assert out["test/words"] == words and out["test/pieces"] == 20
    assert out["test/word_ppl"] == pytest.approx(math.exp(1.5 * 20 / words))


def test_a_split_is_scored_in_full_and_a_causal_lm_counts_every_predicted_piece(tmp_path):
    """Catches the quick-check caps kept when scoring a split (eval_batches, a translation's eval_max_sentences),
    and the pieces of word_ppl counted as the stream's length: a stream of N pieces predicts N - 1."""
    raw = tiny_raw("scored", max_steps=1)
    raw["task"]["eval_batches"] = 1
    spec = validate_spec(raw)
    whole = scoring.split_task_config(spec.task, "test")
    assert (whole.eval_split, whole.eval_batches) == ("test", None)
    translation = validate_spec({"name": "t", "task": {"kind": "translation", "max_source_len": 16,
                                                       "eval_max_sentences": 50},
                                 "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16,
                                           "attention": {"kind": "mha", "heads": 2}}}).task
    assert scoring.split_task_config(translation, "validation").eval_max_sentences is None
    train_locally(spec, cache_dir=tmp_path / "cache", folder=tmp_path / "run")
    found = scoring.evaluate_checkpoint(latest_checkpoint(tmp_path / "run"), "test", cache_dir=tmp_path / "cache",
                                        out_dir=tmp_path / "out", device=torch.device("cpu"))
    stream = build_task(whole, spec.model, WorkerContext(cache_dir=tmp_path / "cache")).eval_stream
    assert found.metrics["test/pieces"] == len(stream) - 1
