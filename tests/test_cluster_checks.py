"""The launcher's cluster decisions without a cluster: which storage and tracking a multi-node cluster refuses,
what the autoscaler may add (from a cluster launcher config), how many trials run at once, and the absolute
paths a sweep hands its trial drivers. The same decisions on real multi-node clusters: tests/test_cluster.py."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from orchestrator.cluster.resources import ClusterView, max_resources
from orchestrator.launch.preflight import check_multi_node
from orchestrator.launch.sweep import max_concurrent_trials, pin_paths, tune_config
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
    # a pretrain: stage of 8 workers holds 8 GPUs while it trains: 56 / 8 trials at once, not 56 / 2
    staged = spec(**CLASSIFY, run={"workers": 2, "gpus_per_worker": 1, "precision": "bf16"},
                  pretrain={**PRETRAIN, "run": {"workers": 8}})
    assert max_concurrent_trials(staged, grown) == 7


@pytest.mark.parametrize(("scheduler", "reused"), [("fifo", True), ("asha", False)])
def test_trial_drivers_are_reused_under_fifo_only(scheduler, reused):
    """Under FIFO a trial ends when its driver returns, so Tune may start the next trial in that process; an
    ASHA-stopped trial's driver is still inside its Train run (handing it over hung a sweep: sweep.py)."""
    study = study_from_raw({"name": "r", "task": {"kind": "clm"}, "tune": {"scheduler": scheduler},
                            "model": {"attention": {"kind": "mha", "heads": {"grid": [2, 4]}}}})
    cluster = ClusterView(nodes=1, resources={"CPU": 2.0}, capacity={"CPU": 2.0})
    assert tune_config(study, cluster).reuse_actors is reused


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


# --- what one worker, and every stage, asks of the cluster ---------------------------------------------------

SHARED = {"shared_storage": True}
SERVER = {"uri": "http://10.0.0.1:5000"}


def launched(monkeypatch, cluster: ClusterView, **sections):
    """check_cluster of a spec against `cluster`, as built by view_cluster on a connected cluster (no Ray here)."""
    from orchestrator.launch import run

    monkeypatch.setattr(run, "view_cluster", lambda: cluster)
    return run.check_cluster(spec(**{"tracking": SERVER, **sections}))


def nodes_of(*kinds: dict[str, float], count: int = 4) -> ClusterView:
    """`count` nodes of each kind, up now."""
    total = {k: count * sum(kind.get(k, 0.0) for kind in kinds) for k in ("CPU", "GPU")}
    return ClusterView(nodes=count * len(kinds), resources=total, capacity=dict(total), node_kinds=kinds,
                       alive_nodes=kinds * count)


def test_a_worker_must_fit_one_node_not_only_the_cluster(monkeypatch):
    """4 nodes of 4 GPUs and 8 CPUs: 2 workers of 12 CPUs fit the cluster's 32 but no node, so Train's placement
    group would wait forever; 8 CPUs (a whole node) fit."""
    cluster = nodes_of({"GPU": 4.0, "CPU": 8.0})
    with pytest.raises(SpecError, match=r"run\.cpus_per_worker=12 asks for 12 CPUs on one node.* the largest node "
                                        r"of the connected Ray cluster has 4 GPUs and 8 CPUs; lower "
                                        r"run\.cpus_per_worker to at most 8"):
        launched(monkeypatch, cluster, run={**SHARED, "workers": 2, "gpus_per_worker": 1, "cpus_per_worker": 12})
    launched(monkeypatch, cluster, run={**SHARED, "workers": 2, "gpus_per_worker": 1, "cpus_per_worker": 8})


def test_a_workers_gpus_and_cpus_must_fit_the_same_node(monkeypatch):
    """GPU nodes of 4 CPUs next to CPU nodes of 64: one GPU fits the first, 8 CPUs the second, both none."""
    cluster = nodes_of({"GPU": 4.0, "CPU": 4.0}, {"CPU": 64.0})
    for gpus in (1, 0.5):  # a whole GPU and a fraction of one alike
        with pytest.raises(SpecError, match=rf"run\.cpus_per_worker=8 with run\.gpus_per_worker={gpus:g}.* the "
                                            rf"nodes with {gpus:g} GPU.* have at most 4 CPUs"):
            launched(monkeypatch, cluster, run={**SHARED, "gpus_per_worker": gpus, "cpus_per_worker": 8})
        launched(monkeypatch, cluster, run={**SHARED, "gpus_per_worker": gpus, "cpus_per_worker": 4})
    launched(monkeypatch, cluster, run={**SHARED, "cpus_per_worker": 64})  # no GPU: the CPU nodes take it


