"""Real processes for the tests that play a user's day: `python -m orchestrator ...` subprocesses whose whole
tree can be ended, a real `mlflow server` on 127.0.0.1, tiny causal-LM specs on the built-in corpus, and what
MLflow holds afterwards. Shared by tests/test_faults.py (one machine) and tests/test_cluster.py (multi-node)."""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from orchestrator.cluster.ray_env import TRAIN_POLL_INTERVAL
from orchestrator.tracking.describe import MLFLOW_SERVER_ENV

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_EVERY = 4
MAX_STEPS = 24
METRICS = ("train/loss", "train/tokens_per_s", "lr", "memory/peak_gb", "val/loss", "val/ppl")

# --- processes ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    env.pop("RAY_ADDRESS", None)  # each case starts its own local Ray, as a user's first command does
    return {**env, **extra}


class Proc:
    """A subprocess in its own session (so its whole tree can be ended) whose output is collected live."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None):
        self.popen = subprocess.Popen(args, cwd=cwd, env=env or process_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.end()
            pytest.fail(f"{self.popen.args} still running after {timeout:.0f}s; output:\n{self.output[-4000:]}")
        self._reader.join(timeout=10)
        return rc

    def end(self) -> None:
        """SIGKILL what is left of the process's session (its Ray processes included)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=30)


