"""Shared fixtures. `ray_cluster` starts ONE local Ray for the whole session, and only when a test asks
for it: tests that never request it (spec, search space, cluster YAML) run without Ray."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Unit tests use tiny tensors: on a 2-core machine intra-op thread hand-offs cost far more than
    they save (several times slower with two threads). Ray workers are separate processes and keep
    their own setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def ray_cluster():
    """A 2-CPU, 0-GPU local Ray cluster (explicit counts keep tests machine-independent)."""
    import ray

    from orchestrator.ray_env import start_local_ray

    start_local_ray(num_cpus=2, num_gpus=0)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One real `mlflow server` on 127.0.0.1 for the process-level tests (tests/real_runs.py): starting one
    costs about 25 s on 2 busy cores, and each case logs to an experiment of its own."""
    from tests.real_runs import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