def test_every_worker_must_be_placed_at_once_on_a_cluster_that_cannot_grow(monkeypatch):
    """2 nodes of 3 CPUs: 3 workers of 2 CPUs fit the cluster's 6 and a node each, but a node holds one of them, so
    Train's placement group would wait forever. The fixes named are the ones that place all 3."""
    cluster = nodes_of({"CPU": 3.0}, count=2)
    with pytest.raises(SpecError, match=r"run\.workers=3 workers of 2 CPUs each: only 2 can be placed at once on "
                                        r"the nodes of the connected Ray cluster \(2 nodes of 0 GPUs and 3 CPUs; .*"
                                        r"lower run\.workers to 2, or run\.cpus_per_worker to 1\.5, or add nodes"):
        launched(monkeypatch, cluster, run={**SHARED, "workers": 3, "cpus_per_worker": 2})
    launched(monkeypatch, cluster, run={**SHARED, "workers": 3, "cpus_per_worker": 1.5})
    launched(monkeypatch, cluster, run={**SHARED, "workers": 2, "cpus_per_worker": 2})
    grows = dataclasses.replace(cluster, autoscaling=True, capacity={"CPU": 12.0})  # it adds the nodes it needs
    launched(monkeypatch, grows, run={**SHARED, "workers": 3, "cpus_per_worker": 2})


def test_gpu_workers_are_placed_by_their_scarcer_resource():
    """Nodes of 2 GPUs and 8 CPUs: workers of a GPU and 4 CPUs fit 2 a node; with 5 CPUs, 1 (the CPUs run out)."""
    from orchestrator.spec.resources import check_workers_placed

    nodes = [{"GPU": 2.0, "CPU": 8.0}] * 2
    check_workers_placed(spec(run={"workers": 4, "gpus_per_worker": 1, "cpus_per_worker": 4}), nodes, "here")
    with pytest.raises(SpecError, match=r"run\.workers=4 workers of 5 CPUs and 1 GPUs each: only 2 can be placed at "
                                        r"once on here .* lower run\.workers to 2, or run\.cpus_per_worker to 4, or"):
        check_workers_placed(spec(run={"workers": 4, "gpus_per_worker": 1, "cpus_per_worker": 5}), nodes, "here")
    with pytest.raises(SpecError, match=r"run\.workers=5 .* only 4 .* lower run\.workers to 4, or add nodes"):
        check_workers_placed(spec(run={"workers": 5, "gpus_per_worker": 1, "cpus_per_worker": 1}), nodes, "here")
    check_workers_placed(spec(run={"workers": 3, "cpus_per_worker": 2.66}), [{"CPU": 8.0}], "here")  # 3 x 2.66 <= 8
    check_workers_placed(spec(run={"workers": 7, "cpus_per_worker": 0.1}), [{"CPU": 0.7}], "here")  # 0.7 / 0.1 < 7


def test_a_worker_needs_a_node_with_its_gpus():
    """Nodes that each expose half a GPU: a worker of one GPU fits none, though the cluster has 2 in all."""
    from orchestrator.spec.resources import check_worker_fits

    gpu_spec = spec(run={"gpus_per_worker": 1})
    with pytest.raises(SpecError, match=r"run\.gpus_per_worker=1 asks for 1 GPUs on one node.* the largest node of "
                                        r"here has 0\.5 GPUs and 8 CPUs; lower run\.gpus_per_worker to at most 0\.5"):
        check_worker_fits(gpu_spec, [{"GPU": 0.5, "CPU": 8.0}] * 4, "here")
    check_worker_fits(gpu_spec, [{"GPU": 0.5, "CPU": 8.0}, {"GPU": 1.0, "CPU": 1.0}], "here")
    check_worker_fits(gpu_spec, [], "here")  # nodes not known: only the totals are checked


