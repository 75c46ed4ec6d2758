"""`orchestrator resume` of an s3:// run whose store the launcher cannot reach: one line naming the endpoint it
tried and how to give the right one (the endpoint is in the run's stored spec, which is in the store itself).
Fast tier: nothing listens on the port, so the S3 client fails at once; no traffic leaves 127.0.0.1."""

from __future__ import annotations

import socket

from orchestrator.cli import main
from orchestrator.storage import object_store


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_resume_of_an_unreachable_s3_store_names_the_endpoint_flag(monkeypatch, capsys):
    """The command's own entry point, in this process: the refusal is the whole of stderr and the exit code is 1
    (an exception would leave `main` and fail the test, as a traceback would have on the console).

    One attempt per S3 request (the product's knob, object_store.ATTEMPTS, as tests/test_s3_storage.py sets it):
    the default five back off for about 7 s before the closed port's refusal reaches the command, and the
    message is the same after one. No AWS endpoint variable of the caller's is seen; the flag sets one, which
    monkeypatch removes again afterwards, and the S3 filesystem cached for the closed port is dropped."""
    port = closed_port()
    for name in object_store.ENDPOINT_VARS:
        monkeypatch.setenv(name, "unset-below")  # recorded, so the flag's value is taken away after the test
        monkeypatch.delenv(name)
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(object_store, "ATTEMPTS", 1)
    try:
        code = main(["resume", "lost", "--storage-path", "s3://bucket/runs", "--storage-endpoint",
                     f"http://127.0.0.1:{port}"])
    finally:
        object_store._s3.cache_clear()  # built with one attempt and these credentials: no later test gets it
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert f"at the endpoint http://127.0.0.1:{port}" in err, err
    assert "--storage-endpoint URL (or AWS_ENDPOINT_URL_S3)" in err
    assert "Traceback" not in err
