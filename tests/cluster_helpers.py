"""Multi-node Ray clusters on one machine for tests/test_cluster.py, each private to its test: its own temp
dir (so Ray's "latest cluster" file and sessions of other Ray users on the machine are untouched), its own
ports, token auth off, and ended by the PIDs of its own processes (never `ray stop`).

- `LocalCluster`: Ray's `ray.cluster_utils.Cluster` (a head and worker raylets with their own resources,
  add_node / remove_node), run in a child process (`python -m tests.cluster_helpers`) so that the pytest
  process never holds a second Ray beside the session's `ray_cluster` fixture; driven over stdin/stdout.
- `RayHead`: `ray start --head` (the cluster launcher's command), optionally with the fake autoscaler
  (RAY_FAKE_CLUSTER=1 and `--autoscaling-config` of the `fake_multinode` provider).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.cluster.ray_env import NODE_START_TIMEOUT, START_ATTEMPTS
from tests.real_runs import ROOT, children_of_every_process, descendants, free_port, process_env


def private_env(temp_dir: str, **extra: str) -> dict[str, str]:
    """Environment of a private Ray: RAY_TMPDIR keeps its files (and `ray_current_cluster`) in `temp_dir`."""
    return process_env(RAY_TMPDIR=temp_dir, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **extra)


def short_temp_dir(prefix: str) -> str:
    # Ray's socket paths must stay under 107 characters: pytest's tmp_path is too deep.
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def processes_of(temp_dir: str) -> list[int]:
    """PIDs of the processes whose command line names `temp_dir` (every Ray process of a cluster started there
    carries its session or temp dir), and their descendants (workers forked by a raylet)."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if temp_dir.encode() in cmdline.read_bytes():
                found.add(int(cmdline.parent.name))
        except OSError:
            continue
    for pid in list(found):
        found.update(child for child, _ in descendants(pid))
    found.discard(os.getpid())
    return sorted(found)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def end_ray_in(temp_dir: str) -> None:
    """SIGKILL every process of the Ray cluster that lives in `temp_dir`, until none is left; then its files."""
    for _ in range(5):
        pids = processes_of(temp_dir)
        if not pids:
            break
        kill_all(pids)
        time.sleep(0.5)
    shutil.rmtree(temp_dir, ignore_errors=True)


