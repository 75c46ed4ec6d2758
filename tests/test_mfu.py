"""`flops_per_token` and `train/mfu` (issue 48): the MFU formula with the GPU named at the function's boundary, and
the trainer's logging window, which puts `train/mfu` beside `train/tokens_per_s` for a GPU of the table and leaves
it out on a CPU. That a Ray run logs `flops_per_token` as plan counts it: tests/test_orchestrator_runs.py."""

from __future__ import annotations

import pytest

from orchestrator.launch.local_run import LocalHooks
from orchestrator.spec import gpu_kind, validate_spec
from orchestrator.spec.counting import flops_per_token, workload
from orchestrator.spec.gpus import model_flops_utilization
from orchestrator.spec.plan import plan_spec
from orchestrator.spec.vocabulary import counted_spec
from orchestrator.training.trainer import Trainer
from tasks import WorkerContext

H100 = "NVIDIA H100 80GB HBM3"
H100_PEAK = 989.4e12


def test_mfu_is_tokens_per_s_times_flops_per_token_over_the_peak():
    assert model_flops_utilization(1e6, 3e8, H100) == pytest.approx(1e6 * 3e8 / H100_PEAK, rel=1e-12)
    # tokens/s of the whole run over the peak of every GPU it holds
    assert model_flops_utilization(2e6, 3e8, H100, gpus=2) == pytest.approx(1e6 * 3e8 / H100_PEAK, rel=1e-12)
    assert model_flops_utilization(1e6, 3e8, "NVIDIA A100-SXM4-40GB") == pytest.approx(1e6 * 3e8 / 312e12, rel=1e-12)
    for device in (None, "cpu", "NVIDIA H100 PCIe", "Tesla V100-SXM2-16GB"):
        assert model_flops_utilization(1e6, 3e8, device) is None, device  # no peak known: no MFU, not a guess


def _spec(kind: str, tmp_path, checkpointing: bool = False):
    return validate_spec({
        "name": "mfu", "task": {"kind": kind, "dataset": "builtin", "seq_len": 16, "batch_size": 4, "vocab_size": 120,
                                "eval_batches": 1, "builtin": {"train_sentences": 200, "eval_sentences": 20}},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16, "attention": {"kind": "mha", "heads": 2}},
        "optim": {"max_steps": 4, "warmup_steps": 1},
        "run": {"log_every": 2, "eval_every": 4, "checkpoint_every": 4, "storage_path": str(tmp_path / "runs"),
                "activation_checkpointing": checkpointing},
    })


def _windows(spec, tmp_path, device_name: str | None) -> list[dict[str, float]]:
    """The logged windows of a tiny CPU run whose trainer was told it runs on `device_name`."""
    trainer = Trainer.create(spec, WorkerContext(seed=spec.optim.seed, cache_dir=tmp_path / "cache"))
    trainer.flops_per_token, trainer.device_name = flops_per_token(spec), device_name
    hooks = LocalHooks(spec)
    trainer.fit(hooks)
    windows = [metrics for _, metrics in hooks.history if "train/tokens_per_s" in metrics]
    assert len(windows) == 2
    return windows


def _planned(spec):
    """Plan's count of `spec`, at the vocabulary its run will have, as `orchestrator plan` counts it (`plan_study`)."""
    return plan_spec(counted_spec(spec)[0], gpu_kind("H100"))


def test_flops_per_token_is_plans_count_without_recomputation(tmp_path):
    spec = _spec("clm", tmp_path)
    assert flops_per_token(spec) == _planned(spec).flops_per_token > 0
    # checkpointing recomputes the forward, which plan's step time counts and MFU does not
    checkpointed = _spec("clm", tmp_path, checkpointing=True)
    assert flops_per_token(checkpointed) == flops_per_token(spec)
    assert _planned(checkpointed).flops_per_token > flops_per_token(spec)


def test_a_causal_lm_logs_mfu_beside_tokens_per_s_on_a_named_gpu(tmp_path):
    spec = _spec("clm", tmp_path)
    for window in _windows(spec, tmp_path, H100):
        # a causal LM's target tokens are its positions: the formula exactly
        assert window["train/mfu"] == pytest.approx(window["train/tokens_per_s"] * flops_per_token(spec) / H100_PEAK,
                                                    rel=1e-9)


def test_a_masked_lm_counts_mfu_by_positions_not_masked_tokens(tmp_path):
    spec = _spec("mlm", tmp_path)
    for window in _windows(spec, tmp_path, H100):
        positions_per_s = window["train/mfu"] * H100_PEAK / flops_per_token(spec)
        # about 15% of positions are targets; every position costs FLOPs
        assert positions_per_s > 3 * window["train/tokens_per_s"]


def test_a_cpu_run_logs_no_mfu(tmp_path):
    spec = _spec("clm", tmp_path)
    assert workload(spec).tokens == 4 * 16
    for window in _windows(spec, tmp_path, None):
        assert "train/mfu" not in window and window["train/tokens_per_s"] > 0
