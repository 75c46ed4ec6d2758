"""`orchestrator resume` of an s3:// run whose store the launcher cannot reach: one line naming the endpoint it
tried and how to give the right one (the endpoint is in the run's stored spec, which is in the store itself).
Fast tier: nothing listens on the port, so the S3 client fails at once; no traffic leaves 127.0.0.1."""

from __future__ import annotations

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
