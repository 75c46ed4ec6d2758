"""Fault injection: a user's bad day, as real processes. Each case starts `python -m orchestrator ...` as a
subprocess (its own local Ray) logging to a real `mlflow server` on 127.0.0.1, then kills, interrupts or
starves it by PID, resumes, and checks what survived: a resume recomputes at most `checkpoint_every` steps and
MLflow holds exactly one point per metric per step.

Tiny causal LMs on the built-in corpus (tens of steps), so each case costs a few Ray starts."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from mlflow import MlflowClient


from tests.real_runs import (
    CHECKPOINT_EVERY,
    Proc,
    assert_one_point_per_step,
    checkpoint_on_disk,
    descendants,
    free_port,
    kill_tree,
    last_logged_step,
    orchestrator,
    points_per_step,
    resumed_step,
    runs_of,
    wait_for,
    write_spec,
)

pytestmark = pytest.mark.slow


def kill_after_checkpoint(proc: Proc, run_folder: Path, step: int, uri: str, experiment: str) -> int:
    """SIGKILL the launcher as soon as a checkpoint of `step` or later is complete on disk; the last step it logged."""
    wait_for(lambda: checkpoint_on_disk(run_folder, step), 300, f"checkpoint {step}", proc)
    kill_tree(proc)
    return last_logged_step(uri, experiment)


# --- the cases ------------------------------------------------------------------------------------------------


def test_driver_kill_resumes_from_the_newest_checkpoint(tmp_path, server):
    """SIGKILL of `orchestrator train` right after a checkpoint is on disk: `resume` takes over the dead
    launcher's lock, restarts from that checkpoint (registered by Ray, or found on disk), and the MLflow run
    ends FINISHED with one point per metric per step."""
    spec = write_spec(tmp_path, "driver-kill", server.uri)
    first = orchestrator(tmp_path, "train", str(spec), paced=True)
    last = kill_after_checkpoint(first, tmp_path / "runs" / "driver-kill", 2 * CHECKPOINT_EVERY, server.uri,
                                 "driver-kill")
    assert (tmp_path / "runs" / "driver-kill" / ".orchestrator.lock").exists()  # left behind by the kill

    resumed = orchestrator(tmp_path, "resume", "driver-kill", "--storage-path", str(tmp_path / "runs"))
    assert resumed.wait(420) == 0, resumed.output[-4000:]
    start = resumed_step(resumed.output)
    print(f"driver kill: last step logged {last}, resumed from {start}, recomputed {last - start}")
    assert start >= 2 * CHECKPOINT_EVERY and last - start <= CHECKPOINT_EVERY, (start, last)
    [run] = runs_of(server.uri, "driver-kill")
    assert run.info.status == "FINISHED"
    assert_one_point_per_step(server.uri, run.info.run_id)


def test_worker_kill_is_retried_by_ray_train_from_the_latest_checkpoint(tmp_path, server):
    """SIGKILL of the Ray Train worker process: with run.max_failures=1 Ray restarts the worker group from
    the latest checkpoint in the same launcher, and the run finishes with one point per metric per step."""
    spec = write_spec(tmp_path, "worker-kill", server.uri, run={"max_failures": 1})
    proc = orchestrator(tmp_path, "train", str(spec), paced=True)
    wait_for(lambda: checkpoint_on_disk(tmp_path / "runs" / "worker-kill", CHECKPOINT_EVERY), 300, "checkpoint", proc)
    workers = [pid for pid, cmd in descendants(proc.popen.pid) if cmd.startswith("ray::RayTrainWorker")]
    assert len(workers) == 1, descendants(proc.popen.pid)
    os.kill(workers[0], signal.SIGKILL)
    last = last_logged_step(server.uri, "worker-kill")
    assert proc.wait(420) == 0, proc.output[-4000:]
    start = resumed_step(proc.output)
    print(f"worker kill: last step logged {last}, restarted from {start}, recomputed {last - start}")
    assert last - start <= CHECKPOINT_EVERY, (start, last)
    [run] = runs_of(server.uri, "worker-kill")
    assert run.info.status == "FINISHED"
    assert_one_point_per_step(server.uri, run.info.run_id)


def test_ctrl_c_marks_the_run_killed_and_resume_finishes_it(tmp_path, server):
    """SIGINT (Ctrl-C) to `orchestrator train`: a non-zero exit that says the run stopped (not "finished"),
    the MLflow run KILLED, and `resume` continues it to the end.

    Before the first checkpoint (as two launches a few seconds apart: only the lock tells them apart), a
    second `train` and a `resume` of the same name are refused at once, naming the live process; the run
    goes on alone (one MLflow run at the end)."""
    # 40 steps: room for the two refused launches (started together) before the first run's checkpoint and end.
    spec = write_spec(tmp_path, "ctrl-c", server.uri, optim={"max_steps": 40})
    proc = orchestrator(tmp_path, "train", str(spec), paced=True)
    wait_for(lambda: (tmp_path / "runs" / "ctrl-c" / "orchestrator.json").exists(), 300, "the run's start", proc)
    refused = [orchestrator(tmp_path, *args)
               for args in (["train", str(spec)], ["resume", "ctrl-c", "--storage-path", str(tmp_path / "runs")])]
    for second in refused:
        assert second.wait(120) == 1
        assert f"'ctrl-c' is in use by process {proc.popen.pid}" in second.output, second.output[-2000:]

    wait_for(lambda: checkpoint_on_disk(tmp_path / "runs" / "ctrl-c", CHECKPOINT_EVERY), 300, "checkpoint", proc)
    os.kill(proc.popen.pid, signal.SIGINT)
    rc = proc.wait(120)
    assert rc != 0 and "finished:" not in proc.output, proc.output[-3000:]
    [run] = runs_of(server.uri, "ctrl-c")
    assert run.info.status == "KILLED"
    last = last_logged_step(server.uri, "ctrl-c")

    resumed = orchestrator(tmp_path, "resume", "ctrl-c", "--storage-path", str(tmp_path / "runs"))
    assert resumed.wait(420) == 0, resumed.output[-4000:]
    print(f"ctrl-c: last step logged {last}, resumed from {resumed_step(resumed.output)}")
    assert last - resumed_step(resumed.output) <= CHECKPOINT_EVERY
    [run] = runs_of(server.uri, "ctrl-c")
    assert run.info.status == "FINISHED"
    assert_one_point_per_step(server.uri, run.info.run_id, last_step=40)


def test_failed_first_start_leaves_the_name_free_and_its_run_failed(tmp_path, server):
    """A run that dies before its first checkpoint (NaN at once): the message does not advise `resume`,
    its MLflow run is FAILED, `resume` is refused, and `train` with the same name starts a new run."""
    # Ray Train's default retries (run.max_failures 2): the first ends at once (the run folder says it diverged),
    # without an error, so there is no second.
    spec = write_spec(tmp_path, "first-start", server.uri, optim={"lr": 1e4, "grad_clip": None},
                      run={"checkpoint_every": 100, "eval_every": 100})
    proc = orchestrator(tmp_path, "train", str(spec))
    assert proc.wait(300) == 1
    assert re.search(r"loss is (nan|inf) at step \d+", proc.output) and "name is free" in proc.output, proc.output[-3000:]
    # One line, no traceback (the whole error is in the run folder), no resume advice.
    assert not re.search(r'File "[^"]*/orchestrator/', proc.output), proc.output[-3000:]
    assert "Error in training function" not in proc.output, proc.output[-3000:]
    assert "orchestrator resume" not in proc.output
    [failed] = runs_of(server.uri, "first-start")
    assert failed.info.status == "FAILED"

    refused = orchestrator(tmp_path, "resume", "first-start", "--storage-path", str(tmp_path / "runs"))
    assert refused.wait(120) == 1 and "nothing to resume" in refused.output, refused.output[-2000:]
    again = orchestrator(tmp_path, "train", str(spec), "optim.lr=3e-3", "optim.max_steps=4",
                         "run.checkpoint_every=4", "run.eval_every=4")
    assert again.wait(420) == 0, again.output[-4000:]
    runs = {r.info.run_id: r.info.status for r in runs_of(server.uri, "first-start")}
    assert runs == {failed.info.run_id: "FAILED", next(r for r in runs if r != failed.info.run_id): "FINISHED"}


def test_tracking_outage_ending_after_the_run_loses_no_point(tmp_path, server):
    """The MLflow server dies mid-run and comes back only after the run ended, final evaluation included: the
    points wait in the run folder's spool, the test scores and the exported model in its storage folder (the run
    stays open, the launcher says so), and `resume` sends them and ends the run; a second `resume` sends nothing
    twice. The session's server is stopped and started again on its port (its store kept), as an operator would."""
    spec = write_spec(tmp_path, "outage", server.uri, run={"final_eval": True})
    proc = orchestrator(tmp_path, "train", str(spec), paced=True)
    try:
        wait_for(lambda: last_logged_step(server.uri, "outage") >= 2, 300, "the first points", proc)
        server.stop()
        # Trained to the end, not finished in MLflow: exit 3 and a line that says what waits, not "finished".
        assert proc.wait(420) == 3, proc.output[-4000:]
    finally:
        if server.proc is None:
            server.start()  # the next cases need it, whatever happened here
    printed = dict(re.findall(r"(test/\w+) ([\d.e+-]+)", proc.output))
    assert {"test/loss", "test/ppl", "test/word_ppl"} <= set(printed), proc.output[-3000:]
    assert "did not take every output" in proc.output, proc.output[-3000:]
    assert "run outage trained to its end" in proc.output and "is not finished in MLflow" in proc.output
    assert "run outage finished" not in proc.output, proc.output[-3000:]
    assert (tmp_path / "runs" / "outage" / "mlflow-spool.jsonl").is_file()
    [run] = runs_of(server.uri, "outage")
    assert run.info.status == "RUNNING"
    for attempt in (1, 2):
        resumed = orchestrator(tmp_path, "resume", "outage", "--storage-path", str(tmp_path / "runs"))
        assert resumed.wait(300) == 0, f"resume {attempt}: {resumed.output[-4000:]}"
        # Ray's advice to a new run that lands in an old folder is not for a launcher reading its own run.
        assert "delete the existing folder" not in resumed.output, resumed.output[-3000:]
    [run] = runs_of(server.uri, "outage")
    assert run.info.status == "FINISHED"
    assert_one_point_per_step(server.uri, run.info.run_id)
    for key, value in printed.items():  # the scores the console printed, once each (at the scored step)
        assert sum(points_per_step(server.uri, run.info.run_id, key).values()) == 1, key
        assert f"{run.data.metrics[key]:.4g}" == value, key
    names = {a.path for a in MlflowClient(server.uri).list_artifacts(run.info.run_id)}
    assert {"model", "task", "spec.yaml"} <= names, names
    assert not (tmp_path / "runs" / "outage" / "mlflow-spool.jsonl").exists()


