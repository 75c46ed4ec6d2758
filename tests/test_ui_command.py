"""`orchestrator ui` as a user meets it: a busy port refused before anything is printed as served, the MLflow
server stopped with the command however the command is stopped, the hint after train/sweep that opens the store
and study the run used, and a reader of stdout that leaves early (`| head -1`) ending the command quietly.

The server tests start the real `mlflow ui` (about 15 s to listen on a loaded 2-core machine): the slow tier's.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import yaml

from orchestrator.cli import main
from orchestrator.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
LISTEN_S = 120.0
"""How long the real server may take to listen: MLflow's imports on a 2-core machine shared with other jobs."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_busy_port_is_refused_before_any_link_is_printed(tmp_path, monkeypatch, capsys):
    """Another server on the port: exit 2 naming the port, its holder and the fix, and no `MLflow UI on` line
    (those links led to the other server, and the command exited 0)."""
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "mlflow.db"
    store.touch()  # a store to serve (an empty file: MLflow's server would fill it with its tables)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        code = main(["ui", str(SMOKE), f"tracking.uri=sqlite:///{store}", "--port", str(port)])
        took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "MLflow UI on" not in out and "http://" not in out, out
    assert f"port {port}" in err and "--port" in err and f"pid {os.getpid()}" in err, err
    assert took < 10, took  # refused before MLflow's server (or MLflow itself) was started
    assert store.stat().st_size == 0


def test_ui_without_a_spec_where_there_is_no_store_creates_none(tmp_path, monkeypatch, capsys):
    """Without a SPEC, `ui` browses ./mlflow.db; where there is none, MLflow's server made an empty one (and served
    an empty UI). It says what it looked for and how to name a store, exits 2 and writes nothing. The port is
    taken, so that a `ui` that went on to serve would be refused (exit 2 as well, but another message) rather
    than start a server."""
    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = main(["ui", "--port", str(busy.getsockname()[1])])
    out, err = capsys.readouterr()
    assert code == 2 and "MLflow UI on" not in out, (out, err)
    assert f"no tracking store at {tmp_path / 'mlflow.db'}" in err and "`orchestrator ui SPEC`" in err, err
    assert "tracking.uri=sqlite:///" in err and "is not free" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_ui_of_a_spec_whose_store_does_not_exist_here_creates_none(tmp_path, monkeypatch, capsys):
    """`ui SPEC` from a folder where the spec's relative SQLite store is not (not the folder it ran in): MLflow's
    server made an empty store there and showed no runs. It names the path, the folder rule and the override."""
    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = main(["ui", str(SMOKE), "--port", str(busy.getsockname()[1])])
    out, err = capsys.readouterr()
    assert code == 2 and "MLflow UI on" not in out, (out, err)
    assert f"no tracking store at {tmp_path / 'mlflow.db'}" in err and "relative to the current folder" in err, err
    assert f"orchestrator ui {SMOKE} tracking.uri=sqlite:///" in err and "is not free" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("port", ["0", "70000", "http"])
def test_a_port_outside_what_tcp_can_bind_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit) as done:
        main(["ui", "--port", port])
    assert done.value.code == 2 and "--port" in capsys.readouterr().err


def _start_ui(tmp_path: Path, port: int) -> tuple[subprocess.Popen, Path]:
    """`orchestrator ui` on a fresh SQLite store, in a session of its own as from a terminal; returns the process
    and its output log once the server listens and the links are printed. The store is made first, as a run
    would: `ui` without a spec serves ./mlflow.db only where there is one."""
    from mlflow import MlflowClient

    MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments()  # creates the store's tables
    log = tmp_path / "ui.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", "--port", str(port)], cwd=tmp_path,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + LISTEN_S
    while not (_listening(port) and "MLflow UI on" in log.read_text()):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc, log


@pytest.mark.slow
@pytest.mark.parametrize(("how", "signum"), [("pid", signal.SIGTERM), ("pid", signal.SIGINT),
                                             ("terminal", signal.SIGINT)],
                         ids=["kill-TERM-pid", "kill-INT-pid", "ctrl-c"])
