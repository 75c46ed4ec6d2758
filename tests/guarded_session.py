"""A test session to be killed (tests/test_process_guard.py runs it as a pytest of its own; the name keeps it out
of the suite's own collection): it starts what the real-process tier starts (a real `mlflow server`, SeaweedFS,
the session's local Ray, a launcher-like subprocess in a session of its own) and mounts a small tmpfs where it
may (as tests/test_full_disk.py does), writes their pids, the mount point and its session tag to
GUARDED_SESSION_OUT, and waits to be killed."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from tests import process_guard
from tests.process_guard import SESSION_ENV
from tests.real_runs import Proc, descendants


def test_start_everything_then_wait_to_be_killed(server, s3_server, ray_cluster, tmp_path):
    launcher = Proc([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"], cwd=tmp_path)
    while not launcher.lines:
        time.sleep(0.1)
    ray_processes = {f"{cmd.split()[0].rsplit('/', 1)[-1]} ({pid})": pid for pid, cmd in descendants(os.getpid())
                     if "raylet" in cmd or "gcs_server" in cmd}
    assert any(name.startswith("raylet") for name in ray_processes), ray_processes
    out = Path(os.environ["GUARDED_SESSION_OUT"])
    pids = {"mlflow server": server.proc.pid, "weed": s3_server.proc.pid, "launcher": launcher.popen.pid,
            **ray_processes}
    with contextlib.ExitStack() as stack:
        mounts = []
        try:  # a small filesystem, as tests/test_full_disk.py mounts (root only; elsewhere it is left out)
            mounts.append(str(stack.enter_context(process_guard.tmpfs(tmp_path / "small", "1m"))))
        except PermissionError:
            pass
        partial = out.with_suffix(".partial")
        partial.write_text(json.dumps({"tag": os.environ[SESSION_ENV], "pids": pids, "mounts": mounts}))
        partial.replace(out)
        time.sleep(600)
