"""`orchestrator ui`: MLflow's UI server on a local tracking store, for one user on 127.0.0.1, and the
`orchestrator ui ...` command that train and sweep print to open what they ran.

The server runs in a process group of its own, and the command passes SIGINT, SIGTERM and SIGHUP on to that
group. Before this, `subprocess.call` left `mlflow ui` and its uvicorn process listening as orphans when the
command alone was stopped (`kill PID`), and Ctrl-C reached uvicorn directly, which printed two tracebacks. The
links are printed once the server listens: printed first, they led to whatever else held the port.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from orchestrator.tracking.describe import MLFLOW_SERVER_ENV, artifact_root

HOST = "127.0.0.1"
"""Where the UI listens: this machine only (`ssh -L` reaches it from elsewhere)."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_S = 15.0
"""How long the server's processes get to end after SIGTERM before they are killed."""
POLL_S = 0.02
"""Between checks that the server listens: short, so that the links are out before a first page is asked for."""


def port_argument(value: str) -> int:
    """`--port`: a TCP port the server can listen on (0 would let it pick one the printed links cannot name)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


def ui_command(spec_path: str | None, overrides: Sequence[str], scale: str | None) -> str:
    """The `orchestrator ui` command that opens what a train or sweep ran: its overrides and scale may name
    the store (tracking.uri=), the experiment (name=, --scale) or the metric that orders the runs page."""
    words = ["orchestrator", "ui", *([spec_path, *overrides] if spec_path else [])]
    return shlex.join([*words, *(["--scale", scale] if scale else [])])


def server_advice(uri: str) -> str:
    """`ui` of a tracking server (http[s]://): it serves its own UI, on its own port."""
    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or "localhost"
    return (f"tracking server already serves the UI at {uri}\n"
            f"on a cluster, forward its port first: `ray attach cluster.yaml -p {port}` or "
            f"`ssh -L {port}:{host}:{port} <user>@<head-ip>`, then open {parts.scheme}://localhost:{port}{parts.path}")


def missing_store(uri: str, spec: str | None) -> str | None:
    """Why `orchestrator ui` does not serve `uri`, a SQLite store whose file does not exist, or None when it exists
    (or `uri` is no SQLite file); `spec` is the SPEC argument (None: the default store of the current folder).
    MLflow's server creates the store it does not find, so browsing in the wrong folder left an empty mlflow.db
    there and showed an empty UI instead of the user's runs."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri == prefix + ":memory:":
        return None
    database = Path(uri[len(prefix):]).resolve()
    if database.is_file():
        return None
    where = ("sqlite:///path/to/mlflow.db (relative to the current folder; sqlite:////path for an absolute one)")
    if spec is None:
        return (f"no tracking store at {database}: without a SPEC, `orchestrator ui` browses sqlite:///mlflow.db of "
                "the current folder, and creates none. Start it in the folder that holds your runs' mlflow.db, or "
                f"name the store: `orchestrator ui SPEC` browses the spec's tracking.uri, and `orchestrator ui SPEC "
                f"tracking.uri={where}` another SQLite store")
    return (f"no tracking store at {database}: nothing has run with {spec}'s tracking.uri={uri} from this folder "
            "yet, and `orchestrator ui` creates none. A relative SQLite path is relative to the current folder: start "
            f"it in the folder you ran train or sweep from, or give the store: `orchestrator ui {spec} "
            f"tracking.uri={where}`")


def port_problem(port: int) -> str | None:
    """Why the server could not listen on HOST:port, or None."""
    if (err := _bind_error(port)) is None:
        return None
    return (f"port {port} on {HOST} is not free ({err.strerror}{_holder(port)}); "
            f"pass another, e.g. --port {_free_port_after(port)}")


def _bind_error(port: int) -> OSError | None:
    """What binding HOST:port raises, or None. SO_REUSEADDR as uvicorn binds: a port left in TIME_WAIT by a UI
    stopped a moment ago is free to it, one that a process listens on is not."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError as err:
            return err
    return None


def _holder(port: int) -> str:
    """`: pid N listens there (its command)`, when this user may see that process; else nothing."""
    import psutil

    try:
        for conn in psutil.net_connections("tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                command = shlex.join(psutil.Process(conn.pid).cmdline())
                return f"; pid {conn.pid} listens there: {command if len(command) < 100 else command[:99] + '...'}"
    except (psutil.Error, OSError):  # another user's process, or a platform that will not say
        pass
    return ""


def _free_port_after(port: int) -> int | str:
    return next((p for p in range(port + 1, min(port + 100, 65536)) if _bind_error(p) is None), "N")


def server_command(uri: str, port: int) -> list[str]:
    """`mlflow ui` on `uri`. One worker process: a UI for one user; MLflow's default of 4 uvicorn workers, each
    importing MLflow, ran past uvicorn's start-up health check on a loaded 2-core machine, which then killed
    them in a loop. The project's experiments keep their artifacts next to a SQLite store
    (describe.artifact_root), and the UI reads them there; experiments made in the UI go there too, not to
    `./mlartifacts` of the folder `orchestrator ui` was started in."""
    root = artifact_root(uri)
    return [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", HOST, "--port", str(port),
            "--workers", "1", *([] if root is None else ["--artifacts-destination", str(root)])]


def runs_page(uri: str, base: str, experiment: str, metric: str, mode: str) -> str | None:
    """The experiment's training-runs page (not MLflow 3's GenAI overview), when the store already has it."""
    from orchestrator.tracking.read import TrackingReader, ui_url  # deferred: MLflow only once the port is free

    try:
        found = TrackingReader(uri).experiment(experiment)
    except Exception:  # noqa: BLE001 - no store yet: the UI still starts, on its experiment list
        return None
    return ui_url(base, found.experiment_id, metric=metric, mode=mode) if found else None


def serve_ui(uri: str, port: int, experiment: str | None = None, metric: str = "", mode: str = "min") -> int:
    """`orchestrator ui` on a local store: 2 when the port is taken, else the server's run (see run_server)."""
    base = f"http://{HOST}:{port}"

    def lines() -> str:
        # Read before the server starts: MLflow's server sets up a new store's tables as it starts.
        runs = runs_page(uri, base, experiment, metric, mode) if experiment else None
        return "\n".join([f"MLflow UI on {uri}: {base}",
                          *([f"the study's runs, best first: {runs}"] if runs else []),
                          f"on a remote machine, forward the port: `ssh -L {port}:localhost:{port} <user>@<host>` "
                          f"(Ray cluster: `ray attach cluster.yaml -p {port}`), then open http://localhost:{port}"])

    return run_server(server_command(uri, port), {**os.environ, **MLFLOW_SERVER_ENV}, port=port, lines=lines)


def run_server(cmd: list[str], env: dict[str, str], *, port: int, lines: Callable[[], str]) -> int:
    """Run the server until it ends or the command is stopped; `lines()` is printed once it listens. Exit code
    2 when the port is taken, 0 when a signal stopped the command, else 1 when the server failed."""
    if problem := port_problem(port):
        print(f"orchestrator ui: {problem}", file=sys.stderr)
        return 2
    text = lines()
    with _forwarded() as forward:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        forward.group = proc.pid  # the session's leader: its pid is the group's id
        try:
            if forward.signum is not None:  # a signal that came before the group existed
                forward.send()
            if _wait_listening(proc, port, forward):
                print(text, flush=True)
            code = proc.wait()
        finally:
            _end_group(proc.pid)
    if forward.signum is not None:
        print(f"orchestrator ui: stopped ({signal.Signals(forward.signum).name}); the MLflow server on port {port} "
              "has ended", file=sys.stderr)
        return 0
    print(f"orchestrator ui: the MLflow server exited (code {code}); its messages are above", file=sys.stderr)
    return 1 if code else 0


class _Forward:
    """A stop signal to the command, sent on to the server's group as SIGTERM: uvicorn then shuts down
    quietly (after SIGINT it re-raises the signal, a KeyboardInterrupt with two tracebacks). A second signal
    kills the group, for a server that does not end."""

    def __init__(self) -> None:
        self.group: int | None = None
        self.signum: int | None = None
        self.sent = 0

    def __call__(self, signum: int, _frame: object) -> None:
        self.signum = signum
        self.send()

    def send(self) -> None:
        if self.group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.group, signal.SIGTERM if not self.sent else signal.SIGKILL)
            self.sent += 1


@contextlib.contextmanager
def _forwarded() -> Iterator[_Forward]:
    forward = _Forward()
    previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
    try:
        yield forward
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _wait_listening(proc: subprocess.Popen, port: int, forward: _Forward) -> bool:
    """Whether the server came to listen on the port before it ended or the command was stopped."""
    while proc.poll() is None and forward.signum is None:
        with socket.socket() as sock:
            if sock.connect_ex((HOST, port)) == 0:
                return True
        time.sleep(POLL_S)
    return False


def _end_group(group: int) -> None:
    """Nothing of the server outlives the command: `mlflow ui` may end before the uvicorn process it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        while time.monotonic() < deadline:
            os.killpg(group, 0)  # ProcessLookupError once the group is empty
            time.sleep(0.05)
        os.killpg(group, signal.SIGKILL)
