"""A disk that fills up under a run, on a real small filesystem (a tmpfs the test mounts; root only, as on the
CI machine): the run's storage folder lives there, and once its first checkpoint is written the test takes the
rest of the space.

What must hold: the launcher fails with one line that names the error and where its whole text was kept (the
run folder cannot take it: the system's temporary folder does); no half-written file is left in the run folder
(no truncated `state.pt`, no `.error.txt.<pid>` or `.orchestrator.json.<pid>`); a `resume` while the disk is
still full says so in one line, without a traceback; and once space is freed, `resume` finishes the run from
its checkpoint. Real-process tier."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pytest

from orchestrator.training.checkpoint import read_checkpoint
from tests import process_guard
from tests.real_runs import CHECKPOINT_EVERY, checkpoint_on_disk, orchestrator, runs_of, wait_for, write_spec

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    with contextlib.ExitStack() as stack:
        try:  # unmounted at teardown, or by the session's guard if pytest is killed
            mount = stack.enter_context(process_guard.tmpfs(tmp_path / "small", "64m"))
        except PermissionError as err:
            pytest.skip(str(err))
        yield mount


def fill(disk: Path) -> Path:
    """Take every free byte of `disk` with one file (unbuffered writes, so nothing is left to flush)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_leaves_no_partial_file_and_a_resume_says_so_then_finishes(tmp_path, small_disk, server):
    spec = write_spec(tmp_path, "full", server.uri, run={"storage_path": str(small_disk / "runs")})
    run_folder = small_disk / "runs" / "full"
    proc = orchestrator(tmp_path, "train", str(spec), paced=True)
    wait_for(lambda: checkpoint_on_disk(run_folder, CHECKPOINT_EVERY), 300, "the first checkpoint", proc)
    filler = fill(small_disk)

    assert proc.wait(420) == 1, proc.output[-4000:]
    assert "No space left on device" in proc.output, proc.output[-4000:]
    kept = re.search(r"\(the whole error: (\S+)", proc.output)
    assert kept and Path(kept.group(1)).is_file() and "No space left" in Path(kept.group(1)).read_text(), \
        proc.output[-3000:]
    leftovers = [p.name for p in run_folder.rglob(".*") if re.search(r"\.\d+$", p.name)]
    assert leftovers == [], leftovers
    checkpoints = sorted(p for p in run_folder.glob("checkpoint_*") if p.is_dir())
    assert checkpoints, "the first checkpoint must have survived"
    for folder in checkpoints:  # none truncated: every folder left is a whole checkpoint
        assert read_checkpoint(folder).step == int(folder.name.split("_")[1].split("-")[0])

    still_full = orchestrator(tmp_path, "resume", "full", "--storage-path", str(small_disk / "runs"))
    assert still_full.wait(300) == 1, still_full.output[-4000:]
    assert "no space left on the device" in still_full.output and "free some space there" in still_full.output, \
        still_full.output[-3000:]
    assert "Traceback" not in still_full.output, still_full.output[-3000:]

    # Space again: the run resumes from its checkpoint (Ray's own checkpoint record, if the full disk cut it short,
    # is set aside rather than failing Ray's controller at start).
    filler.unlink()
    resumed = orchestrator(tmp_path, "resume", "full", "--storage-path", str(small_disk / "runs"))
    assert resumed.wait(420) == 0, resumed.output[-4000:]
    [run] = runs_of(server.uri, "full")
    assert run.info.status == "FINISHED"
