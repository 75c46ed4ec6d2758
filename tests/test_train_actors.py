"""The trainer a run is built with leaves out Ray Train's dataset manager (no datasets) and, on a local Ray, its
placement-group cleaner and autoscaling coordinator, and keeps every other callback Ray makes
(orchestrator/launch/train_actors.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cluster import ray_env
from orchestrator.launch.worker_config import WorkerConfig
from orchestrator.spec import validate_spec


def built_trainer(root: Path):
    from orchestrator.launch.run import build_trainer

    spec = validate_spec({
        "name": "lean", "task": {"kind": "clm", "seq_len": 16, "batch_size": 4, "vocab_size": 120},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16, "attention": {"kind": "mha", "heads": 2}},
        "optim": {"max_steps": 2}, "run": {"storage_path": str(root / "runs")},
        "tracking": {"uri": f"sqlite:///{root / 'mlflow.db'}"},
    })
    worker = WorkerConfig(spec=spec.model_dump(mode="json"), run=None, label="x", cache_dir=str(root),
                          run_path=str(root / "runs" / "x"))
    return build_trainer(spec, run_name="x", storage_path=spec.run.storage_path, worker=worker)


def callback_types(trainer) -> list[str]:
    return [type(callback).__name__ for callback in trainer._create_default_callbacks()]


def ray_default_types(trainer) -> list[str]:
    from ray.train.torch import TorchTrainer

    return [type(callback).__name__ for callback in TorchTrainer._create_default_callbacks(trainer)]


@pytest.mark.parametrize("local_ray", [True, False], ids=["local Ray", "joined cluster"])
def test_a_run_leaves_out_only_the_actors_it_cannot_use(tmp_path, monkeypatch, local_ray):
    monkeypatch.setattr(ray_env, "_started_here", local_ray)
    monkeypatch.delenv(ray_env.LOCAL_RAY, raising=False)
    trainer = built_trainer(tmp_path)
    made = callback_types(trainer)
    ray_makes = ray_default_types(trainer)
    # The Ray this project installs still has both callbacks (a Ray that renamed them would make the override moot).
    assert {"DatasetsCallback", "PlacementGroupCleanerCallback"} <= set(ray_makes)
    left_out = ["DatasetsCallback", *(["PlacementGroupCleanerCallback"] if local_ray else [])]
    assert made == [name for name in ray_makes if name not in left_out]


def test_a_trial_driver_of_a_local_ray_leaves_the_cleaner_out(tmp_path, monkeypatch):
    """A sweep's trial driver runs in a process of the launcher's local Ray, which tells it so through its
    environment (ray_env.LOCAL_RAY), not through `_started_here`."""
    monkeypatch.setattr(ray_env, "_started_here", False)
    monkeypatch.setenv(ray_env.LOCAL_RAY, "1")
    assert "PlacementGroupCleanerCallback" not in callback_types(built_trainer(tmp_path))


def test_a_trainer_with_datasets_keeps_its_dataset_manager():
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from orchestrator.launch.train_actors import unused_callback_types

    assert unused_callback_types(has_datasets=True, local_ray=False) == ()
    assert unused_callback_types(has_datasets=True, local_ray=True) == (PlacementGroupCleanerCallback,)
    assert unused_callback_types(has_datasets=False, local_ray=False) == (DatasetsCallback,)


@pytest.mark.parametrize("local_ray", [True, False], ids=["local Ray", "joined cluster"])
def test_on_a_local_ray_the_controller_gets_the_fixed_policy_that_asks_no_autoscaler(tmp_path, monkeypatch,
                                                                                      local_ray):
    """What `fit` hands the controller: on a local Ray the same fixed worker group, whose decisions ask no
    autoscaling coordinator for resources (Ray's would start one); on a joined cluster Ray's own policy."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.scaling_policy import (
        FixedScalingPolicy,
        ResizeDecision,
        create_scaling_policy,
    )

    from orchestrator.launch.controller_parts import FixedWorkersWithoutAutoscaler

    monkeypatch.setattr(ray_env, "_started_here", local_ray)
    monkeypatch.delenv(ray_env.LOCAL_RAY, raising=False)
    trainer = built_trainer(tmp_path)
    handed = {}
    monkeypatch.setattr(TorchTrainer.__mro__[1], "_initialize_and_run_controller",
                        lambda self, **kwargs: handed.update(kwargs) or "result")
    rays = create_scaling_policy(trainer.scaling_config)
    assert type(rays) is FixedScalingPolicy  # what fit() makes, and what is swapped
    assert trainer._initialize_and_run_controller(scaling_policy=rays, other="kept") == "result"
    assert handed["other"] == "kept"
    policy = handed["scaling_policy"]
    if not local_ray:
        assert policy is rays
        return
    assert type(policy) is FixedWorkersWithoutAutoscaler and policy.scaling_config is trainer.scaling_config
    policy.after_controller_start(train_run_context=None)
    decision = policy.make_decision_for_non_running_worker_group()  # Ray's asserts a coordinator client here
    assert isinstance(decision, ResizeDecision) and decision.num_workers == trainer.scaling_config.num_workers
    assert policy._coordinator_client is None
    policy.before_controller_abort()


@pytest.mark.parametrize("method", ["_create_default_callbacks", "_initialize_and_run_controller"])
def test_a_ray_without_a_private_method_gets_rays_own_trainer(monkeypatch, method):
    from ray.train.torch import TorchTrainer

    from orchestrator.launch import train_actors

    assert train_actors.torch_trainer_class() is train_actors.LeanTorchTrainer
    monkeypatch.delattr(TorchTrainer.__mro__[1], method)
    assert train_actors.torch_trainer_class() is TorchTrainer
