"""`orchestrator status NAME` when something around the run is gone: the tracking server does not answer, the
launcher was SIGKILLed (its MLflow runs still say RUNNING), or the storage itself cannot be reached.

Real parts: run folders written through RunLayout and checkpoint_name as the launcher writes them, a real
SQLite MLflow store, the lock taken by the project's own `name_lock` in a process that is then SIGKILLed, and
127.0.0.1 ports with nothing listening for the servers that are down. The command's own entry point (`main`)
runs in this process: a traceback would fail the test, as it would have shown on the console."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

from mlflow import MlflowClient

from orchestrator.cli import main
from orchestrator.storage.layout import RunLayout, checkpoint_name
from orchestrator.tracking.describe import PARENT_TAG, TRIAL_TAG

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 20
TINY = {"task": {"kind": "clm"}, "optim": {"max_steps": MAX_STEPS}}


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then let go): a connection is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def status(capsys, name: str, storage: Path | str, *flags: str) -> tuple[int, str, str]:
    code = main(["status", name, "--storage-path", str(storage), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def stored_run(storage: Path, name: str, uri: str, run_id: str, steps: tuple[int, ...]) -> RunLayout:
    """A single run as its launcher records it: orchestrator.json with the MLflow run id, then checkpoints."""
    layout = RunLayout(str(storage), name)
    layout.write_meta({"kind": "run", "name": name, "spec": {"name": name, **TINY, "tracking": {"uri": uri}},
                       "mlflow_run_id": run_id})
    for step in steps:
        (storage / name / checkpoint_name(step)).mkdir()
    return layout


def test_a_tracking_server_that_does_not_answer_is_named_and_storage_still_shows_the_run(tmp_path, capsys):
    """QA finding 10: the server down read as "not in MLflow" / "no MLflow run, step -/20", though the run and its
    checkpoint_000000020 were there."""
    uri = f"http://127.0.0.1:{closed_port()}"
    layout = stored_run(tmp_path, "qa-http", uri, "465051f29874474ba7337f6b8d355687", steps=(10, 20))

    code, out, err = status(capsys, "qa-http", tmp_path)

    assert code == 0, out + err
    head = out.splitlines()[0]
    assert head.startswith("run qa-http: ") and f"MLflow at {uri} did not answer" in head, out
    assert "not in MLflow" not in out and "no MLflow run" not in out, out
    assert f"qa-http: MLflow did not answer, step {MAX_STEPS}/{MAX_STEPS} (last checkpoint)" in out, out
    assert f"storage: {layout.folder}" in out
    assert f"last checkpoint: {layout.folder}/{checkpoint_name(20)}" in out


def _hold_the_lock(layout: RunLayout) -> subprocess.Popen:
    """A launcher's stand-in: the project's own name_lock, taken in a process of its own, held until killed."""
    code = ("import sys, time\nfrom orchestrator.launch.name_lock import name_lock\n"
            "from orchestrator.storage.layout import RunLayout\n"
            f"with name_lock(RunLayout({layout.storage!r}, {layout.name!r})):\n"
            "    print('held', flush=True)\n    time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _sweep_in_mlflow(uri: str, trials: list[str]) -> str:
    """A sweep's parent run and one child per trial, all RUNNING, each trial at step 8: a launcher's MLflow runs
    as a SIGKILL leaves them (nobody ends them)."""
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("qa")
    parent = client.create_run(experiment, run_name="qa-swk2").info.run_id
    for trial in trials:
        child = client.create_run(experiment, run_name=f"{trial} lr", tags={PARENT_TAG: parent, TRIAL_TAG: trial})
        client.log_metric(child.info.run_id, "train/loss", 2.5, step=8)
        client.log_metric(child.info.run_id, "val/ppl", 12.0, step=8)
    return parent


def test_a_sweep_whose_launcher_was_killed_is_stopped_not_running_and_says_how_to_resume(tmp_path, capsys):
    """QA finding 11: after a SIGKILL of the launcher, MLflow still says RUNNING (nobody ended the runs) and
    status counted "2 running". Its lock, left behind, names a process that is gone."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trials = ["3fcee_00000", "3fcee_00001"]
    storage = tmp_path / "runs"
    layout = RunLayout(str(storage), "qa-swk2")
    raw = {"name": "qa-swk2", **TINY, "optim": {"max_steps": MAX_STEPS, "lr": {"grid": [1e-3, 3e-3]}},
           "tracking": {"uri": uri}}
    layout.write_meta({"kind": "sweep", "name": "qa-swk2", "raw": raw, "parent_run_id": _sweep_in_mlflow(uri, trials)})
    for trial in trials:
        Path(layout.trial_folder(trial), checkpoint_name(8)).mkdir(parents=True)
    holder = _hold_the_lock(layout)
    try:
        code, out, err = status(capsys, "qa-swk2", storage)
        assert code == 0, out + err
        assert f"launcher live: pid {holder.pid}" in out and "2 running" in out, out  # alive: running it is
        assert "orchestrator resume" not in out
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)

    code, out, err = status(capsys, "qa-swk2", storage)

    assert code == 0, out + err
    assert "stopped when its launcher died" in out.splitlines()[0], out
    assert "trials: 2: 0 finished, 0 running, 0 failed, 2 stopped or unknown, 0 not started" in out, out
    assert f"{trials[0]}: stopped when its launcher died (MLflow still says RUNNING), step 8/{MAX_STEPS}" in out
    assert f"`orchestrator resume qa-swk2 --storage-path {storage}`" in out.splitlines()[-1], out


