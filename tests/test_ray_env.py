"""Starting a local Ray on a loaded machine: Ray's fixed 30 s wait for its raylet is retried, nothing else is.
`ray.init` is replaced by a stand-in here; the real start is what every Ray test of the suite goes through."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import ray

from orchestrator.cluster import ray_env, reaper as ray_reaper


class FakeRay:
    def __init__(self, failures: list[Exception]):
        self.failures, self.inits, self.shutdowns = list(failures), 0, 0

    def init(self, **kwargs) -> None:
        self.inits += 1
        assert kwargs["include_dashboard"] is False and kwargs["num_cpus"] == 2
        assert os.environ[ray_env.LOCAL_RAY] == "1"  # each attempt inherits the local Ray's environment
        if self.failures:
            raise self.failures.pop(0)
        return SimpleNamespace(address_info={"session_dir": "/tmp/ray/session_stand_in"})

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def fake(monkeypatch):
    def install(*failures: Exception) -> FakeRay:
        stand_in = FakeRay(list(failures))
        monkeypatch.setattr(ray, "init", stand_in.init)
        monkeypatch.setattr(ray, "shutdown", stand_in.shutdown)
        monkeypatch.setattr(ray_env, "_started_here", False)
        return stand_in
    return install


def timed_out() -> Exception:
    return Exception(f"{ray_env.NODE_START_TIMEOUT}. This could happen because some of the raylet failed to "
                     "startup or the GCS has become overloaded.")


def test_a_raylet_that_missed_rays_30_s_wait_is_started_again(fake, capsys):
    stand_in = fake(timed_out())
    ray_env.start_local_ray(num_cpus=2)
    assert (stand_in.inits, stand_in.shutdowns) == (2, 1)
    assert ray_env.on_local_ray()
    assert "starting the local Ray again (2/3)" in capsys.readouterr().err
    assert ray_env.LOCAL_RAY not in os.environ  # the launcher's environment as it was


def test_the_start_gives_up_after_its_attempts(fake):
    stand_in = fake(*[timed_out() for _ in range(ray_env.START_ATTEMPTS)])
    with pytest.raises(Exception, match=ray_env.NODE_START_TIMEOUT):
        ray_env.start_local_ray(num_cpus=2)
    assert stand_in.inits == ray_env.START_ATTEMPTS and not ray_env.on_local_ray()


def test_any_other_start_failure_is_not_retried(fake):
    stand_in = fake(ValueError("num_cpus must be >= 0"))
    with pytest.raises(ValueError, match="num_cpus"):
        ray_env.start_local_ray(num_cpus=2)
    assert (stand_in.inits, stand_in.shutdowns) == (1, 0)


# --- the local Ray ends with its launcher (orchestrator/cluster/reaper.py) ------------------------------------------

STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
log = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
if len(sys.argv) > 2:
    import ray._raylet
    ray._raylet.setproctitle(sys.argv[2])
print("up", flush=True)
time.sleep(120)
"""
"""A process that ignores SIGTERM, as Ray's DashboardAgent and RuntimeEnvAgent do; with a first argument, it
keeps that file open (Ray's processes keep their log files in their session folder open); with a second, it
renames itself through Ray's own setproctitle, as Ray's agents do, which blanks the environment /proc shows."""


def _stubborn(owner: str, log: Path | None = None, title: str | None = None) -> subprocess.Popen:
    env = {**os.environ, ray_reaper.OWNER_ENV: owner} if owner else dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN, *([str(log)] if log else []), *([title] if title else [])],
                            env=env, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline() == b"up\n"  # its handler is installed
    return proc


LAUNCHER = """
import sys, time
from orchestrator.cluster.reaper import start_reaper, tell_session
reaper = start_reaper("1-aa")
tell_session(reaper, sys.argv[1])
log = open(sys.argv[1] + "/logs/driver.log", "a")  # a driver keeps its own Ray logs open too
print("up", flush=True)
sys.stdin.readline()
reaper.stdin.close()  # as the interpreter does while it finalizes: the launcher is still there
time.sleep(1.0)
"""
"""A launcher stand-in: starts the reaper, tells it its session folder, and ends when told."""