def test_node_kinds_the_autoscaler_may_add_count_for_a_worker(monkeypatch):
    """A head of 8 CPUs alone, and cluster.yaml-like node types: a worker of 64 CPUs fits the `big` type (96)
    the autoscaler may add; without that type, the largest is a `gpu` node of 4 GPUs and 48 CPUs."""
    from orchestrator.cluster.resources import node_types

    head = {"CPU": 8.0}
    assert node_types(CLUSTER) == [{"CPU": 48.0, "GPU": 4.0}, {"CPU": 96.0, "GPU": 8.0}]  # `detected`: unknown

    def grown(config):
        capacity = max_resources(config, head)
        return ClusterView(nodes=1, resources=head, capacity=capacity, autoscaling=True,
                           node_kinds=(head, *node_types(config)))

    launched(monkeypatch, grown(CLUSTER), run={**SHARED, "workers": 2, "cpus_per_worker": 64})
    types = CLUSTER["available_node_types"]
    small = {**CLUSTER, "available_node_types": {k: v for k, v in types.items() if k != "big"}}
    with pytest.raises(SpecError, match=r"run\.cpus_per_worker=64 .* cluster with the node types its autoscaler may "
                                        r"add has 4 GPUs and 48 CPUs; lower run\.cpus_per_worker to at most 48"):
        launched(monkeypatch, grown(small), run={**SHARED, "workers": 2, "cpus_per_worker": 64})


def test_the_view_holds_each_kind_of_node_and_whether_they_share_one_machine(monkeypatch):
    """view_cluster without Ray: the nodes up (head and two alike), then a node type the autoscaler may add."""
    from orchestrator.cluster import resources

    def up(ip, **amounts):
        return {"Alive": True, "NodeManagerAddress": ip, "Resources": {f"node:{ip}": 1.0, **amounts}}

    alive = [up("10.0.0.1", CPU=8.0, **{resources.HEAD_RESOURCE: 1.0}), up("10.0.0.1", CPU=4.0, GPU=1.0),
             up("10.0.0.1", CPU=4.0, GPU=1.0), {**up("10.0.0.9", CPU=64.0), "Alive": False}]
    monkeypatch.setattr(resources.ray, "nodes", lambda: alive)
    monkeypatch.setattr(resources.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 2.0})
    monkeypatch.setattr(resources, "_autoscaler", lambda head: None)
    view = resources.view_cluster()
    assert view.nodes == 3 and view.one_machine and not view.autoscaling
    assert sorted(view.node_kinds, key=lambda n: n["CPU"]) == [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 0.0}]
    alive[2] = up("10.0.0.2", CPU=4.0, GPU=1.0)  # a node on another machine
    assert not resources.view_cluster().one_machine
    alive[2] = up("10.0.0.1", CPU=4.0, GPU=1.0)
    for adds_machines in (True, False):  # a cloud's node types, or the fake_multinode raylets beside the head
        grows = resources.Autoscaler(limits={"CPU": 208.0}, node_kinds=[{"CPU": 96.0, "GPU": 0.0}],
                                     other_machines=adds_machines)
        monkeypatch.setattr(resources, "_autoscaler", lambda head: grows)
        view = resources.view_cluster()
        assert view.autoscaling and view.most("CPU") == 208.0 and {"CPU": 96.0, "GPU": 0.0} in view.node_kinds
        assert view.one_machine is not adds_machines


PRETRAIN = {"task": {"kind": "mlm", "seq_len": 32}}
CLASSIFY = {"task": {"kind": "classify", "max_len": 32}, "model": {"attention": {"kind": "mha", "heads": 2}}}


def test_the_pretraining_stage_is_checked_with_its_own_run_settings(monkeypatch):
    """Stage 2 fits 8 nodes of 4 GPUs and 8 CPUs; the pretrain: stage's run (merged over run:) asks for more
    GPUs, CPUs, or CPUs per worker than the cluster or a node has, and is named as pretrain.run."""
    cluster = nodes_of({"GPU": 4.0, "CPU": 8.0}, count=8)
    base = {"workers": 4, "gpus_per_worker": 1, "cpus_per_worker": 2}
    cases = [({"workers": 64}, r"pretrain\.run\.workers=64 x pretrain\.run\.gpus_per_worker=1 asks for 64 GPUs"),
             ({"workers": 32, "cpus_per_worker": 4}, r"pretrain\.run\.workers=32 x pretrain\.run\.cpus_per_worker=4 "
                                                     r"asks for 128 CPUs"),
             ({"cpus_per_worker": 12}, r"pretrain\.run\.cpus_per_worker=12 asks for 12 CPUs on one node"),
             ({"workers": 20, "cpus_per_worker": 3}, r"pretrain\.run\.workers=20 workers of 3 CPUs and 1 GPUs each: "
                                                     r"only 16 can be placed")]
    for stage_run, message in cases:
        with pytest.raises(SpecError, match=message):
            launched(monkeypatch, cluster, **CLASSIFY, run={**SHARED, **base},
                     pretrain={**PRETRAIN, "run": stage_run})
    launched(monkeypatch, cluster, **CLASSIFY, run={**SHARED, **base}, pretrain={**PRETRAIN, "run": {"workers": 32}})


