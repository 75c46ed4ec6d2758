"""An MLflow server that asks who you are, as cluster.yaml's head runs it: MLflow's basic-auth app, its admin
password set at the first start (MLFLOW_AUTH_ADMIN_PASSWORD; MLflow ships none), and every client, the
launcher and its local Ray's Train workers included, authenticated by MLFLOW_TRACKING_USERNAME /
MLFLOW_TRACKING_PASSWORD in its environment and nothing else (no spec field holds a credential). One real
server, one tiny `orchestrator train`."""

from __future__ import annotations

import secrets
import tempfile
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.server.auth.client import AuthServiceClient

from tests.real_runs import MlflowServer, Proc, orchestrator, process_env, runs_of, write_spec

pytestmark = pytest.mark.slow

ADMIN = "admin"
CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def _ray_sessions_of(launcher: Proc, since: float) -> list[Path]:
    """The Ray sessions a launcher started: Ray names each folder after the process that started it (and an
    older folder may carry a recycled pid, hence `since`, when the launcher started)."""
    folders = (Path(tempfile.gettempdir()) / "ray").glob(f"session_*_{launcher.popen.pid}")
    return [folder for folder in folders if folder.stat().st_mtime >= since]


def _refused(uri: str, code: int) -> None:
    with pytest.raises(MlflowException, match=f"error code {code}"):
        MlflowClient(uri).search_experiments(max_results=1)


def test_a_basic_auth_server_refuses_strangers_and_gets_the_run_with_the_environments_credentials(tmp_path,
                                                                                                   monkeypatch):
    # An in-process launcher of an earlier test leaves its short per-request timeout in this process's
    # environment (tracking.configure_http); this test's own client talks to a busy server and needs a longer one.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    password = secrets.token_hex(16)  # as the setup step of cluster.yaml makes one
    (tmp_path / "mlflow").mkdir()
    server = MlflowServer(tmp_path / "mlflow", app="basic-auth",
                          env={"MLFLOW_AUTH_ADMIN_USERNAME": ADMIN, "MLFLOW_AUTH_ADMIN_PASSWORD": password,
                               "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32)})  # the UI's CSRF key
    server.start()
    try:
        for name in CREDENTIALS:
            monkeypatch.delenv(name, raising=False)
        _refused(server.uri, 401)  # no credentials
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-" + password)
        _refused(server.uri, 401)  # a wrong password

        spec = write_spec(tmp_path, "auth", server.uri, optim={"max_steps": 4},
                          run={"checkpoint_every": 4, "eval_every": 4})
        # The launcher with a wrong password stops at its preflight, before Ray, naming the variables to set.
        started = time.time()
        wrong = orchestrator(tmp_path, "train", str(spec), env=process_env(MLFLOW_TRACKING_USERNAME=ADMIN,
                                                                            MLFLOW_TRACKING_PASSWORD="not-" + password))
        assert wrong.wait(timeout=120) != 0
        assert all(name in wrong.output for name in CREDENTIALS) and "401" in wrong.output, wrong.output[-3000:]
        assert not _ray_sessions_of(wrong, started), wrong.output[-3000:]  # no cluster time spent

        started = time.time()
        run = orchestrator(tmp_path, "train", str(spec),
                           env=process_env(MLFLOW_TRACKING_USERNAME=ADMIN, MLFLOW_TRACKING_PASSWORD=password))
        assert run.wait(timeout=600) == 0, run.output[-4000:]
        assert password not in run.output
        # No process of the run was refused: the launcher, and the Train worker of its local Ray, whose warnings
        # Ray forwards here (points refused there would still reach MLflow later, from the launcher's spool).
        assert "TrackingWarning" not in run.output, run.output[-4000:]
        assert _ray_sessions_of(run, started)  # the check above sees a launcher's Ray where there is one
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        (logged,) = runs_of(server.uri, "auth")
        assert logged.info.status == "FINISHED"
        # Points logged by the Train worker, a process of the launcher's local Ray: its credentials came from
        # the environment the raylet inherited from the launcher.
        history = MlflowClient(server.uri).get_metric_history(logged.info.run_id, "train/loss")
        assert sorted(point.step for point in history) == [1, 2, 3, 4]
        assert not any(password in str(value) for value in (*logged.data.params.values(), *logged.data.tags.values()))

        # Rotation as docs/orchestrator.md describes it: the admin changes its own password through the server.
        rotated = secrets.token_hex(16)
        AuthServiceClient(server.uri).update_user_password(ADMIN, rotated, current_password=password)
        _refused(server.uri, 401)  # the old password no longer works
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", rotated)
        assert runs_of(server.uri, "auth")[0].info.run_id == logged.info.run_id
    finally:
        server.stop()
