"""Faults that used to end a resumed run, through Ray Train on the session's local Ray (in-process launcher; the
kill-by-PID cases are in tests/test_faults.py).

- The newest checkpoint cut in half after Ray registered it: the resume falls back to the one before, trains
  through the unreadable checkpoint's step again and checkpoints it under a new name, so Ray's checkpoint manager
  never lists one folder twice (it used to delete the rewritten folder as the stale entry's and then fail the
  run at the next clean-up: "Path not found").
- A run that failed and was resumed to FINISHED loses its `orchestrator.failure` tag.
- A trial cut short: the sweep's summary takes the newest registered checkpoint's report when Tune's last result
  is older (`newest_report`).
- The last step's checkpoint written but never registered by Ray (a kill or a lost node before the controller's
  poll): the resume registers it again and the run finishes, where it used to stop at the registered step.

Real-process tier: each case is two short Ray Train runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from orchestrator.launch import LaunchError, resume, run_training
from orchestrator.launch.sweep import newest_report
from orchestrator.spec import validate_spec
from orchestrator.storage.layout import checkpoint_steps
from orchestrator.tracking.describe import FAILURE_TAG, NOTE_TAG
from orchestrator.training.checkpoint import read_checkpoint

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 2


def raw_spec(root: Path, name: str) -> dict:
    return {
        "name": name,
        "task": {"kind": "clm", "seq_len": 16, "batch_size": 4, "vocab_size": 120, "eval_batches": 2,
                 "builtin": {"train_sentences": 300, "eval_sentences": 30}},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16, "dropout": 0.1,
                  "attention": {"kind": "mha", "heads": 2}},
        "optim": {"lr": 3e-3, "max_steps": STEPS, "warmup_steps": 1, "seed": 7},
        "run": {"checkpoint_every": EVERY, "eval_every": EVERY, "log_every": 1, "keep_checkpoints": 2,
                "max_failures": 0, "storage_path": str(root / "runs")},
        "tracking": {"uri": f"sqlite:///{root / 'mlflow.db'}", "retries": 2, "timeout_s": 2},
    }


def test_a_truncated_registered_checkpoint_is_rewritten_under_a_new_name_and_the_failure_tag_goes(ray_cluster, tmp_path,
                                                                                               capfd):
    spec = validate_spec(raw_spec(tmp_path, "truncated"))
    with pytest.raises(LaunchError, match="orchestrator resume truncated"):
        run_training(spec, fail_at_step=7)  # checkpoints 2, 4, 6 registered (each report waits for its commit)
    folder = tmp_path / "runs" / "truncated"
    state = folder / "checkpoint_000000006" / "state.pt"
    assert "checkpoint_000000006" in (folder / "checkpoint_manager_snapshot.json").read_text()  # Ray holds it
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    client = MlflowClient(spec.tracking.uri)
    [failed] = client.search_runs([client.get_experiment_by_name("truncated").experiment_id])
    assert failed.info.status == "FAILED" and "injected failure" in failed.data.tags[FAILURE_TAG]

    capfd.readouterr()
    resumed = resume("truncated", str(tmp_path / "runs"))  # from 4: steps 5-12 again, checkpoints 6 ... 12
    assert resumed.metrics["step"] == STEPS
    # What the user reads (the Train worker's lines, relayed by Ray to the launcher's terminal): which checkpoint
    # was skipped and why, which one was taken, and the step the run went on from.
    said = capfd.readouterr().out
    assert re.search(r"checkpoint checkpoint_000000006 \(.*\) is unreadable; resuming from the previous intact "
                     r"checkpoint checkpoint_000000004 instead", said), said[-3000:]
    assert re.findall(r"resumed from step (\d+)", said) == ["4"], said[-3000:]
    names = checkpoint_steps(str(folder))
    assert "checkpoint_000000012" in names and len(names) == spec.run.keep_checkpoints, names
    for name in names:
        assert read_checkpoint(folder / name).step == names[name]
    finished = client.get_run(resumed.mlflow_run_id)
    assert resumed.mlflow_run_id == failed.info.run_id and finished.info.status == "FINISHED"
    # What a sweep's summary shows for a trial Tune last heard of at step 2 (its driver stopped by Ctrl-C before
    # it passed on the later reports): the report of the newest registered checkpoint, as in MLflow.
    newest = newest_report({"step": 2, "val/ppl": 999.0}, str(folder))
    history = client.get_metric_history(resumed.mlflow_run_id, "val/ppl")
    assert newest["step"] == STEPS and newest["val/ppl"] == max(history, key=lambda m: m.step).value
    assert newest_report({"step": STEPS + 1, "val/ppl": 1.0}, str(folder)) == {"step": STEPS + 1, "val/ppl": 1.0}
    # The failure is history: neither its tag nor its description stays on the finished run.
    assert FAILURE_TAG not in finished.data.tags
    assert not finished.data.tags.get(NOTE_TAG, "").startswith("**Failed:**")


def _forget_newest_checkpoint(folder: Path) -> str:
    """Ray Train's record of `folder`'s run without its newest checkpoint, whose files stay: as when the launcher
    or the node dies after the checkpoint's upload and before the controller's poll registered it."""
    path = folder / "checkpoint_manager_snapshot.json"
    snapshot = json.loads(path.read_text())
    kept = [(result, index) for result, index in zip(snapshot["checkpoint_results"],
                                                     snapshot["checkpoint_report_indices"], strict=True)]
    newest = max(kept, key=lambda pair: pair[0]["metrics"]["step"])
    kept.remove(newest)
    snapshot["checkpoint_results"] = [result for result, _ in kept]
    snapshot["checkpoint_report_indices"] = [index for _, index in kept]
    snapshot["latest_checkpoint_result"] = max(snapshot["checkpoint_results"], key=lambda r: r["metrics"]["step"])
    path.write_text(json.dumps(snapshot))
    return newest[0]["checkpoint_dir_name"]


def test_a_last_checkpoint_ray_had_not_registered_finishes_the_run_on_resume(ray_cluster, tmp_path, capfd):
    """The last step's checkpoint is in storage but Ray never registered it. The resume restores that step, has
    nothing left to train, and registers the checkpoint again; before, Ray's result stayed at the step before and
    every resume ended "stopped at step 10 of 12". MLflow keeps one point per metric and step."""
    spec = validate_spec(raw_spec(tmp_path, "unregistered"))
    with pytest.raises(LaunchError, match="orchestrator resume unregistered"):
        run_training(spec, fail_at_step=STEPS)  # after the last step's report: its checkpoint is written
    folder = tmp_path / "runs" / "unregistered"
    assert _forget_newest_checkpoint(folder) == "checkpoint_000000012"
    capfd.readouterr()
    resumed = resume("unregistered", str(tmp_path / "runs"))
    said = capfd.readouterr().out
    assert resumed.metrics["step"] == STEPS
    assert re.findall(r"resumed from step (\d+)", said) == [str(STEPS)], said[-3000:]
    assert f"step {STEPS}'s checkpoint had not been registered with Ray Train" in said, said[-3000:]
    client = MlflowClient(spec.tracking.uri)
    finished = client.get_run(resumed.mlflow_run_id)
    assert finished.info.status == "FINISHED"
    for key in ("val/ppl", "train/loss"):
        steps = [m.step for m in client.get_metric_history(resumed.mlflow_run_id, key)]
        assert sorted(steps) == sorted(set(steps)) and max(steps) == STEPS, (key, steps)
    # The same weights, evaluated again: the registered report's score is the logged one of that step.
    logged = max(client.get_metric_history(resumed.mlflow_run_id, "val/ppl"), key=lambda m: m.step)
    assert resumed.metrics["val/ppl"] == pytest.approx(logged.value, rel=1e-6)
    registered = json.loads((folder / "checkpoint_manager_snapshot.json").read_text())["latest_checkpoint_result"]
    assert registered["metrics"]["step"] == STEPS
    assert read_checkpoint(folder / registered["checkpoint_dir_name"]).step == STEPS
