"""`orchestrator resume` of an s3:// run whose store the launcher cannot reach: one line naming the endpoint it
tried and how to give the right one (the endpoint is in the run's stored spec, which is in the store itself).
Fast tier: nothing listens on the port, so the S3 client fails at once; no traffic leaves 127.0.0.1."""

from __future__ import annotations

import os

from orchestrator.cli import main


def test_resume_of_an_unreachable_s3_store_names_the_endpoint_flag(unreachable_s3, capsys):
    """The command's own entry point, in this process: the refusal is the whole of stderr and the exit code is 1
    (an exception would leave `main` and fail the test, as a traceback would have on the console).

    The endpoint and one attempt per S3 request: conftest's `unreachable_s3` (the default five attempts back off
    for about 7 s before the closed port's refusal reaches the command, and the message is the same after one)."""
    code = main(["resume", "lost", "--storage-path", "s3://bucket/runs", "--storage-endpoint", unreachable_s3])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert f"at the endpoint {unreachable_s3}" in err, err
    assert "--storage-endpoint URL (or AWS_ENDPOINT_URL_S3)" in err
    assert "Traceback" not in err


def test_a_name_the_storage_does_not_hold_exits_as_a_wrong_argument_not_as_a_failed_run(tmp_path, capsys):
    """Exit 1 is a run or trial that failed (docs/orchestrator.md); a misspelt NAME is a wrong argument: 2."""
    for command in ("status", "resume", "evaluate"):
        assert main([command, "no-such-run", "--storage-path", str(tmp_path)]) == 2, command
        err = capsys.readouterr().err
        assert "nothing named 'no-such-run'" in err and "check the name and --storage-path" in err, err


def test_resume_of_a_finished_run_says_sent_only_of_what_was_waiting(tmp_path, monkeypatch, capsys):
    """`orchestrator resume` of a run that had finished said its "spooled metrics and outputs are sent" when its
    launcher had sent them all and nothing was spooled. It names what was waiting, or says nothing was.
    (run.py `_close_finished`; Ray's stored result is stood in for: the slow tier resumes real runs.)"""
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from orchestrator.launch import run as run_module
    from orchestrator.spec import validate_spec
    from orchestrator.storage.layout import RunLayout, evaluation_record
    from orchestrator.storage.locations import write_json
    from orchestrator.tracking.write import MlflowTracker, open_tracker
    from tests.test_deliver import down_uri

    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.setenv(name, os.environ.get(name, "5"))  # the tracker sets them: restored after the test
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = validate_spec({"name": "done", "task": {"kind": "clm"}, "run": {"storage_path": str(tmp_path / "runs")},
                          "tracking": {"uri": uri}})
    layout = RunLayout(spec.run.storage_path, spec.name)
    client = MlflowClient(uri)
    handle = SimpleNamespace(run_id=client.create_run(client.create_experiment("done")).info.run_id)
    monkeypatch.setattr(run_module, "stored_result",
                        lambda folder: SimpleNamespace(metrics={"step": 4}, checkpoint=None, filesystem=None))

    def close() -> str:
        run_module._close_finished(spec, open_tracker(spec.tracking, layout.spool), handle)
        return capsys.readouterr().out

    assert "had finished training; nothing was waiting to be sent, and its MLflow run is ended" in close()
    down = MlflowTracker(down_uri(), retries=1, timeout_s=1, spool=layout.spool)  # the server away at the end
    down.log_metrics(handle.run_id, {"train/loss": 1.5}, step=4)
    down.flush(handle.run_id, force=True)
    assert "had finished training; its spooled metrics are sent, and its MLflow run is ended" in close()
    assert [m.step for m in client.get_metric_history(handle.run_id, "train/loss")] == [4]
    write_json(evaluation_record(f"{layout.folder}/evaluation", "test"),
               {"split": "test", "step": 4, "metrics": {"test/loss": 1.0}, "tags": {}})
    assert "had finished training; its outputs are sent, and its MLflow run is ended" in close()
    assert "nothing was waiting to be sent" in close()