def test_a_single_run_whose_launcher_was_killed_is_stopped(tmp_path, capsys):
    """The same for a run (QA's qa-kill): its one MLflow run says RUNNING, its lock's process is gone."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("qa"), run_name="qa-kill").info.run_id
    client.log_metric(run_id, "train/loss", 2.5, step=12)
    layout = stored_run(tmp_path, "qa-kill", uri, run_id, steps=(12,))
    holder = _hold_the_lock(layout)
    holder.kill()  # SIGKILL: the lock file stays, naming the dead pid
    holder.wait(timeout=30)  # reaped, as a shell reaps a killed launcher (a zombie's pid still answers kill 0)

    code, out, err = status(capsys, "qa-kill", tmp_path)

    assert code == 0, out + err
    assert out.startswith("run qa-kill: stopped when its launcher died (MLflow still says RUNNING)"), out
    assert f"qa-kill: stopped when its launcher died (MLflow still says RUNNING), step 12/{MAX_STEPS}" in out
    assert f"`orchestrator resume qa-kill --storage-path {tmp_path}`" in out, out


def test_an_s3_store_that_cannot_be_reached_is_one_line_naming_both_storage_flags(unreachable_s3, capsys):
    """QA finding 15: a raw OSError ("AWS Error NETWORK_CONNECTION", traceback in a file) that named neither flag
    (the endpoint: conftest's `unreachable_s3`)."""
    code, out, err = status(capsys, "qa-run", "s3://qa-nonexistent-bucket/runs", "--storage-endpoint", unreachable_s3)
    assert code == 2, out + err
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert "--storage-path s3://qa-nonexistent-bucket/runs" in err and unreachable_s3 in err, err
    assert "--storage-endpoint" in err and "Traceback" not in err and "traceback in" not in err, err


def test_a_local_storage_path_that_cannot_be_read_names_the_flag(tmp_path, capsys):
    """Not only s3://: a --storage-path that is a file, not a folder, is the same one line and exit 2."""
    (tmp_path / "a-file").write_text("")
    code, out, err = status(capsys, "qa-run", tmp_path / "a-file")
    assert code == 2 and "--storage-path" in err and len(err.strip().splitlines()) == 1, out + err
