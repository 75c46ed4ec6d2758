"""`orchestrator resume` of an s3:// run whose store the launcher cannot reach: one line naming the endpoint it
tried and how to give the right one (the endpoint is in the run's stored spec, which is in the store itself).
Fast tier: nothing listens on the port, so the S3 client fails in seconds; no traffic leaves 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_resume_of_an_unreachable_s3_store_names_the_endpoint_flag(tmp_path):
    port = closed_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    env.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_EC2_METADATA_DISABLED="true",
               PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "orchestrator", "resume", "lost", "--storage-path",
                           "s3://bucket/runs", "--storage-endpoint", f"http://127.0.0.1:{port}"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"at the endpoint http://127.0.0.1:{port}" in done.stderr, done.stderr
    assert "--storage-endpoint URL (or AWS_ENDPOINT_URL_S3)" in done.stderr
    assert "Traceback" not in done.stderr