def test_sweep_trial_that_trained_during_a_whole_outage_gets_its_run_and_every_point_at_resume(tmp_path, server):
    """A 2-trial sweep (the same configuration twice, one at a time) whose MLflow server dies at the first
    trial's last step and is back only after the sweep: the second trial trains with no MLflow run at all (the
    launcher says so and where its points wait); `resume` creates its child run, sends its spooled points, test
    scores and model, and ends it FINISHED with the same loss curve as the first trial, one point per step."""
    steps = 2 * CHECKPOINT_EVERY
    spec = write_spec(tmp_path, "late-trial", server.uri, tune={"num_samples": 2, "max_concurrent": 1},
                      run={"final_eval": True}, optim={"max_steps": steps})

    def children() -> list:
        return [r for r in runs_of(server.uri, "late-trial") if r.data.tags.get("orchestrator.role") == "trial"]

    def first_trial_at_its_last_step() -> bool:
        # One listing, the first trial still RUNNING in it: the second cannot start before the first ends, and
        # the first still has its final evaluation to run, seconds, before it does.
        trials = children()
        return len(trials) == 1 and trials[0].info.status == "RUNNING" and max(
            points_per_step(server.uri, trials[0].info.run_id, "train/loss"), default=0) == steps

    first = orchestrator(tmp_path, "sweep", str(spec), paced=True)
    try:
        wait_for(first_trial_at_its_last_step, 400, "the first trial's last step", first)
        server.stop()
        assert first.wait(420) == 0, first.output[-4000:]
    finally:
        if server.proc is None:
            server.start()
    assert "2 trials: 2 finished" in first.output, first.output[-4000:]
    assert re.search(r"did not answer, so the run has no MLflow run yet; its metric points wait in \S+"
                     r"mlflow-spool\.jsonl", first.output), first.output[-4000:]
    assert len(children()) == 1  # the second trial's run does not exist yet

    resumed = orchestrator(tmp_path, "resume", "late-trial", "--storage-path", str(tmp_path / "runs"))
    assert resumed.wait(300) == 0, resumed.output[-4000:]
    assert "2 trials: 2 finished, 0 errored, 0 unfinished" in resumed.output, resumed.output[-4000:]
    trials = children()
    assert len(trials) == 2 and all(t.info.status == "FINISHED" for t in trials), [t.info.status for t in trials]
    for trial in trials:
        assert_one_point_per_step(server.uri, trial.info.run_id, last_step=steps)
        assert {"test/loss", "test/ppl"} <= set(trial.data.metrics), trial.data.metrics
        assert trial.data.params["model.d_model"] == "16"  # the launcher's handle
        assert int(trial.data.params["params.attention"]) > 0 and "device.name" in trial.data.tags  # the worker's
        assert "model" in {a.path for a in MlflowClient(server.uri).list_artifacts(trial.info.run_id)}
    curves = [{m.step: m.value for m in MlflowClient(server.uri).get_metric_history(t.info.run_id, "train/loss")}
              for t in trials]
    assert curves[0] == curves[1]
    [parent] = [r for r in runs_of(server.uri, "late-trial") if r.data.tags.get("orchestrator.role") == "sweep"]
    assert parent.info.status == "FINISHED"
    assert not list((tmp_path / "runs" / "late-trial").rglob("mlflow-spool.jsonl"))


