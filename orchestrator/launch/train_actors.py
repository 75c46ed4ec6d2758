"""The TorchTrainer a run is built with: Ray's own, less two per-run actors that a run here cannot use.

Beside its controller and workers, every Ray Train V2 run gets helper actors from the trainer's default callbacks
(ray/train/v2/api/data_parallel_trainer.py `_create_default_callbacks`), each a Python process of its own that
imports Ray Train: 2.5-3.5 CPU-s to start and about 200 MB of memory (docs/testing.md, "Where the slow tier's
time goes"). Two of them do nothing for a run here:

- **The dataset manager** (`DatasetsCallback`), made at every start of a worker group to hand out Ray Dataset
  shards, whether the trainer has datasets or not. No run here passes any: workers build their data themselves
  (tasks/). It is left out only when the trainer has no datasets.
- **The placement-group cleaner** (`PlacementGroupCleanerCallback`), a detached actor that removes a run's
  placement group if its controller dies. It asks Ray's State API whether the controller lives, and the State API
  is served by the dashboard, which the local Ray a launcher starts runs without (orchestrator/cluster/ray_env.py):
  there every query fails (it logs "State API may be temporarily unavailable" each second) and it never removes
  anything, while the launcher's reaper ends that whole Ray with the launcher (orchestrator/cluster/reaper.py). It
  is left out on a local Ray only; on a joined cluster (RAY_ADDRESS, with its dashboard) it stays.

This overrides a private method of a Ray the project does not pin (`ray>=2.60`). A Ray without that method or
those classes gets Ray's own trainer, every actor included (nothing breaks, a run costs what it did), and
tests/test_train_actors.py fails, so an upgrade that changes them is seen.
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer

from orchestrator.cluster.ray_env import on_local_ray

try:
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
except ImportError:  # another Ray's layout: its own trainer, as the docstring says
    DatasetsCallback = PlacementGroupCleanerCallback = None


class LeanTorchTrainer(TorchTrainer):
    """Ray's TorchTrainer without the dataset manager when it has no datasets, and without the placement-group
    cleaner on a local Ray (the module's docstring says why)."""

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        unused = unused_callback_types(has_datasets=bool(self.datasets), local_ray=on_local_ray())
        return [callback for callback in callbacks if not isinstance(callback, unused)]


def unused_callback_types(*, has_datasets: bool, local_ray: bool) -> tuple[type, ...]:
    """Ray Train's default callbacks that make actors a run with these traits never uses."""
    unused = []
    if DatasetsCallback is not None and not has_datasets:
        unused.append(DatasetsCallback)
    if PlacementGroupCleanerCallback is not None and local_ray:
        unused.append(PlacementGroupCleanerCallback)
    return tuple(unused)


def torch_trainer_class() -> type:
    """LeanTorchTrainer where this Ray has the method it overrides; Ray's own TorchTrainer otherwise."""
    overridable = callable(getattr(TorchTrainer, "_create_default_callbacks", None))
    return LeanTorchTrainer if overridable else TorchTrainer
