"""The cluster path on one machine, with real parts: Ray's multi-node test cluster (`ray.cluster_utils.Cluster`:
a head and worker raylets with their own resources), Ray's fake autoscaler (`ray start --head
--autoscaling-config` with RAY_FAKE_CLUSTER=1), `ray job submit` against a local head, and a real `mlflow
server` on 127.0.0.1. The launcher always runs as its own process joined through RAY_ADDRESS, as under
`ray job submit` on a real cluster; the pytest process never joins these clusters (tests/cluster_helpers.py).

Storage in the node-loss case is an S3 bucket (SeaweedFS on 127.0.0.1, tests/s3_server.py), as on a cloud
cluster; elsewhere a local folder that every fake node sees (they are one machine), which specs state with
run.shared_storage=true, as a user does for an NFS mount."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.launch.pretrained import CHECKPOINTS_TAG
from orchestrator.tracking.describe import TRIAL_TAG
from tests.cluster_helpers import LocalCluster, RayHead, private_env, ray_cli
from tests.real_runs import (
    CHECKPOINT_EVERY,
    assert_one_point_per_step,
    descendants,
    orchestrator,
    runs_of,
    wait_for,
    write_spec,
)

pytestmark = pytest.mark.slow

TRAIN_WORKER = "ray::RayTrainWorker"
TRIAL_DRIVER = "ray::ImplicitFunc"
"""The process title of a Tune function trainable: our trial driver."""


@pytest.fixture(scope="module")
def cluster(request):
    """Head (no CPUs: it runs the trial drivers and their Train controllers, never training) + 2 worker nodes
    of 2 CPUs each: 3 nodes, each with the S3 server's credentials in its environment (a cloud node's role)
    where SeaweedFS runs here."""
    from tests.s3_server import usable_reason

    env = request.getfixturevalue("s3_server").env if usable_reason() is None else {}
    cluster = LocalCluster(env=env, num_cpus=0)
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


def test_node_local_storage_is_refused_on_a_multi_node_cluster(tmp_path, cluster, server):
    """A local storage_path on a 3-node cluster: refused once connected, naming run.storage_path and both fixes
    (s3://, or run.shared_storage=true for a shared mount), before any trial starts and before any MLflow run. The same check's other
    cases (SQLite or file tracking URIs, an autoscaling head alone): tests/test_cluster_checks.py."""
    cluster, _ = cluster
    spec = write_spec(tmp_path, "local-storage", server.uri, optim={"lr": {"grid": [3e-3, 1e-3]}})
    proc = orchestrator(tmp_path, "sweep", str(spec), env=joined(cluster))
    assert proc.wait(180) == 2, proc.output[-3000:]
    assert re.search(r"run\.storage_path='[^']+' is a local folder, but the Ray cluster has 3 nodes", proc.output)
    assert "s3://" in proc.output and "run.shared_storage=true" in proc.output, proc.output[-3000:]
    assert not (tmp_path / "runs" / "local-storage" / "trials").exists()
    assert runs_of(server.uri, "local-storage") == []  # refused before the sweep's parent run: nothing to clean up

def test_sweep_survives_losing_a_worker_node(tmp_path, cluster, server, s3):
    """2 trials on 3 nodes (drivers on the head, one Train worker each on the 2 worker nodes), checkpoints in an
    S3 bucket; once every trial has a checkpoint there, the worker node holding the most Train workers is removed
    (all its processes SIGKILLed, as a machine lost without notice) and a replacement joins. The lost trials'
    Train runs restart from their last checkpoint in the bucket on the other nodes under their living drivers:
    the sweep ends with 1 parent + 2 children, all FINISHED, each child holding one point per metric at every
    step (none missing, none logged twice). (A third trial, run until 2026-11-28, trained the same path once
    more: a Train run's worth of CI time.)"""
    cluster, workers = cluster
    s3_server, root = s3
    steps = 32  # room after the first checkpoints for the node loss to land mid-run
    spec = write_spec(tmp_path, "node-loss", server.uri, optim={"lr": {"grid": [3e-3, 1e-3]}, "max_steps": steps},
                      run={"storage_path": f"{root}/runs"})
    proc = orchestrator(tmp_path, "sweep", str(spec), env={**joined(cluster), **s3_server.env})
    bucket, prefix = root.removeprefix("s3://").split("/", 1)

    def all_checkpointed() -> bool:
        steps_of = collections.defaultdict(set)
        for key in s3_server.keys(bucket, f"{prefix}/runs/node-loss/trials/train-"):
            parts = key.split("/")
            if len(parts) > 2 and parts[-1] == "state.pt":
                steps_of[parts[-3]].add(int(parts[-2].removeprefix("checkpoint_")))
        return len(steps_of) == 2 and all(max(s) >= CHECKPOINT_EVERY for s in steps_of.values())

    wait_for(all_checkpointed, 400, "a checkpoint of every trial", proc)
    hosting = {w["node_id"]: [pid for pid, cmd in descendants(w["raylet_pid"]) if cmd.startswith(TRAIN_WORKER)]
               for w in workers}
    lost = max(workers, key=lambda w: len(hosting[w["node_id"]]))
    assert hosting[lost["node_id"]], f"no Train worker on a worker node: {hosting}"
    on_head = [cmd for _, cmd in descendants(cluster.head["raylet_pid"])]
    print("on the head:", sorted({cmd.split(" ")[0] for cmd in on_head}))
    print("on the workers:", {w["node_id"][:8]: sorted({c.split(" ")[0] for _, c in descendants(w["raylet_pid"])})
                              for w in workers})
    assert not any(cmd.startswith(TRAIN_WORKER) for cmd in on_head)
    # Drivers outlive any worker node: they run on the head only. Not "2 of them" at this instant: a trial that
    # ran ahead may already have ended (seen once on a busy machine: 2 drivers and 1 Train worker left).
    assert any(cmd.startswith(TRIAL_DRIVER) for cmd in on_head), on_head
    assert not any(cmd.startswith(TRIAL_DRIVER) for w in workers for _, cmd in descendants(w["raylet_pid"]))
    cluster.remove_node(lost["node_id"])
    replacement = cluster.add_node(num_cpus=2)
    moved = len(hosting[lost["node_id"]])

    assert proc.wait(600) == 0, proc.output[-5000:]
    assert "2 trials: 2 finished, 0 errored, 0 unfinished" in proc.output, proc.output[-3000:]
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", proc.output)]
    print(f"node loss: {moved} Train worker(s) on the lost node; resumed from steps {resumed}")
    # A trial lost right after its last checkpoint resumes at max_steps and ends at once: still no step lost.
    assert len(resumed) >= moved and all(CHECKPOINT_EVERY <= s <= steps for s in resumed), proc.output[-5000:]
    [parent], kids = children(server.uri, "node-loss")
    assert parent.info.status == "FINISHED"
    assert len(kids) == 2 and {k.info.status for k in kids} == {"FINISHED"}, [(k.info.run_name, k.info.status) for k in kids]
    for kid in kids:
        assert kid.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert kid.data.tags[CHECKPOINTS_TAG].startswith(f"{root}/runs/node-loss/trials/train-")
        assert_one_point_per_step(server.uri, kid.info.run_id, last_step=steps)
    cluster.remove_node(replacement["node_id"])


def peak_overlap(runs: list) -> int:
    """Most runs RUNNING at one time, from MLflow's start and end times."""
    events = sorted([(r.info.start_time, 1) for r in runs] + [(r.info.end_time, -1) for r in runs],
                    key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, change in events:
        current += change
        peak = max(peak, current)
    return peak


def test_autoscaler_adds_nodes_for_a_sweep_larger_than_the_cluster_at_launch(tmp_path, server):
    """Head with no CPUs and 0 workers up; the fake autoscaler may add up to 3 one-CPU workers. The sweep is not
    refused for want of CPUs (its check counts what the autoscaler may add), its trials' worker groups make
    the autoscaler add nodes, and more trials run at once than the cluster at launch could hold (none)."""
    head = RayHead(num_cpus=0, autoscaling={"worker_types": {"cpu_worker": {"resources": {"CPU": 1}, "max_workers": 3}},
                                            "max_workers": 3})
    try:
        spec = write_spec(tmp_path, "autoscale", server.uri, optim={"lr": {"grid": [3e-3, 2e-3, 1e-3]}, "max_steps": 8},
                          run={"shared_storage": True})
        proc = orchestrator(tmp_path, "sweep", str(spec), env={**head.env, "RAY_ADDRESS": head.address})
        assert proc.wait(600) == 0, proc.output[-5000:]
        assert "3 trials: 3 finished, 0 errored, 0 unfinished" in proc.output, proc.output[-3000:]
        raylets = len([p for p in (Path(head.temp_dir)).glob("session_latest/logs/raylet*.out")])
        parents, kids = children(server.uri, "autoscale")
        assert len(parents) == 1, [(r.info.run_name, r.info.status, r.data.tags) for r in parents]
        parent = parents[0]
        overlap = peak_overlap(kids)
        print(f"autoscaler: {raylets} raylets (head + added workers), peak trials at once {overlap}")
        assert parent.info.status == "FINISHED" and {k.info.status for k in kids} == {"FINISHED"}
        assert raylets >= 3 and overlap >= 2, (raylets, overlap)
    finally:
        head.stop()


def _dashboard_installed(python: str) -> bool:
    """`ray job submit` talks to the Jobs API of Ray's dashboard, which needs ray[default]'s packages."""
    probe = "import aiohttp_cors, opencensus, prometheus_client, grpc"
    return subprocess.run([python, "-c", probe], capture_output=True, check=False).returncode == 0


JOB_CLI_LINES = re.compile(
    r"^(\d{4}-\d\d-\d\d [\d:,]+\s+(INFO|SUCC) \w+\.py:\d+ -- .*"  # `ray job submit`'s own lines, timestamped
    r"|Running entrypoint for job raysubmit_\w+: .*)$")
"""What Ray's job CLI and job supervisor print around the entrypoint's own output."""
PREEMPTION_WATCHER_NOTE = re.compile(
    r"^\[[\d :,-]+ E \d+ \d+\] core_worker\.cc:\d+: Actor with class name: 'PreemptionWatcher' .* has constructor "
    r"arguments in the object store and max_restarts > 0\..*$")
"""The one line of Ray's own the job log keeps, at most once per trial: Ray Train's controller creates its
preemption watcher (on a cluster, where nodes may be drained) as a restartable actor whose arguments live in the
object store, and Ray's C++ core logs that at ERROR (ray-project/ray#53727). No Ray setting silences it alone:
RAY_BACKEND_LOG_LEVEL makes every process log that it was set, and turning the watcher off loses Ray Train's
handling of preempted nodes."""
RAY_PROCESS_ABORT = re.compile(
    r"^(\[mutex\.cc : \d+\] RAW: .*"
    r"|(\[[\d :,-]+ E \d+ \d+\] logging\.cc:\d+: )?(\*\*\* SIGABRT received at time=\d+ on cpu \d+ \*\*\*|PC: @ .*|\s*@ .*)"
    r"|Fatal Python error: Aborted|Python runtime state: .*|Extension modules: .*)$")
"""A Ray process of the job's that aborted in Ray's C++ core as it exited (abseil: "Mutex corrupt: both reader and
writer lock held: 0xffffffff", a mutex already freed), seen once in the real-process tier on 2026-11-30 after a job
that succeeded: Ray's, not the project's, and nothing the launcher can turn off. Its dump is let through only from a
process without torch among its extension modules; the launcher and every trial's processes import torch, so a
crash of theirs still fails the case (as does a non-zero exit, or a missing summary line)."""


def test_ray_job_submit_runs_a_sweep_with_relative_paths_from_its_working_dir(tmp_path):
    """The documented cluster workflow against a local head that runs everything (one node, so local paths
    are fine): `ray job submit --working-dir . -- python -m orchestrator sweep spec.yaml` with relative
    task.files, run.storage_path and a SQLite tracking.uri. Every trial driver reads them in the job's
    working dir (not Tune's trial folder): the one SQLite store holds the parent and both children, FINISHED,
    and each child's checkpoints are under the sweep's folder there. A second Ray runs on the machine meanwhile
    (another user's, or a local run's): the job's processes must still find their own cluster. The job log is
    read line by line, as the user tails it: every line is Ray's job CLI's, or one of the launcher's."""
    python = sys.executable
    if not _dashboard_installed(python):
        pytest.skip("`ray job submit` needs Ray's dashboard: pip install 'ray[default]' (the [cluster] extra)")
    work = tmp_path / "project"
    (work / "data").mkdir(parents=True)
    words = ["the", "a", "model", "attention", "head", "layer", "token", "sequence", "learns", "predicts", "next", "word", "from", "context"]
    text = "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 6)) for i in range(400))
    (work / "data" / "train.txt").write_text(text)
    (work / "data" / "valid.txt").write_text(text[:2000])
    spec = write_spec(work, "submitted", "sqlite:///mlflow.db", optim={"lr": {"grid": [3e-3, 1e-3]}, "max_steps": 8},
                      task={"dataset": "files",
                            "files": {"train": "data/train.txt", "validation": "data/valid.txt"}},
                      run={"storage_path": "runs"})
    other = RayHead(num_cpus=1)  # another Ray on this machine: Ray code that scans for "the" cluster sees two
    head = RayHead(num_cpus=2, dashboard=True, python=python)
    try:
        submit = subprocess.run(
            [*ray_cli(python), "job", "submit", "--address", head.dashboard_url, "--working-dir", ".",
             "--", "python", "-m", "orchestrator", "sweep", spec.name],
            cwd=work, env=head.env, capture_output=True, text=True, timeout=600, check=False)
        output = re.sub(r"\x1b\[[0-9;]*m", "", submit.stdout + submit.stderr)  # the CLI's colours
        assert submit.returncode == 0, output[-5000:]
        assert "2 trials: 2 finished, 0 errored, 0 unfinished" in output, output[-3000:]
        # One line per report per trial, labelled by the trial as locally; then the summary.
        reports = re.findall(r"^\[(0000[01]) lr=[\d.e+-]+\] step (\d+)/8 \| train/loss [\d.]+ \| val/ppl [\d.]+$",
                             output, re.M)
        assert sorted(reports) == [("00000", "4"), ("00000", "8"), ("00001", "4"), ("00001", "8")], output[-5000:]
        ours = re.compile(r"^(\[0000[01] lr=[\d.e+-]+\] (step \d+/8 \| .*|done)"
                          r"|sweep submitted: .*|\(.*/runs/submitted\)|  \w+_0000[01]: val/ppl=.*"
                          r"|best: val/ppl=.*|MLflow: sqlite:///.*|report: orchestrator report .*)$")
        lines = [line for line in output.splitlines() if line.strip()]
        unexpected = [line for line in lines if not (ours.match(line) or JOB_CLI_LINES.match(line)
                                                     or PREEMPTION_WATCHER_NOTE.match(line)
                                                     or RAY_PROCESS_ABORT.match(line))]
        assert not unexpected, "\n".join(unexpected)
        aborted = [line for line in lines if line.startswith("Extension modules: ")]
        assert not [line for line in aborted if "torch" in line], output[-5000:]  # one of ours crashed
        if any(RAY_PROCESS_ABORT.match(line) for line in lines):
            print(f"a Ray process of the job aborted as it exited ({len(aborted)} dump(s)); the job itself succeeded")
        assert sum(1 for line in lines if PREEMPTION_WATCHER_NOTE.match(line)) <= 2, output[-5000:]
        # Where Ray unpacked the working dir: the job's cwd, so the relative paths' home.
        [job_dir] = {p.parent.resolve() for p in Path(head.temp_dir).glob("session_2*/runtime_resources/**/submitted.yaml")
                     if (p.parent / "mlflow.db").is_file()}
        uri = f"sqlite:///{job_dir / 'mlflow.db'}"
        [parent], kids = children(uri, "submitted")
        assert parent.info.status == "FINISHED" and len(kids) == 2, [k.info.status for k in kids]
        sweep = job_dir / "runs" / "submitted"
        for kid in kids:
            assert kid.info.status == "FINISHED"
            assert kid.data.tags[CHECKPOINTS_TAG] == str(sweep / "trials" / f"train-{kid.data.tags[TRIAL_TAG]}")
        assert not list(sweep.glob("trial_*/runs")) and not list(sweep.glob("trial_*/mlflow.db"))
    finally:
        head.stop()
        other.stop()