def test_two_launchers_side_by_side_finish_with_clean_consoles(tmp_path, server):
    """Two `orchestrator train` started at once on one machine, each with its own local Ray: both finish, and
    neither console shows a traceback (Ray Train's PlacementGroupCleaner, asking the state API without an
    address, died on "Found multiple active Ray instances" before each local Ray's processes knew their own; a
    local Ray's runs no longer start it, and any Ray code that looks its cluster up that way still finds its own).
    Each console is a run's own without --verbose: one line per report (evaluations at steps 4 and 8), none of Ray
    Train's report log or of its workers' prefixed lines (--verbose brings them back: tests/test_user_view.py)."""
    specs = [write_spec(tmp_path, name, server.uri, optim={"max_steps": 8}) for name in ("left", "right")]
    procs = [orchestrator(tmp_path, "train", str(spec)) for spec in specs]
    for proc in procs:
        assert proc.wait(420) == 0, proc.output[-4000:]
    for name, proc in zip(("left", "right"), procs, strict=True):
        assert "Traceback" not in proc.output and "multiple active Ray instances" not in proc.output, \
            proc.output[-4000:]
        reports = re.findall(rf"^\[{name}\] step (\d+)/8 \| train/loss [\d.]+ \| val/ppl [\d.]+$", proc.output, re.M)
        assert reports == ["4", "8"], proc.output[-4000:]
        assert "TrainingReport(" not in proc.output and "(RayTrainWorker" not in proc.output, proc.output[-4000:]
    assert {r.info.status for name in ("left", "right") for r in runs_of(server.uri, name)} == {"FINISHED"}


