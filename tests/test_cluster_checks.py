"""The launcher's cluster decisions without a cluster: which storage and tracking a multi-node cluster refuses,
what the autoscaler may add (from a cluster launcher config), how many trials run at once, and the absolute
paths a sweep hands its trial drivers. The same decisions on real multi-node clusters: tests/test_cluster.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.cluster.resources import ClusterView, max_resources
from orchestrator.launch.preflight import check_multi_node
from orchestrator.launch.sweep import max_concurrent_trials, pin_paths
from orchestrator.spec import SpecError, study_from_raw, validate_spec


def spec(**sections):
    raw = {"name": "c", "task": {"kind": "clm"}, "model": {"attention": {"kind": "mha", "heads": 2}}}
    return validate_spec({**raw, **sections})


def test_single_node_keeps_local_storage_and_sqlite():
    check_multi_node(spec(), nodes=1, autoscaling=False)  # the head runs everything: local paths are fine


@pytest.mark.parametrize(("nodes", "autoscaling"), [(2, False), (1, True)])
def test_multi_node_refuses_local_storage_then_file_tracking(nodes, autoscaling):
    with pytest.raises(SpecError, match=r"run\.storage_path='/.*' is a local folder.*run\.shared_storage=true"):
        check_multi_node(spec(), nodes=nodes, autoscaling=autoscaling)
    for uri in ("sqlite:///mlflow.db", "file:///tmp/mlruns", "mlruns"):
        with pytest.raises(SpecError, match=r"tracking\.uri=.* is a file on each node.*mlflow server"):
            check_multi_node(spec(run={"shared_storage": True}, tracking={"uri": uri}), nodes=nodes,
                             autoscaling=autoscaling)
    check_multi_node(spec(run={"shared_storage": True}, tracking={"uri": "http://10.0.0.1:5000"}), nodes=nodes,
                     autoscaling=autoscaling)
    check_multi_node(spec(run={"storage_path": "s3://bucket/runs"}, tracking={"uri": "http://head:5000"}),
                     nodes=nodes, autoscaling=autoscaling)


CLUSTER = {
    "max_workers": 8,
    "head_node_type": "head",
    "available_node_types": {
        "head": {"resources": {"CPU": 8}, "max_workers": 0},
        "gpu": {"resources": {"CPU": 48, "GPU": 4}, "min_workers": 1, "max_workers": 6},
        "big": {"resources": {"CPU": 96, "GPU": 8}, "min_workers": 0, "max_workers": 4},
        "detected": {"resources": {}, "max_workers": 3},
    },
}


def test_autoscaler_capacity_is_head_plus_node_types_capped_by_max_workers():
    head = {"CPU": 8.0, "node:__internal_head__": 1.0}
    # gpu 6 x 4 + big 4 x 8 = 56 GPUs by type, but at most 8 workers of at most 8 GPUs = 64: 56 stands.
    assert max_resources(CLUSTER, head)["GPU"] == 56
    capped = {**CLUSTER, "max_workers": 3}  # 3 workers of at most 8 GPUs each
    assert max_resources(capped, head)["GPU"] == 24 and max_resources(capped, head)["CPU"] == 8 + 3 * 96
    assert max_resources({**CLUSTER, "available_node_types": {"head": {"resources": {}}}}, head) is None


def test_max_concurrent_counts_what_the_autoscaler_may_add():
    gpu_spec = spec(run={"workers": 2, "gpus_per_worker": 1, "precision": "bf16"})
    at_launch = ClusterView(nodes=2, resources={"GPU": 4.0, "CPU": 56.0}, capacity={"GPU": 4.0, "CPU": 56.0})
    grown = ClusterView(nodes=2, resources={"GPU": 4.0, "CPU": 56.0}, capacity={"GPU": 56.0, "CPU": 680.0},
                        autoscaling=True)
    assert max_concurrent_trials(gpu_spec, at_launch) == 2
    assert max_concurrent_trials(gpu_spec, grown) == 28
    cpu_spec = spec(run={"workers": 2})
    assert max_concurrent_trials(cpu_spec, ClusterView(nodes=1, resources={"CPU": 0.0}, capacity={"CPU": 3.0},
                                                       autoscaling=True)) == 1


def test_a_sweeps_trial_drivers_get_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    study = study_from_raw({"name": "p", "task": {"kind": "clm", "dataset": "files",
                                                  "files": {"train": "d/train.txt", "validation": "d/valid.txt"}},
                            "model": {"attention": {"kind": "mha", "heads": {"grid": [2, 4]}}},
                            "tracking": {"uri": "sqlite:///mlflow.db"}})
    raw = pin_paths(study).raw
    monkeypatch.chdir(Path(os.sep))  # a trial driver elsewhere (Tune's trial folder) reads the same places
    trial = validate_spec({**raw, "model": {"attention": {"kind": "mha", "heads": 2}}})
    assert trial.task.files.train == str(tmp_path / "d" / "train.txt")
    assert trial.run.storage_path == str(tmp_path / "runs")
    assert trial.tracking.uri == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_an_unreachable_tracking_store_is_refused_with_its_reason_and_no_training_continues_warning(recwarn):
    """The preflight's round trip fails quietly (its usual warning says "training continues", which is not what
    happens next) and the refusal names the field, the reason and the fixes."""
    import socket
    import warnings

    from orchestrator.launch.preflight import LaunchError, check_tracking
    from orchestrator.tracking.write import MlflowTracker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
    tracker = MlflowTracker(uri, retries=1, timeout_s=1)
    warnings.simplefilter("always")
    with pytest.raises(LaunchError, match=r"tracking\.uri='http://127\.0\.0\.1:\d+' cannot be reached \(MlflowException: "
                                          r".*tracking\.offline_ok=true"):
        check_tracking(spec(tracking={"uri": uri}), tracker)
    assert not [w for w in recwarn if "training continues" in str(w.message)]
