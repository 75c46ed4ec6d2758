"""The cluster path on one machine, with real parts: Ray's multi-node test cluster (`ray.cluster_utils.Cluster`:
a head and worker raylets with their own resources), Ray's fake autoscaler (`ray start --head
--autoscaling-config` with RAY_FAKE_CLUSTER=1), `ray job submit` against a local head, and a real `mlflow
server` on 127.0.0.1. The launcher always runs as its own process joined through RAY_ADDRESS, as under
`ray job submit` on a real cluster; the pytest process never joins these clusters (tests/cluster_helpers.py).

Storage in these tests is a local folder that every fake node sees (they are one machine), so specs state
it with run.shared_storage=true, as a user does for an NFS mount."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.cluster_helpers import LocalCluster, RayHead, private_env
from tests.real_runs import (
    CHECKPOINT_EVERY,
    MlflowServer,
    assert_one_point_per_step,
    checkpoint_on_disk,
    descendants,
    orchestrator,
    runs_of,
    wait_for,
    write_spec,
)

pytestmark = pytest.mark.slow

TRAIN_WORKER = "ray::RayTrainWorker"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster():
    """Head (no CPUs: it runs the trial drivers and their Train controllers, never training) + 2 worker nodes
    of 2 CPUs each: 3 nodes."""
    cluster = LocalCluster(num_cpus=0)
    try:
        workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
        yield cluster, workers
    finally:
        cluster.shutdown()


def joined(cluster: LocalCluster) -> dict[str, str]:
    return private_env(cluster.temp_dir, RAY_ADDRESS=cluster.address)


def children(uri: str, experiment: str) -> tuple[list, list]:
    runs = runs_of(uri, experiment)
    return ([r for r in runs if r.data.tags.get("orchestrator.role") == "sweep"],
            [r for r in runs if r.data.tags.get("orchestrator.role") == "trial"])


def test_node_local_storage_and_sqlite_are_refused_on_a_multi_node_cluster(tmp_path, cluster, server):
    """A local storage_path on a 3-node cluster: refused once connected, naming run.storage_path and both fixes,
    before any trial starts; with the folder declared shared, a SQLite tracking URI is refused the same way."""
    cluster, _ = cluster
    spec = write_spec(tmp_path, "local-storage", server.uri, optim={"lr": {"grid": [3e-3, 1e-3]}})
    proc = orchestrator(tmp_path, "sweep", str(spec), env=joined(cluster))
    assert proc.wait(180) == 2, proc.output[-3000:]
    assert re.search(r"run\.storage_path='[^']+' is a local folder, but the Ray cluster has 3 nodes", proc.output)
    assert "s3://" in proc.output and "run.shared_storage=true" in proc.output, proc.output[-3000:]
    assert not (tmp_path / "runs" / "local-storage" / "trials").exists()

    db = tmp_path / "mlflow.db"
    spec = write_spec(tmp_path, "local-tracking", f"sqlite:///{db}", run={"shared_storage": True})
    proc = orchestrator(tmp_path, "sweep", str(spec), env=joined(cluster))
    assert proc.wait(180) == 2, proc.output[-3000:]
    assert f"tracking.uri='sqlite:///{db}' is a file on each node" in proc.output, proc.output[-3000:]
    assert "tracking.uri=http://<head-ip>:5000" in proc.output
    assert not (tmp_path / "runs" / "local-tracking" / "trials").exists()


def test_sweep_survives_losing_a_worker_node(tmp_path, cluster, server):
    """3 trials on 3 nodes (drivers on the head, one Train worker each on the 2 worker nodes); once every trial
    has a checkpoint, the worker node holding a Train worker is removed (all its processes SIGKILLed, as a
    machine lost without notice) and a replacement joins. The lost trials' Train runs restart from their last
    checkpoint on the other nodes under their living drivers: the sweep ends with 1 parent + 3 children, all
    FINISHED, each child holding one point per metric at every step (none missing, none logged twice)."""
    cluster, workers = cluster
    steps = 40  # room after the first checkpoints for the node loss to land mid-run
    spec = write_spec(tmp_path, "node-loss", server.uri, optim={"lr": {"grid": [3e-3, 2e-3, 1e-3]}, "max_steps": steps},
                      run={"shared_storage": True})
    proc = orchestrator(tmp_path, "sweep", str(spec), env=joined(cluster))
    trials = tmp_path / "runs" / "node-loss" / "trials"

    def all_checkpointed() -> bool:
        folders = list(trials.glob("train-*"))
        return len(folders) == 3 and all(checkpoint_on_disk(f, CHECKPOINT_EVERY) for f in folders)

    wait_for(all_checkpointed, 400, "a checkpoint of every trial", proc)
    hosting = {w["node_id"]: [pid for pid, cmd in descendants(w["raylet_pid"]) if cmd.startswith(TRAIN_WORKER)]
               for w in workers}
    lost = max(workers, key=lambda w: len(hosting[w["node_id"]]))
    assert hosting[lost["node_id"]], f"no Train worker on a worker node: {hosting}"
    assert not any(cmd.startswith(TRAIN_WORKER) for _, cmd in descendants(cluster.head["raylet_pid"]))
    cluster.remove_node(lost["node_id"])
    replacement = cluster.add_node(num_cpus=2)
    moved = len(hosting[lost["node_id"]])

    assert proc.wait(600) == 0, proc.output[-5000:]
    assert "3 trials: 3 finished, 0 errored, 0 unfinished" in proc.output, proc.output[-3000:]
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", proc.output)]
    print(f"node loss: {moved} Train worker(s) on the lost node; resumed from steps {resumed}")
    assert len(resumed) >= moved and all(CHECKPOINT_EVERY <= s < steps for s in resumed), proc.output[-5000:]
    [parent], kids = children(server.uri, "node-loss")
    assert parent.info.status == "FINISHED"
    assert len(kids) == 3 and {k.info.status for k in kids} == {"FINISHED"}, [(k.info.run_name, k.info.status) for k in kids]
    for kid in kids:
        assert kid.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert_one_point_per_step(server.uri, kid.info.run_id, last_step=steps)
    cluster.remove_node(replacement["node_id"])