def test_wrong_tracking_uri_is_refused_before_ray_starts(tmp_path):
    """Nothing listens at tracking.uri: refused before Ray starts, naming the field and both fixes; no Ray run."""
    spec = write_spec(tmp_path, "wrong-uri", f"http://127.0.0.1:{free_port()}")
    proc = orchestrator(tmp_path, "train", str(spec))
    assert proc.wait(120) == 1
    assert "tracking.uri=" in proc.output and "tracking.offline_ok=true" in proc.output, proc.output[-2000:]
    assert "Started a local Ray instance" not in proc.output
    assert "training continues" not in proc.output, proc.output[-2000:]  # it does not: it is refused
    assert not (tmp_path / "runs" / "wrong-uri" / "orchestrator.json").exists()


def test_host_outside_allowed_hosts_is_named_with_the_server_flag(tmp_path, server):
    """MLflow 3 answers 403 to a Host header outside its --allowed-hosts: the launcher says which flag to add."""
    spec = write_spec(tmp_path, "host-refused", server.uri.replace("127.0.0.1", "localhost"))
    proc = orchestrator(tmp_path, "train", str(spec))
    assert proc.wait(120) == 1
    assert f"--allowed-hosts localhost:{server.port}" in proc.output and "tracking.uri=" in proc.output, \
        proc.output[-2000:]
    assert not (tmp_path / "runs" / "host-refused" / "orchestrator.json").exists()


