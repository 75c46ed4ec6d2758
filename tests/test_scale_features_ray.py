"""Scale features through Ray Train on the session's local Ray (2 CPUs): a 2-worker DDP run over gloo whose
untied adaptive input leaves parameters unused on some steps, trained in fp16 with loss scaling and
asynchronous checkpoint upload; and the collective timeout reaching Ray's TorchConfig.

One run (tens of steps of a tiny masked LM) for the module: it is the expensive part."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from orchestrator.launch.run import build_trainer, run_training
from orchestrator.launch.worker_config import WorkerConfig
from orchestrator.spec import validate_spec
from orchestrator.training.checkpoint import read_checkpoint

pytestmark = pytest.mark.slow


def raw_spec(root: Path, **run) -> dict:
    return {
        "name": "scale-ddp",
        "task": {"kind": "mlm", "seq_len": 16, "batch_size": 4, "vocab_size": 120, "eval_batches": 2,
                 "builtin": {"train_sentences": 300, "eval_sentences": 30}},
        # The last band (ids 117-119) is missing from most batches: a table or projection left without a gradient
        # would be refused by DDP (no find_unused_parameters) on the next step; each band runs on every token.
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16, "dropout": 0.1, "tie_output": False,
                  "embedding": {"kind": "adaptive", "cutoffs": [20, 117]}, "attention": {"kind": "mha", "heads": 2}},
        "optim": {"lr": 3e-3, "max_steps": 6, "warmup_steps": 1, "seed": 7},
        "run": {"workers": 2, "cpus_per_worker": 0.5, "checkpoint_every": 2, "eval_every": 2, "log_every": 1,
                "keep_checkpoints": 5, "storage_path": str(root / "runs"), "final_eval": False, **run},
        "tracking": {"uri": f"sqlite:///{root / 'mlflow.db'}", "retries": 2, "timeout_s": 2},
    }


def test_collective_timeout_reaches_torch_config(tmp_path):
    spec = validate_spec(raw_spec(tmp_path, collective_timeout_s=123))
    worker = WorkerConfig(spec=spec.model_dump(mode="json"), run=None, label="x", cache_dir=str(tmp_path),
                          run_path=str(tmp_path / "runs" / "x"))
    trainer = build_trainer(spec, run_name="x", storage_path=spec.run.storage_path, worker=worker)
    assert trainer.backend_config.timeout_s == 123


def test_train_workers_get_their_environment_from_the_raylet_locally_and_a_runtime_env_on_a_cluster(monkeypatch):
    """On a Ray the launcher started, the raylet gave every worker the environment (no runtime env of the
    Train workers' own); on a joined cluster the Train workers get the verbosity and normal priority."""
    from orchestrator.cluster import ray_env

    monkeypatch.setattr(ray_env, "_started_here", True)
    assert ray_env.train_worker_env() is None
    monkeypatch.setattr(ray_env, "_started_here", False)
    monkeypatch.setenv(ray_env.LOCAL_RAY, "1")  # a trial driver of a local Ray: set by its raylet
    assert ray_env.train_worker_env() is None
    monkeypatch.delenv(ray_env.LOCAL_RAY)
    monkeypatch.setenv("ORCHESTRATOR_VERBOSE", "1")
    assert ray_env.train_worker_env() == {"env_vars": {"ORCHESTRATOR_VERBOSE": "1", "RAY_worker_niceness": "0"}}


def test_workers_of_a_local_ray_run_at_normal_priority_and_the_variable_reaches_them_on_a_cluster(ray_cluster):
    """Ray starts its workers at niceness 15 unless RAY_worker_niceness says otherwise: the local Ray
    (ray_env.start_local_ray, as the session's test Ray is started) gives every worker 0 through the raylet's
    environment, and a runtime env's value, as train_worker_env gives Train workers on a joined cluster, is
    what the worker takes."""
    import os

    @ray_cluster.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    default = ray_cluster.get(niceness.remote())
    set_by_runtime_env = ray_cluster.get(niceness.options(runtime_env={"env_vars": {"RAY_worker_niceness": "15"}}).remote())
    assert (default, set_by_runtime_env) == (0, 15)


def test_the_local_ray_leaves_the_launchers_environment_as_it_was(ray_cluster):
    """The variables the local Ray's processes get are set only while the raylet starts: left in the
    launcher's environment, Ray Train would copy RAY_TRAIN_V2_ENABLED and the preemption switch into every
    controller, and later subprocesses of the same process (a test session's) would inherit them."""
    import os

    from orchestrator.cluster.ray_env import (LOCAL_RAY, TRAIN_POLL_INTERVAL, TRAIN_POLL_INTERVAL_S, TRAIN_V2,
                                              on_local_ray)

    assert on_local_ray()
    for name in (TRAIN_V2, "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "RAY_prestart_worker_first_driver", LOCAL_RAY,
                 TRAIN_POLL_INTERVAL):
        assert name not in os.environ, name

    @ray_cluster.remote(num_cpus=0)
    def seen() -> dict:
        return {name: os.environ.get(name)
                for name in (TRAIN_V2, "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", LOCAL_RAY, TRAIN_POLL_INTERVAL)}

    assert ray_cluster.get(seen.remote()) == {TRAIN_V2: "1", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", LOCAL_RAY: "1",
                                              TRAIN_POLL_INTERVAL: TRAIN_POLL_INTERVAL_S}


def test_two_worker_ddp_with_a_rare_adaptive_band_fp16_and_async_upload(ray_cluster, tmp_path):
    spec = validate_spec(raw_spec(tmp_path, precision="fp16", checkpoint_upload="async"))
    outcome = run_training(spec)

    client = MlflowClient(spec.tracking.uri)
    metrics = client.get_run(outcome.mlflow_run_id).data.metrics
    assert "train/skipped_steps" in metrics and "train/loss_scale" in metrics
    skipped = [m.value for m in client.get_metric_history(outcome.mlflow_run_id, "train/skipped_steps")]
    assert len(skipped) == 6 and all(v in (0.0, 1.0) for v in skipped)
    # Every checkpoint reached storage, readable, with both ranks' data positions (the last one before the run
    # was called finished: the worker waits for its upload).
    run_folder = Path(spec.run.storage_path) / spec.name
    steps = sorted(read_checkpoint(path).step for path in run_folder.glob("checkpoint_0*"))
    assert steps == [2, 4, 6]
    state = read_checkpoint(run_folder / "checkpoint_000000006")
    assert len(state.data_positions) == 2 and len(state.rng) == 2
    assert outcome.checkpoint is not None and Path(outcome.checkpoint).name == "checkpoint_000000006"


def test_a_run_the_cluster_cannot_hold_is_refused_before_its_mlflow_run(ray_cluster, tmp_path):
    """4 CPUs per worker on the 2-CPU test Ray: refused naming the fields, and no MLflow run is left behind
    (the cluster is checked before the run is made, not marked FAILED after)."""
    from orchestrator.spec import SpecError

    spec = validate_spec(raw_spec(tmp_path, workers=1, cpus_per_worker=4))
    with pytest.raises(SpecError, match=r"run.cpus_per_worker=4 asks for 4 CPUs but the connected Ray cluster has 2"):
        run_training(spec)
    client = MlflowClient(spec.tracking.uri)
    experiment = client.get_experiment_by_name(spec.tracking.experiment or spec.name)
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []
