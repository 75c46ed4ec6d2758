"""The TorchTrainer a run is built with: Ray's own, less the per-run actors that a run here cannot use.

Beside its controller and workers, every Ray Train V2 run gets helper actors, each a Python process of its own that
imports Ray Train: 2.5-3.5 CPU-s to start and about 200 MB of memory (docs/testing.md, "Where the slow tier's
time goes"). Three of them do nothing for a run here:

- **The dataset manager** (`DatasetsCallback`, one of the trainer's default callbacks: ray/train/v2/api/
  data_parallel_trainer.py `_create_default_callbacks`), made at every start of a worker group to hand out Ray
  Dataset shards, whether the trainer has datasets or not. No run here passes any: workers build their data
  themselves (tasks/). It is left out only when the trainer has no datasets.
- **The placement-group cleaner** (`PlacementGroupCleanerCallback`, another default callback), a detached actor
  that removes a run's placement group if its controller dies. It asks Ray's State API whether the controller
  lives, and the State API is served by the dashboard, which the local Ray a launcher starts runs without
  (orchestrator/cluster/ray_env.py): there every query fails (it logs "State API may be temporarily unavailable"
  each second) and it never removes anything, while the launcher's reaper ends that whole Ray with the launcher
  (orchestrator/cluster/reaper.py). It is left out on a local Ray only; on a joined cluster (RAY_ADDRESS, with its
  dashboard) it stays.
- **The autoscaling coordinator**, a detached actor (one per Ray) that the fixed scaling policy tells the worker
  group's demand, for the autoscaler to add nodes. A local Ray has no autoscaler: there the run's controller gets
  the same fixed policy without those requests (orchestrator/launch/controller_parts.py
  `FixedWorkersWithoutAutoscaler`, passed where `DataParallelTrainer.fit` hands the controller its policy). On a
  joined cluster Ray's policy stays.

This overrides private methods of a Ray the project does not pin (`ray>=2.60`). A Ray without them, or without
those classes, gets Ray's own trainer, every actor included (nothing breaks, a run costs what it did), and
tests/test_train_actors.py fails, so an upgrade that changes them is seen.
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer

from orchestrator.cluster.ray_env import on_local_ray
from orchestrator.launch.controller_parts import FixedScalingPolicy, FixedWorkersWithoutAutoscaler

try:
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
except ImportError:  # another Ray's layout: its own trainer, as the docstring says
    DatasetsCallback = PlacementGroupCleanerCallback = None

_OVERRIDDEN = ("_create_default_callbacks", "_initialize_and_run_controller")


class LeanTorchTrainer(TorchTrainer):
    """Ray's TorchTrainer without the dataset manager when it has no datasets, and on a local Ray without the
    placement-group cleaner and the autoscaling coordinator (the module's docstring says why)."""

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        unused = unused_callback_types(has_datasets=bool(self.datasets), local_ray=on_local_ray())
        return [callback for callback in callbacks if not isinstance(callback, unused)]

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        policy = controller_init_kwargs.get("scaling_policy")
        # Only Ray's plain fixed policy is swapped (an elastic one resizes through the coordinator).
        if on_local_ray() and FixedWorkersWithoutAutoscaler is not None and type(policy) is FixedScalingPolicy:
            controller_init_kwargs["scaling_policy"] = FixedWorkersWithoutAutoscaler(policy.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


def unused_callback_types(*, has_datasets: bool, local_ray: bool) -> tuple[type, ...]:
    """Ray Train's default callbacks that make actors a run with these traits never uses."""
    unused = []
    if DatasetsCallback is not None and not has_datasets:
        unused.append(DatasetsCallback)
    if PlacementGroupCleanerCallback is not None and local_ray:
        unused.append(PlacementGroupCleanerCallback)
    return tuple(unused)


def torch_trainer_class() -> type:
    """LeanTorchTrainer where this Ray has the methods it overrides; Ray's own TorchTrainer otherwise."""
    overridable = all(callable(getattr(TorchTrainer, name, None)) for name in _OVERRIDDEN)
    return LeanTorchTrainer if overridable else TorchTrainer