def test_sweep_driver_kill_with_a_nan_trial_resumes_without_hanging(tmp_path, server):
    """A 2-trial sweep whose first trial diverges (NaN: an errored trial, the sweep goes on) is SIGKILLed
    while the second trains; `resume` re-admits both trials on 2 CPUs without starving their Train workers,
    the NaN trial errors again with its reason, the other finishes from its checkpoint with its ASHA clock
    (evaluations) continuing, and the summary counts 1 finished, 1 errored, exit 1, parent FAILED; a second
    resume says the same and trains nothing."""
    # No retries: the NaN trial would fail again on each (run.max_failures 2 x tune.max_failures 1 by default).
    spec = write_spec(tmp_path, "sweep-kill", server.uri, optim={"lr": {"grid": [1e4, 3e-3]}, "warmup_steps": 3,
                                                                  "grad_clip": None},
                      run={"max_failures": 0}, tune={"max_failures": 0})
    first = orchestrator(tmp_path, "sweep", str(spec), paced=True)
    trials = tmp_path / "runs" / "sweep-kill" / "trials"

    def second_trial_checkpointed() -> bool:
        return any(checkpoint_on_disk(t, 2 * CHECKPOINT_EVERY) for t in trials.glob("train-*"))

    wait_for(second_trial_checkpointed, 400, "the healthy trial's checkpoint", first)
    kill_tree(first)

    resumed = orchestrator(tmp_path, "resume", "sweep-kill", "--storage-path", str(tmp_path / "runs"))
    assert resumed.wait(480) == 1, resumed.output[-4000:]
    assert "2 trials: 1 finished, 1 errored, 0 unfinished" in resumed.output, resumed.output[-4000:]
    # ASHA's clock went on from the checkpoint: all 6 evaluations of 24 steps, not only those after the resume.
    assert re.search(r"\(done, 6 evals\) .*optim.lr=0.003", resumed.output), resumed.output[-3000:]
    # A second resume changes nothing: the same summary and exit code, nothing trained, no status flipped.
    again = orchestrator(tmp_path, "resume", "sweep-kill", "--storage-path", str(tmp_path / "runs"))
    assert again.wait(480) == 1, again.output[-4000:]
    assert "2 trials: 1 finished, 1 errored, 0 unfinished" in again.output, again.output[-4000:]
    assert "resumed from step" not in again.output, again.output[-3000:]
    runs = runs_of(server.uri, "sweep-kill")
    parent = next(r for r in runs if r.data.tags.get("orchestrator.role") == "sweep")
    children = {r.data.params["optim.lr"]: r for r in runs if r.data.tags.get("orchestrator.role") == "trial"}
    assert parent.info.status == "FAILED"
    assert children["10000.0"].info.status == "FAILED" and children["0.003"].info.status == "FINISHED"
    # The NaN trial's MLflow run says why it failed, and what to change.
    nan_reason = children["10000.0"].data.tags["orchestrator.failure"]
    assert re.search(r"loss is (nan|inf) at step", nan_reason) and "optim.lr" in nan_reason, nan_reason
    assert nan_reason in children["10000.0"].data.tags["mlflow.note.content"]
    assert_one_point_per_step(server.uri, children["0.003"].info.run_id)
    assert "loss is nan at step" in resumed.output or "loss is inf at step" in resumed.output
    # No traceback of the project's code (a diverged trial is one line). Ray's SIGTERM of its workers at shutdown
    # may still print Ray's own frames from a process that is not ours (ours drop it: quiet_exit_in_finalizers).
    assert not re.search(r'File "[^"]*/orchestrator/', resumed.output), resumed.output[-3000:]
    assert "orchestrator resume" not in resumed.output, resumed.output[-3000:]  # it would diverge again
    assert "1 errored trial(s) diverged (NaN or inf loss)" in resumed.output and "lower optim.lr" in resumed.output