def test_stopping_the_command_stops_its_mlflow_server(tmp_path, how, signum):
    """`kill -TERM PID`, `kill -INT PID` and Ctrl-C (SIGINT to the terminal's whole process group) all end the
    MLflow server with the command: nothing listens on the port, no child is left, and no traceback."""
    port = _free_port()
    proc, log = _start_ui(tmp_path, port)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "no MLflow server process under `orchestrator ui`"
    try:
        if how == "pid":
            os.kill(proc.pid, signum)
        else:
            os.killpg(proc.pid, signum)
        code = proc.wait(timeout=30)
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"left running: {[p.pid for p in alive]}"
        assert not _listening(port)
        text = log.read_text()
        assert code == 0 and "Traceback" not in text and "stopped" in text, text
    finally:
        for child in children:
            if child.is_running():
                child.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _write_spec(tmp_path: Path) -> Path:
    raw = yaml.safe_load(SMOKE.read_text())
    raw["model"]["attention"] = {"kind": "mha", "heads": 4}  # one run: what `train` takes
    raw["scales"] = {"tiny": {"optim.max_steps": 20}}
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_hint_after_train_opens_the_store_and_study_the_run_used(tmp_path, monkeypatch, capsys):
    """`train SPEC name=... tracking.uri=... --scale tiny` ends with a `browse with` command that carries the
    overrides and the scale: the spec alone names another store and another experiment."""
    import orchestrator.launch

    monkeypatch.chdir(tmp_path)
    spec = _write_spec(tmp_path)
    uri = f"sqlite:///{tmp_path / 'elsewhere' / 'mlflow.db'}"
    outcome = SimpleNamespace(name="renamed-tiny", metrics={"step": 20}, waiting=None, checkpoint="ckpt",
                              mlflow_run_id="abc")
    monkeypatch.setattr(orchestrator.launch, "run_training", lambda spec: outcome)
    argv = ["train", str(spec), "name=renamed", f"tracking.uri={uri}", "tune.metric=val/loss", "--scale", "tiny"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if "browse with" in line]
    command = shlex.split(line.split("browse with `", 1)[1].rstrip("`"))
    assert command[:2] == ["orchestrator", "ui"], command
    # What that command would open: argparse as `ui` reads it, then the spec as `ui` loads it.
    from orchestrator.cli import _parse

    args = _parse(command[1:])
    base = load_study(args.spec, args.overrides, args.scale).base
    ran = load_study(str(spec), argv[2:5], "tiny").base
    assert (base.tracking.uri, base.tracking.experiment, base.metric) == (uri, ran.tracking.experiment, "val/loss")
    assert ran.tracking.experiment.startswith("renamed") and base.optim.max_steps == 20  # the name and the scale


def test_ui_of_a_tracking_server_names_its_own_port(capsys):
    assert main(["ui", str(SMOKE), "tracking.uri=http://127.0.0.1:5093"]) == 0
    out = capsys.readouterr().out
    assert "http://127.0.0.1:5093" in out and "-p 5093" in out and "5093:127.0.0.1:5093" in out, out
    assert "5000" not in out, out


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path, buffered):
    """`orchestrator validate SPEC | head -1`: stdout's reader is gone before the command writes. It exits as Unix
    tools do (SIGPIPE's status, 141), with no BrokenPipeError, traceback or error file. Unbuffered, the write
    fails inside a print; buffered, at the last flush."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "validate", str(SMOKE)], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=err)
    proc.stdout.close()  # the reader leaves before the first line: `| head -0`, or head done with its line
    code = proc.wait(timeout=120)
    text = (tmp_path / "stderr").read_text()
    assert "BrokenPipe" not in text and "Traceback" not in text and "Exception ignored" not in text, text
    assert code == 128 + signal.SIGPIPE, (code, text)
    assert not list(tmp_path.glob("orchestrator-error-*")), text