def start_again_on_node_timeout(start: Callable[[], str | None], stop: Callable[[], None], what: str) -> None:
    """Run `start` (None once it worked, else the failure in Ray's words) again while the failure is Ray's fixed 30 s
    for a raylet to register, which runs out on a loaded machine (seen in the slow tier at load 12), up to
    START_ATTEMPTS times, as the launcher's local Ray does (orchestrator/cluster/ray_env.py); any other failure is
    raised at once. `stop` ends what a failed or interrupted start left behind."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            error = start()
        except BaseException:
            stop()
            raise
        if error is None:
            return
        stop()
        if NODE_START_TIMEOUT not in error or attempt == START_ATTEMPTS:
            raise RuntimeError(f"{what} did not start (attempt {attempt} of {START_ATTEMPTS}): {error}")
        print(f"{what} timed out during startup; starting it again ({attempt + 1}/{START_ATTEMPTS})",
              file=sys.stderr, flush=True)


class LocalCluster:
    """`ray.cluster_utils.Cluster` in a child process; `add_node(**node_args)` returns the node's Ray id and
    raylet PID, `remove_node(node_id)` kills that node's processes (a lost machine). `env`: what every node's
    processes get besides (a node's own S3 credentials, as an instance role gives a cloud node)."""

    def __init__(self, env: dict[str, str] | None = None, **head_args: Any):
        def start() -> str | None:
            self.temp_dir = short_temp_dir("rc")  # a new one each attempt: a failed start's is removed with it
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.cluster_helpers", json.dumps(head_args)],
                                         cwd=ROOT, env=private_env(self.temp_dir, **(env or {})),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         start_new_session=True)
            reply = self._reply()
            if "error" in reply:
                return reply["error"]
            self.address, self.head = reply["address"], reply["node"]
            return None

        start_again_on_node_timeout(start, self.shutdown, "the cluster's head")

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the cluster process ended (rc {self.proc.poll()}); see its stderr above")
        return json.loads(line)

    def _ask(self, **command: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def add_node(self, **node_args: Any) -> dict[str, Any]:
        return self._ask(op="add", args=node_args)

    def remove_node(self, node_id: str) -> None:
        self._ask(op="remove", node_id=node_id)

    def shutdown(self) -> None:
        try:
            if self.proc.poll() is None:
                self._ask(op="quit")
                self.proc.wait(timeout=60)
        except (OSError, ValueError, RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError):
            pass
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            end_ray_in(self.temp_dir)


STARTUP_CONCURRENCY = {"RAY_worker_maximum_startup_concurrency": "16"}
"""What cluster.yaml's `ray start` commands set (its comment says why)."""


class RayHead:
    """`ray start --head` in its own temp dir on free ports; with `autoscaling` (a `fake_multinode` config's
    node types), Ray's fake autoscaler adds and removes worker raylets on this machine as demand asks."""

    def __init__(self, *, num_cpus: float, dashboard: bool = False, autoscaling: dict[str, Any] | None = None,
                 python: str = sys.executable):
        self.temp_dir = short_temp_dir("rh")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_port = free_port()
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        command = [*ray_cli(python), "start", "--head", f"--temp-dir={self.temp_dir}", f"--port={self.port}",
                   f"--num-cpus={num_cpus}", "--num-gpus=0", f"--include-dashboard={str(dashboard).lower()}",
                   f"--dashboard-port={self.dashboard_port}", "--dashboard-host=127.0.0.1",
                   f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                   f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
                   "--object-store-memory=200000000", "--disable-usage-stats"]
        extra = dict(STARTUP_CONCURRENCY)  # as cluster.yaml starts every node
        config = None
        if autoscaling is not None:
            config = fake_autoscaling_config(self.address, **autoscaling)
            command.append(f"--autoscaling-config={Path(self.temp_dir) / 'autoscaling.yaml'}")
            extra.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
        self.env = private_env(self.temp_dir, **extra)

        def start() -> str | None:
            if config is not None:  # written each attempt: a failed start's temp dir is removed with it
                Path(self.temp_dir).mkdir(parents=True, exist_ok=True)
                (Path(self.temp_dir) / "autoscaling.yaml").write_text(json.dumps(config))
            try:
                subprocess.run(command, env=self.env, check=True, capture_output=True, text=True, timeout=180)
            except subprocess.CalledProcessError as err:
                return f"ray start failed:\n{err.stdout[-3000:]}\n{err.stderr[-3000:]}"
            return None

        start_again_on_node_timeout(start, self.stop, "the Ray head")

    def stop(self) -> None:
        end_ray_in(self.temp_dir)


def ray_cli(python: str = sys.executable) -> list[str]:
    """The `ray` command of `python`'s Ray (a virtual env may share Ray's package without its script)."""
    return [python, "-m", "ray.scripts.scripts"]


def fake_autoscaling_config(gcs_address: str, *, worker_types: dict[str, dict[str, Any]], max_workers: int,
                            head_resources: dict[str, float] | None = None) -> dict[str, Any]:
    """An autoscaler config for Ray's `fake_multinode` provider (nodes are raylets on this machine), in the
    cluster launcher's format (cluster.yaml's keys); the head type holds no workers."""
    return {
        "cluster_name": "fake", "max_workers": max_workers, "upscaling_speed": 1.0, "idle_timeout_minutes": 5,
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "auth": {"ssh_user": "ubuntu"}, "docker": {},
        "available_node_types": {
            "ray.head.default": {"resources": head_resources or {}, "node_config": {}, "max_workers": 0},
            **{name: {"node_config": {}, "min_workers": 0, **t} for name, t in worker_types.items()},
        },
        "head_node_type": "ray.head.default",
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
        "rsync_filter": [], "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def _add_node(cluster: Any, node_args: dict[str, Any]) -> Any:
    """`cluster.add_node`, started again while its failure is Ray's fixed 30 s for the raylet to register (a worker
    node of the 3-node cluster missed it in a fresh clone's slow tier, as the head once did: `start_again_on_node_timeout`
    retries those), up to START_ATTEMPTS times. Ray leaves a timed-out node's raylet running: it is this process's
    child that was not there before the attempt, and it goes with everything it started."""
    for attempt in range(1, START_ATTEMPTS + 1):
        before = set(children_of_every_process()[os.getpid()])
        try:
            return cluster.add_node(**node_args)
        except Exception as err:  # Ray raises a bare Exception when the raylet does not register in time
            if NODE_START_TIMEOUT not in str(err) or attempt == START_ATTEMPTS:
                raise
            stale = sorted(set(children_of_every_process()[os.getpid()]) - before)
            kill_all([pid for raylet in stale for pid in (raylet, *(child for child, _ in descendants(raylet)))])
            print(f"a worker node timed out during startup; starting it again ({attempt + 1}/{START_ATTEMPTS})",
                  file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _serve(head_args: dict[str, Any]) -> None:
    """The child process of LocalCluster: one JSON command per stdin line, one JSON reply per stdout line."""
    from ray.cluster_utils import Cluster

    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # Ray's own prints must not mix with the replies

    def reply(**fields: Any) -> None:
        real_stdout.write(json.dumps(fields) + "\n")
        real_stdout.flush()

    def describe(node) -> dict[str, Any]:
        return {"node_id": node.node_id, "raylet_pid": node.all_processes["raylet"][0].process.pid}

    try:
        cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **head_args})
    except Exception as err:  # Ray raises a bare Exception when the raylet does not register in time
        reply(error=str(err))  # the parent decides whether to start again (LocalCluster)
        raise
    nodes = {cluster.head_node.node_id: cluster.head_node}
    reply(address=cluster.address, node=describe(cluster.head_node))
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "add":
                node = _add_node(cluster, command["args"])
                nodes[node.node_id] = node
                reply(**describe(node))
            elif command["op"] == "remove":
                cluster.remove_node(nodes.pop(command["node_id"]), allow_graceful=False)
                reply(removed=command["node_id"])
            elif command["op"] == "quit":
                break
    finally:
        cluster.shutdown()
        reply(quit=True)


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