def test_sweep_driver_kill_after_a_trial_finished_resumes_to_all_finished(tmp_path, server):
    """A 2-trial sweep (one trial at a time) SIGKILLed as soon as the first trial is FINISHED in MLflow (before
    Tune saw it end; the second cannot have finished: it has all its steps to train): each `resume` counts the
    first finished from its run folder, does not train or reopen it, finishes the second, and says "2 finished",
    exit 0; the parent and both children FINISHED, one point per metric per step. (Three trials, two at a time,
    checked the same with one more trial to train.)"""
    steps = 2 * CHECKPOINT_EVERY
    spec = write_spec(tmp_path, "sweep-done", server.uri, optim={"lr": {"grid": [3e-3, 1e-3]}, "max_steps": steps},
                      tune={"max_concurrent": 1})
    first = orchestrator(tmp_path, "sweep", str(spec), paced=True)

    def finished_children() -> list:
        return [r for r in runs_of(server.uri, "sweep-done")
                if r.data.tags.get("orchestrator.role") == "trial" and r.info.status == "FINISHED"]

    wait_for(lambda: len(finished_children()) >= 1, 400, "a finished trial", first)
    kill_tree(first)
    done_before = {r.info.run_id: r.info.end_time for r in finished_children()}
    assert len(done_before) == 1, done_before

    for attempt in (1, 2):
        resumed = orchestrator(tmp_path, "resume", "sweep-done", "--storage-path", str(tmp_path / "runs"))
        assert resumed.wait(420) == 0, f"resume {attempt}: {resumed.output[-4000:]}"
        assert "2 trials: 2 finished, 0 errored, 0 unfinished" in resumed.output, resumed.output[-4000:]
    runs = runs_of(server.uri, "sweep-done")
    [parent] = [r for r in runs if r.data.tags.get("orchestrator.role") == "sweep"]
    children = [r for r in runs if r.data.tags.get("orchestrator.role") == "trial"]
    assert parent.info.status == "FINISHED" and len(children) == 2
    for child in children:
        assert child.info.status == "FINISHED", child.data.tags.get("ray.trial_id")
        assert_one_point_per_step(server.uri, child.info.run_id, last_step=steps)
        if child.info.run_id in done_before:  # neither reopened nor ended again
            assert child.info.end_time == done_before[child.info.run_id]
    assert set(done_before) < {c.info.run_id for c in children}


def test_missing_or_empty_data_file_is_named_before_ray_starts(tmp_path):
    """A data file that is missing, or empty, fails `validate` (and train) at once, naming the field."""
    empty = tmp_path / "train.txt"
    empty.write_text("")
    for path, message in ((tmp_path / "absent.txt", "does not exist"), (empty, "is empty (0 bytes)")):
        spec = write_spec(tmp_path, "data", "sqlite:///" + str(tmp_path / "m.db"),
                          task={"dataset": "files", "files": {"train": str(path), "validation": str(path)}})
        proc = orchestrator(tmp_path, "validate", str(spec))
        assert proc.wait(60) == 2
        assert f"task.files.train: {path}" in proc.output and message in proc.output, proc.output