@pytest.mark.slow
def test_the_reaper_kills_its_owners_processes_when_the_launcher_ends_and_no_others(tmp_path):
    """Found by the owner in its environment, or, for a process Ray renamed (its environment blanked), by a
    file open in the launcher's Ray session folder; the launcher itself lives, and so do another owner's and
    another session's processes, and a process of someone else's that merely works in the session folder
    (a `tail -f` of a Ray log started there: its environment is readable and names no owner)."""
    session = tmp_path / "session_mine"
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "raylet.out").write_text("a Ray log\n")
    (tmp_path / "session_mine_2").mkdir()
    by_env = _stubborn("1-aa")
    by_session = _stubborn("", session / "logs" / "agent.log", title="ray::DashboardAgent")
    bystander = subprocess.Popen(["tail", "-f", str(session / "logs" / "raylet.out")], cwd=session,
                                 stdout=subprocess.DEVNULL, start_new_session=True)
    others = [_stubborn("1-aab"), _stubborn("", tmp_path / "session_mine_2" / "agent.log"),  # prefixes are not matches
              _stubborn("", session / "logs" / "agent2.log"), bystander]
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(session)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ray_env.PROJECT_ROOT,
                                env={**os.environ, "PYTHONPATH": str(ray_env.PROJECT_ROOT)})
    try:
        assert launcher.stdout.readline() == b"up\n"
        time.sleep(0.3)
        assert by_env.poll() is None and by_session.poll() is None  # nothing happens while the launcher lives
        launcher.stdin.write(b"end\n")
        launcher.stdin.flush()
        assert by_env.wait(timeout=10) == -signal.SIGKILL and by_session.wait(timeout=10) == -signal.SIGKILL
        assert launcher.wait(timeout=15) == 0
        assert [proc.args for proc in others if proc.poll() is not None] == []
    finally:
        for proc in (by_env, by_session, *others, launcher):
            proc.kill()
            proc.wait()


def test_the_project_root_given_to_every_ray_process_is_the_checkout():
    """Ray's processes import the project from PROJECT_ROOT (their PYTHONPATH): it must be the folder that holds
    the packages, wherever ray_env.py sits inside orchestrator/."""
    assert (ray_env.PROJECT_ROOT / "pyproject.toml").is_file()
    assert all((ray_env.PROJECT_ROOT / package / "__init__.py").is_file()
               for package in ("orchestrator", "tasks", "models", "kernels"))
    assert str(ray_env.PROJECT_ROOT) in ray_env.local_ray_environment()["PYTHONPATH"].split(os.pathsep)



def test_train_polls_a_local_rays_workers_often_unless_the_user_chose(monkeypatch):
    """A worker's `report` waits for the controller's next poll (Ray Train's default: every 2 s), so a local
    Ray polls every TRAIN_POLL_INTERVAL_S; a value the user set is passed on as it is."""
    import ray.train.v2._internal.constants as train_constants

    assert train_constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR == ray_env.TRAIN_POLL_INTERVAL  # Ray's name for it
    monkeypatch.delenv(ray_env.TRAIN_POLL_INTERVAL, raising=False)
    assert float(ray_env.local_ray_environment()[ray_env.TRAIN_POLL_INTERVAL]) < 1
    monkeypatch.setenv(ray_env.TRAIN_POLL_INTERVAL, "5")
    assert ray_env.local_ray_environment()[ray_env.TRAIN_POLL_INTERVAL] == "5"

# --- a local Ray listens on the loopback only -----------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, Ray's IPv6 sockets on an IPv4 loopback
    return (mapped or address).is_loopback


def test_a_local_rays_processes_listen_on_the_loopback_only(ray_cluster):
    """Every listening socket of the session's local Ray (started by start_local_ray, as `train` and `sweep`
    start theirs): GCS, raylet (node and object manager), Ray's agents, a task's and an actor's worker, and
    this driver's own core-worker server; none on 0.0.0.0 or ::, where other machines would reach it."""

    @ray_cluster.remote(num_cpus=0)
    class Probe:
        def pid(self) -> int:
            return os.getpid()

    @ray_cluster.remote(num_cpus=0)
    def task_pid() -> int:
        return os.getpid()

    probe = Probe.remote()
    workers = {ray_cluster.get(probe.pid.remote()), ray_cluster.get(task_pid.remote())}
    # Ray's processes carry their launcher's owner variable (local_ray_environment); its agents, which rename
    # themselves and so blank what /proc shows of their environment, are found as the raylet's children.
    processes = {psutil.Process()}
    for process in psutil.process_iter():
        try:
            if process.environ().get(ray_reaper.OWNER_ENV) == ray_env._owner:
                processes |= {process, *process.children(recursive=True)}
        except psutil.Error:  # gone, or another user's
            continue
    listening: dict[str, list[str]] = {}
    for process in processes:
        try:
            name = f"{process.name()}[{process.pid}]"
            sockets = [c.laddr for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
        listening.update({name: [f"{a.ip}:{a.port}" for a in sockets]} if sockets else {})
    names = " ".join(listening)
    assert all(part in names for part in ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent")), listening
    assert any(f"[{pid}]" in names for pid in workers), listening
    exposed = {name: addrs for name, addrs in listening.items() if not all(_is_loopback(a.rsplit(":", 1)[0]) for a in addrs)}
    assert not exposed, f"listening beyond the loopback: {exposed}"
    ray_cluster.kill(probe)