def test_validate_checks_the_pretraining_stage_against_the_local_gpus():
    from orchestrator.spec import check_gpus

    two_stage = spec(**CLASSIFY, run={"gpus_per_worker": 1}, pretrain={**PRETRAIN, "run": {"workers": 4}})
    check_gpus(two_stage, 4, "this machine")
    with pytest.raises(SpecError, match=r"pretrain\.run\.workers=4 x pretrain\.run\.gpus_per_worker=1 asks for 4 GPUs "
                                        r"per run but this machine has 2; lower pretrain\.run\.workers"):
        check_gpus(two_stage, 2, "this machine")


# --- loopback addresses on a cluster of several machines -------------------------------------------------------

LOOPBACKS = ["http://127.0.0.1:5000", "http://127.0.1.1:5000", "http://localhost:5000", "https://LOCALHOST",
             "http://[::1]:5000", "http://127.255.0.9", "http://ui.localhost:5000", "http://[::ffff:127.0.0.1]:5000",
             "http://0.0.0.0:5000"]


@pytest.mark.parametrize(("nodes", "autoscaling"), [(2, False), (1, True)])
def test_multi_node_refuses_loopback_tracking_and_storage_addresses(nodes, autoscaling):
    """Preflight runs on the head, where a loopback server answers; a worker on another node would reach itself."""
    for uri in LOOPBACKS:
        with pytest.raises(SpecError, match=r"tracking\.uri=.* is a loopback address.* set "
                                            r"tracking\.uri=http.?://<head-ip>"):
            check_multi_node(spec(run=SHARED, tracking={"uri": uri}), nodes=nodes, autoscaling=autoscaling)
        endpoint = uri.replace("5000", "9000")
        with pytest.raises(SpecError, match=r"run\.storage_endpoint=.* is a loopback address.* workers there could "
                                            r"not restore or write checkpoints.* set run\.storage_endpoint="
                                            r"http.?://<head-ip>"):
            check_multi_node(spec(run={"storage_path": "s3://bucket/runs", "storage_endpoint": endpoint},
                                  tracking=SERVER), nodes=nodes, autoscaling=autoscaling)
    for uri in ("http://10.0.0.1:5000", "http://128.0.0.1:5000", "http://localhost-proxy:5000", "http://[::2]:5000"):
        check_multi_node(spec(run={"storage_path": "s3://bucket/runs", "storage_endpoint": uri},
                              tracking={"uri": uri}), nodes=nodes, autoscaling=autoscaling)


def test_loopback_addresses_serve_a_single_node_or_nodes_on_one_machine():
    """One node (the head runs everything), or Ray's test clusters (every node a raylet on this machine)."""
    local = spec(run={"storage_path": "s3://bucket/runs", "storage_endpoint": "http://127.0.0.1:9000"},
                 tracking={"uri": "http://127.0.0.1:5000"})
    check_multi_node(local, nodes=1, autoscaling=False)
    check_multi_node(local, nodes=3, autoscaling=True, one_machine=True)
    with pytest.raises(SpecError, match=r"tracking\.uri='http://127\.0\.0\.1:5000' is a loopback address, but the Ray "
                                        r"cluster has 3 nodes"):
        check_multi_node(local, nodes=3, autoscaling=False, one_machine=False)


def test_the_launch_check_refuses_loopback_where_nodes_are_other_machines(monkeypatch):
    """check_cluster hands check_multi_node the view's one_machine: three raylets of one machine (the slow tier's
    clusters) keep 127.0.0.1, three machines do not."""
    three = nodes_of({"CPU": 8.0}, count=3)
    loopback = {"uri": "http://127.0.0.1:5000"}
    with pytest.raises(SpecError, match=r"tracking\.uri='http://127\.0\.0\.1:5000' is a loopback address"):
        launched(monkeypatch, three, run=SHARED, tracking=loopback)
    launched(monkeypatch, dataclasses.replace(three, one_machine=True), run=SHARED, tracking=loopback)