def kill_tree(proc: Proc) -> None:
    """SIGKILL the launcher alone, as a user's `kill -9` or the OOM killer would: its local Ray must end with it
    (orchestrator/cluster/reaper.py), every process it had started gone within 10 s, Ray's agents and the Train
    workers included."""
    tree = descendants(proc.popen.pid)
    os.kill(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(timeout=30)
    deadline = time.monotonic() + 10
    while (left := [cmd for pid, cmd in tree if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.end()
    assert not left, f"still alive 10 s after the launcher's SIGKILL: {[cmd[:80] for cmd in left]}"


def alive(pid: int) -> bool:
    """Running (a zombie is dead: in a container nobody may reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def children_of_every_process() -> dict[int, list[int]]:
    """The machine's process tree, read once from /proc: parent PID -> its children's PIDs."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children[int(fields[1])].append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return children


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `pid` (Ray's raylet starts the workers)."""
    children = children_of_every_process()
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                cmd = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            out.append((child, cmd))
            todo.append(child)
    return out


def wait_for(condition, timeout: float, what: str, proc: Proc | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.popen.poll() is not None:
            pytest.fail(f"process ended (rc {proc.popen.returncode}) before {what}:\n{proc.output[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}" + (f":\n{proc.output[-4000:]}" if proc else ""))


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store; stop() and start() again keep the store. With
    `artifacts` (s3://bucket/prefix) and `env` (the S3 settings), artifacts go to S3 as on a cloud cluster:
    `--artifacts-destination`, proxied by the server (clients need no S3 credentials). With `app`, MLflow's
    server app of that name (`basic-auth`: credentials asked of every request but /health, its user store
    in the server's working directory, the root)."""

    def __init__(self, root: Path, artifacts: str | None = None, env: dict[str, str] | None = None,
                 app: str | None = None):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.artifacts, self.env, self.app = artifacts, env or {}, app

    def start(self) -> None:
        artifacts = (["--artifacts-destination", self.artifacts] if self.artifacts else
                     ["--default-artifact-root", str(self.root / "artifacts")])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             *artifacts, *(["--app-name", self.app] if self.app else []), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1",
             # As an on-prem server names its hosts: `localhost` is then refused (403), as a hostname missing from
             # the list is (test_faults.py::test_host_outside_allowed_hosts_is_named_with_the_server_flag).
             "--allowed-hosts", f"127.0.0.1:{self.port}"],
            cwd=self.root, env=process_env(**{**MLFLOW_SERVER_ENV, **self.env}), stdout=subprocess.DEVNULL,
            stderr=open(self.root / "server.err", "ab"), start_new_session=True)  # noqa: SIM115 - the child holds it

        def healthy() -> bool:
            if self.proc.poll() is not None:  # a server that refused to start says why at once
                pytest.fail(f"mlflow server exited ({self.proc.returncode}):\n"
                            f"{(self.root / 'server.err').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        try:
            wait_for(healthy, 300, f"mlflow server on {self.uri}")
        except BaseException:
            self.stop()  # a server that never answered must not outlive the test
            raise

    def stop(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self.proc = None


# --- specs and what MLflow holds ----------------------------------------------------------------------------


def write_spec(folder: Path, name: str, uri: str, **sections) -> Path:
    raw = {
        "name": name,
        "task": {"kind": "clm", "seq_len": 16, "batch_size": 4, "vocab_size": 120, "eval_batches": 1,
                 "builtin": {"train_sentences": 300, "eval_sentences": 20}},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16, "dropout": 0.0,
                  "attention": {"kind": "mha", "heads": 2}},
        "optim": {"lr": 3e-3, "max_steps": MAX_STEPS, "warmup_steps": 1, "seed": 5},
        "run": {"checkpoint_every": CHECKPOINT_EVERY, "eval_every": CHECKPOINT_EVERY, "log_every": 1,
                "keep_checkpoints": 2, "storage_path": str(folder / "runs"), "final_eval": False},
        "tune": {"scheduler": "fifo"},
        # A loaded CI box answers slowly: a short timeout failed the preflight, and a timed-out create_run that the
        # server had in fact done was retried into a duplicate run. A dead server refuses at once either way.
        "tracking": {"uri": uri, "retries": 2, "timeout_s": 15},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


PACED = {TRAIN_POLL_INTERVAL: "2"}
"""The environment of a launch that a test acts on midway (a kill after a checkpoint, an outage after some
points): Ray Train's own poll interval of 2 s, not the local Ray's 0.2 s (orchestrator/cluster/ray_env.py). A
worker's report waits for the poll that takes the report before it, so such a run moves on by one
checkpoint per poll at most, on any machine, and the test's 0.2 s waits act between two checkpoints. A launch
that runs to its end unhindered (a resume, a refused launch) keeps the fast poll."""


def orchestrator(folder: Path, *args: str, env: dict[str, str] | None = None, paced: bool = False) -> Proc:
    """`python -m orchestrator *args` in `folder`; `paced` for a run the test acts on before it ends (PACED)."""
    env = env or process_env()
    return Proc([sys.executable, "-m", "orchestrator", *args], cwd=folder, env={**env, **PACED} if paced else env)


def runs_of(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def points_per_step(uri: str, run_id: str, key: str) -> collections.Counter:
    return collections.Counter(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def assert_one_point_per_step(uri: str, run_id: str, last_step: int = MAX_STEPS) -> None:
    """Every metric at every step where it is logged, once (train/* every step, val/* every checkpoint)."""
    for key in METRICS:
        steps = range(1, last_step + 1) if not key.startswith("val/") else range(CHECKPOINT_EVERY, last_step + 1,
                                                                                 CHECKPOINT_EVERY)
        assert points_per_step(uri, run_id, key) == {s: 1 for s in steps}, key


def last_logged_step(uri: str, experiment: str) -> int:
    runs = runs_of(uri, experiment)
    if not runs:
        return 0
    history = MlflowClient(uri).get_metric_history(runs[0].info.run_id, "train/loss")
    return max((m.step for m in history), default=0)


def checkpoint_on_disk(run_folder: Path, step: int) -> bool:
    """A complete checkpoint of step `step` or later: Ray deletes early checkpoints once `run.keep_checkpoints`
    better ones exist, so a trial that ran ahead no longer holds the one of `step` itself."""
    return any(int(folder.name.removeprefix("checkpoint_")) >= step and (folder / "state.pt").is_file()
               for folder in run_folder.glob("checkpoint_*") if folder.name.removeprefix("checkpoint_").isdigit())


def resumed_step(output: str) -> int:
    found = re.findall(r"resumed from step (\d+)", output)
    assert found, f"no 'resumed from step' line in:\n{output[-3000:]}"
    return int(found[-1])
