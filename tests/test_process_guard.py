"""Nothing a test session started outlives it (tests/process_guard.py): the guard's search on stand-in processes
(fast), and a whole pytest session that started an `mlflow server`, SeaweedFS, a local Ray and a launcher, killed
midway by SIGTERM or SIGKILL (real-process tier)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import process_guard
from tests.real_runs import ROOT, alive

STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("up", flush=True)
time.sleep(120)
"""
"""A process in a session of its own that ignores SIGTERM (as Ray's agents do)."""


def _stubborn(tag: str | None) -> subprocess.Popen:
    env = {name: value for name, value in os.environ.items() if name != process_guard.SESSION_ENV}
    if tag is not None:
        env[process_guard.SESSION_ENV] = tag
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], env=env, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline() == b"up\n"
    return proc


def test_the_guard_kills_its_sessions_processes_when_its_pipe_closes_and_no_others():
    """While pytest (here: this test) holds the pipe, nothing happens; once it closes, every process carrying the
    session's tag is SIGKILLed, its own session and ignored SIGTERM notwithstanding, and a process of another
    session (a tag that merely starts with this one) or of none lives."""
    tag = process_guard.new_tag()
    guard = process_guard.start_guard(tag)
    mine = [_stubborn(tag), _stubborn(tag)]
    others = [_stubborn(tag + "0"), _stubborn(None)]
    try:
        assert guard.poll() is None and all(proc.poll() is None for proc in mine)
        guard.stdin.close()  # what the kernel does when pytest ends, however it ends
        assert [proc.wait(timeout=30) for proc in mine] == [-signal.SIGKILL] * 2
        assert guard.wait(timeout=60) == 0
        assert [proc.args for proc in others if proc.poll() is not None] == []
    finally:
        for proc in (*mine, *others, guard):
            proc.kill()
            proc.wait()


def test_the_guard_unmounts_what_the_session_still_holds_and_nothing_it_let_go():
    """The guard's reading of its pipe: each `mount` line holds a path until its `unmount` line; paths of any bytes
    (a space, a newline) come through whole."""
    odd = Path("/tmp/a b\nc")
    line = process_guard.mount_line
    lines = [line("mount", Path("/tmp/x")), line("mount", odd), line("mount", Path("/tmp/y")),
             line("unmount", Path("/tmp/x")), line("unmount", Path("/tmp/never-mounted")), line("mount", Path("/tmp/x"))]
    assert process_guard.held_mounts(lines) == [odd, Path("/tmp/y"), Path("/tmp/x")]
    assert process_guard.held_mounts([]) == []


def test_the_ray_sessions_of_a_process_are_the_session_folders_it_has_files_open_in(tmp_path):
    """Ray's renamed agents are found by the session folder of the tagged Ray they belong to."""
    folder = tmp_path / "ray" / "session_2026-11-27_10-00-00_123_4" / "logs"
    folder.mkdir(parents=True)
    (tmp_path / "ray" / "session_latest").symlink_to(folder.parent)
    with open(folder / "raylet.out", "w"), open(tmp_path / "elsewhere.log", "w"):
        assert process_guard.ray_sessions_of([os.getpid()]) == (str(folder.parent),)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_killed_pytest_leaves_no_mlflow_weed_ray_or_launcher_behind(how, tmp_path):
    """A pytest session that started a real `mlflow server`, SeaweedFS, its local Ray and a launcher in a session
    of its own, killed midway: by SIGTERM (teardown runs, then a SIGKILL if it has not ended in 60 s), or by
    SIGKILL of pytest itself (no teardown: the guard ends them). Afterwards no process of that session is left, and
    the tmpfs it mounted (as root) is unmounted."""
    out = tmp_path / "pids.json"
    # RUN_SLOW=1: the inner test uses server fixtures, which makes it a real-process case (conftest's
    # SERVER_FIXTURES); without it the inner session would deselect its only test and end at once.
    env = {**os.environ, "GUARDED_SESSION_OUT": str(out), "PYTHONPATH": str(ROOT), "RUN_SLOW": "1"}
    pytest_proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--durations=0",
         "--basetemp", str(tmp_path / "inner"), str(ROOT / "tests" / "guarded_session.py")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while not out.exists():
            assert pytest_proc.poll() is None, pytest_proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the inner session did not start its processes in 400 s"
            time.sleep(0.5)
        started = json.loads(out.read_text())
        assert all(alive(pid) for pid in started["pids"].values()), started
        assert all(os.path.ismount(path) for path in started["mounts"]), started
        if how == "SIGTERM":
            pytest_proc.send_signal(signal.SIGTERM)
            try:
                pytest_proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest_proc.kill()
        else:
            pytest_proc.kill()
        pytest_proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while (left := _left(started)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"alive after pytest's {how}: {left}"
    finally:
        if pytest_proc.poll() is None:
            pytest_proc.kill()
            pytest_proc.wait()


def _left(started: dict) -> list[str]:
    """What is still there of the inner session: the processes it named, any carrying its tag, and the filesystem
    it mounted."""
    named = [f"{name} ({pid})" for name, pid in started["pids"].items() if alive(pid)]
    tagged = process_guard.reaper.owned_by(started["tag"], variable=process_guard.SESSION_ENV)
    mounts = [f"a tmpfs mounted at {path}" for path in started["mounts"] if os.path.ismount(path)]
    return named + [f"tagged {_command(pid)} ({pid})" for pid in tagged if alive(pid)] + mounts


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:100]
    except OSError:
        return "(gone)"
