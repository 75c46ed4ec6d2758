"""run.strategy=fsdp through Ray Train: 2 CPU workers over gloo, FSDP2 sharding, sharded checkpoints in Ray's
storage. The same spec under DDP is the reference: the two compute the same averaged gradients, so their loss
curves agree to float rounding; a sharded run killed after a checkpoint resumes onto the uninterrupted curve; its
final evaluation, export and `orchestrator evaluate` read the sharded checkpoints.

Real-process tier: four Ray Train runs of a tiny causal LM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from orchestrator.launch.evaluate import evaluate_stored
from orchestrator.launch.preflight import LaunchError
from orchestrator.launch.resuming import resume
from orchestrator.launch.run import run_training
from orchestrator.spec import validate_spec
from orchestrator.training.checkpoint import read_checkpoint
from orchestrator.training.export import load_model
from orchestrator.training.sharding import SHARDS_DIR

pytestmark = pytest.mark.slow

STEPS = 6


def raw_spec(root: Path, name: str, **run) -> dict:
    return {
        "name": name,
        "task": {"kind": "clm", "seq_len": 16, "batch_size": 4, "vocab_size": 120, "eval_batches": 2,
                 "builtin": {"train_sentences": 300, "eval_sentences": 30}},
        "model": {"d_model": 16, "layers": 2, "ffn": 32, "max_seq_len": 16, "dropout": 0.1,
                  "attention": {"kind": "mha", "heads": 2}},
        "optim": {"lr": 3e-3, "max_steps": STEPS, "warmup_steps": 1, "seed": 7, "grad_accum": 2, "grad_clip": 0.5},
        "run": {"workers": 2, "cpus_per_worker": 0.5, "checkpoint_every": 2, "eval_every": 2, "log_every": 1,
                "storage_path": str(root / "runs"), **run},
        "tracking": {"uri": f"sqlite:///{root / 'mlflow.db'}", "retries": 2, "timeout_s": 2},
    }


def curve(client: MlflowClient, run_id: str, key: str = "train/loss") -> dict[int, float]:
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return {m.step: m.value for m in history}


def test_fsdp_follows_ddp_and_resumes_from_sharded_checkpoints(ray_cluster, tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    ddp = run_training(validate_spec(raw_spec(tmp_path, "ddp")))
    fsdp = run_training(validate_spec(raw_spec(tmp_path, "fsdp", strategy="fsdp")))

    # Same gradients (averaged over ranks and micro-batches, clipped by the global norm): the same curves.
    want, got = curve(client, ddp.mlflow_run_id), curve(client, fsdp.mlflow_run_id)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=1e-5, abs=1e-6), step
    for key in ("val/loss", "test/loss"):
        assert fsdp.metrics.get(key, client.get_run(fsdp.mlflow_run_id).data.metrics.get(key)) == pytest.approx(
            client.get_run(ddp.mlflow_run_id).data.metrics[key], rel=1e-5), key

    # Every checkpoint is sharded: both ranks' shards and the index, gathered by Ray into one folder.
    folder = Path(fsdp.checkpoint)
    assert sorted(p.name for p in (folder / SHARDS_DIR).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = read_checkpoint(folder)
    assert state.sharded and state.step == STEPS
    ddp_state = read_checkpoint(Path(ddp.checkpoint))
    for name, value in ddp_state.model.items():
        torch.testing.assert_close(state.model[name], value, rtol=1e-4, atol=1e-6, msg=name)

    # Killed after step 3 (its last checkpoint is step 2), resumed: the uninterrupted sharded run's curve.
    spec = validate_spec(raw_spec(tmp_path, "fsdp-killed", strategy="fsdp", max_failures=0))
    with pytest.raises(LaunchError, match="orchestrator resume fsdp-killed"):
        run_training(spec, fail_at_step=3)
    resumed = resume("fsdp-killed", str(tmp_path / "runs"))
    assert resumed.metrics["step"] == STEPS
    again = curve(client, resumed.mlflow_run_id)
    for step, value in got.items():
        assert again[step] == pytest.approx(value, rel=1e-6, abs=1e-7), step

    # The exported model (the run's `model/` artifact, from a sharded checkpoint) and `orchestrator evaluate`.
    metrics = client.get_run(resumed.mlflow_run_id).data.metrics
    exported = Path(client.download_artifacts(resumed.mlflow_run_id, "model", str(tmp_path / "export")))
    model = load_model(exported)
    best = read_checkpoint(Path(tmp_path / "runs" / "fsdp-killed" / f"checkpoint_{int(metrics['test/checkpoint_step']):09d}"))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, best.model[name], rtol=0, atol=0, msg=name)
    scored = evaluate_stored("fsdp-killed", str(tmp_path / "runs"), split="test", which="best")
    assert [item["metrics"]["test/loss"] for item in scored] == [pytest.approx(metrics["test/loss"], rel=1e-6)]
