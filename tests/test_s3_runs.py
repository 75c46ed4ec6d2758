"""s3:// storage as cloud clusters run it, with real processes: `python -m orchestrator ...` subprocesses whose
checkpoints, metadata, lock and metric spool live in a real S3 server (SeaweedFS on 127.0.0.1, tests/s3_server.py)
and whose MLflow server keeps its artifacts in the same store; killed, starved of tracking and of storage,
resumed; then every read-only command on the s3:// name. Credentials reach the processes as a user's do: the
standard AWS environment variables.

Lean by design (the real-process tier has a time budget): one sweep covers the lock, a tracking outage, a
driver kill and the resume, and every command after it; one run covers the storage outage and the
half-written checkpoint."""

from __future__ import annotations

import collections
import json
import re
import time

import pytest
from mlflow import MlflowClient

from tests.real_runs import (
    CHECKPOINT_EVERY,
    MlflowServer,
    assert_one_point_per_step,
    kill_tree,
    orchestrator,
    process_env,
    resumed_step,
    runs_of,
    wait_for,
    write_spec,
)

pytestmark = pytest.mark.slow


def _bucket_prefix(root: str) -> tuple[str, str]:
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    return bucket, prefix


def checkpoints_in_s3(server, run_folder: str) -> dict[int, set[str]]:
    """step -> the files of each checkpoint folder under the s3:// run folder."""
    bucket, prefix = _bucket_prefix(run_folder)
    found: dict[int, set[str]] = collections.defaultdict(set)
    for key in server.keys(bucket, prefix + "/"):
        name, _, file = key.removeprefix(prefix + "/").partition("/")
        if name.startswith("checkpoint_") and name.removeprefix("checkpoint_").isdigit() and file:
            found[int(name.removeprefix("checkpoint_"))].add(file)
    return found


def checkpointed(server, run_folder: str, step: int) -> bool:
    """A complete checkpoint of `step` or later is in the bucket."""
    return any(s >= step and "state.pt" in files for s, files in checkpoints_in_s3(server, run_folder).items())


def train_losses(uri: str, run_id: str) -> dict[int, float]:
    return {m.step: m.value for m in MlflowClient(uri).get_metric_history(run_id, "train/loss")}


@pytest.fixture
def s3_mlflow(s3, tmp_path):
    """An `mlflow server` whose artifacts go to the S3 store (--artifacts-destination s3://...), as cluster.yaml's
    head runs it: (S3 server, storage root, MLflow server, the environment every process gets)."""
    server, root = s3
    env = {**server.env, "MLFLOW_S3_ENDPOINT_URL": server.endpoint}
    mlflow = MlflowServer(tmp_path / "mlflow", artifacts=f"{root}/mlartifacts", env=env)
    mlflow.root.mkdir()
    mlflow.start()
    try:
        yield server, root, mlflow, process_env(**env)
    finally:
        mlflow.stop()


def test_sweep_on_s3_killed_during_a_tracking_outage_resumes_exactly_and_every_command_reads_it(tmp_path, s3_mlflow):
    """A 2-trial sweep (the same configuration twice, one trial at a time) with checkpoints in S3 and MLflow's
    artifacts in S3: while the second trial trains, a second launcher of the name is refused by the lock in the
    bucket; the MLflow server then dies, the second trial's points wait in its spool object in the bucket, and
    the launcher is SIGKILLed. `resume` sends the spool and finishes the trial from its checkpoint: one point per
    metric and step, and the same loss curve as the first, uninterrupted trial. Then status, evaluate and report
    read the sweep from S3 and MLflow; checkpoints tags and the exported model point into the bucket."""
    server, root, mlflow, env = s3_mlflow
    storage = f"{root}/runs"
    # Long enough that the second trial is still training when the outage has begun and its points are spooled:
    # with 32 steps, on a loaded machine, a slow stop of the MLflow server once let the trial finish first.
    steps = 48
    spec = write_spec(tmp_path, "s3-sweep", mlflow.uri, tune={"num_samples": 2, "max_concurrent": 1},
                      run={"storage_path": storage, "final_eval": True}, optim={"max_steps": steps})
    first = orchestrator(tmp_path, "sweep", str(spec), env=env, paced=True)
    bucket, prefix = _bucket_prefix(root)
    wait_for(lambda: server.keys(bucket, f"{prefix}/runs/s3-sweep/orchestrator.json"), 300, "the sweep's start", first)
    refused = orchestrator(tmp_path, "sweep", str(spec), env=env)
    assert refused.wait(120) == 1
    assert f"'s3-sweep' is in use by process {first.popen.pid}" in refused.output, refused.output[-2000:]

    def children(status: str | None = None) -> list:
        return [r for r in runs_of(mlflow.uri, "s3-sweep") if r.data.tags.get("orchestrator.role") == "trial"
                and (status is None or r.info.status == status)]

    def second_trial_logging():
        # One listing of the runs: with two, the first trial, seen RUNNING by the first and FINISHED by the
        # second, was once taken for the second trial (the outage then began before the second trial started).
        trials = children()
        finished = [r for r in trials if r.info.status == "FINISHED"]
        running = [r for r in trials if r.info.status == "RUNNING" and train_losses(mlflow.uri, r.info.run_id)]
        return len(finished) == 1 and running and running[0]

    second = wait_for(second_trial_logging, 480, "the second trial's first points", first)
    trial_folder = second.data.tags["orchestrator.checkpoints"]
    assert trial_folder.startswith(f"{storage}/s3-sweep/trials/train-"), trial_folder
    spool = f"{trial_folder}/mlflow-spool.jsonl"
    mlflow.stop()  # the tracking outage
    try:
        wait_for(lambda: checkpointed(server, trial_folder, 2 * CHECKPOINT_EVERY)
                 and server.keys(bucket, spool.removeprefix(f"s3://{bucket}/")), 300,
                 "a checkpoint and spooled points of the second trial", first)
        kill_tree(first)
    finally:
        mlflow.start()
    spooled = server.client().get_object(Bucket=bucket, Key=spool.removeprefix(f"s3://{bucket}/"))["Body"].read()
    assert spooled.strip(), "the spool object is empty"

    last = max(train_losses(mlflow.uri, second.info.run_id))  # what the server took before its outage
    resumed = orchestrator(tmp_path, "resume", "s3-sweep", "--storage-path", storage, env=env)
    assert resumed.wait(480) == 0, resumed.output[-4000:]
    assert "2 trials: 2 finished, 0 errored, 0 unfinished" in resumed.output, resumed.output[-4000:]
    assert resumed_step(resumed.output) >= 2 * CHECKPOINT_EVERY
    print(f"S3 sweep: server took steps up to {last}, spool held {len(spooled.splitlines())} points, "
          f"resumed from step {resumed_step(resumed.output)}")
    done = children("FINISHED")
    assert len(done) == 2 and not server.keys(bucket, spool.removeprefix(f"s3://{bucket}/"))
    for child in done:
        assert_one_point_per_step(mlflow.uri, child.info.run_id, last_step=steps)
        assert child.data.tags["orchestrator.checkpoints"].startswith(f"{storage}/s3-sweep/trials/")
    curves = [train_losses(mlflow.uri, child.info.run_id) for child in done]
    assert curves[0] == curves[1] and len(curves[0]) == steps  # killed and resumed == uninterrupted
    # The final evaluation's exported model: an MLflow artifact, stored by the server in the bucket.
    assert any(key.endswith("/artifacts/model/model.safetensors") for key in server.keys(bucket, f"{prefix}/mlartifacts/"))
    parent = next(r for r in runs_of(mlflow.uri, "s3-sweep") if r.data.tags.get("orchestrator.role") == "sweep")
    assert parent.info.status == "FINISHED"

    status = orchestrator(tmp_path, "status", "s3-sweep", "--storage-path", storage, env=env)
    assert status.wait(120) == 0, status.output
    assert re.search(rf"last checkpoint: {re.escape(storage)}/s3-sweep/trials/train-\S+/checkpoint_0+{steps}",
                     status.output) and "launcher none" in status.output, status.output
    evaluate = orchestrator(tmp_path, "evaluate", "s3-sweep", "--storage-path", storage, "--split", "validation",
                            "--checkpoint", "latest", env=env)
    assert evaluate.wait(300) == 0, evaluate.output[-3000:]
    assert evaluate.output.count(f"outputs in {storage}/s3-sweep/trials/") == 2, evaluate.output[-3000:]
    assert all(checkpointed(server, child.data.tags["orchestrator.checkpoints"], steps) for child in done)
    report = orchestrator(tmp_path, "report", "--tracking-uri", mlflow.uri, "--experiment", "s3-sweep",
                          "--out", str(tmp_path / "report"), env=env)
    assert report.wait(300) == 0, report.output[-3000:]
    assert any((tmp_path / "report").iterdir())


def test_s3_outage_mid_run_loses_no_registered_checkpoint_and_resume_skips_a_half_written_one(tmp_path, s3, server):
    """The S3 server stops after the run's second checkpoint, until the launcher gives up: the next checkpoint
    upload fails (after the S3 client's retries) and the run stops with one message naming the storage that did
    not answer and the resume command; every checkpoint Ray had registered is still in the bucket. The newest checkpoint,
    then cut in half in the bucket (an upload cut short), is skipped at `resume`, which finishes from the one
    before, with one point per metric and step."""
    s3_server, root = s3
    storage = f"{root}/runs"
    # No worker-group restarts: each would fail the same way until the store is back (a minute of retries).
    spec = write_spec(tmp_path, "s3-outage", server.uri, run={"storage_path": storage, "max_failures": 0})
    run_folder = f"{storage}/s3-outage"
    env = process_env(**s3_server.env)
    proc = orchestrator(tmp_path, "train", str(spec), env=env, paced=True)
    wait_for(lambda: checkpointed(s3_server, run_folder, 2 * CHECKPOINT_EVERY), 300, "the second checkpoint", proc)
    bucket, prefix = _bucket_prefix(run_folder)
    snapshot = json.loads(s3_server.client().get_object(
        Bucket=bucket, Key=f"{prefix}/checkpoint_manager_snapshot.json")["Body"].read())
    stopped = time.monotonic()
    s3_server.stop()
    try:  # down until the launcher gives up (about a minute of the S3 client's and Ray's retries)
        rc = proc.wait(300)
        down_s = time.monotonic() - stopped
    finally:
        s3_server.start()
    assert rc == 1, proc.output[-4000:]
    assert re.search(rf"the storage {re.escape(storage)} did not answer .*`orchestrator resume s3-outage "
                     rf"--storage-path {re.escape(storage)}`", proc.output), proc.output[-4000:]
    kept = checkpoints_in_s3(s3_server, run_folder)
    registered = re.findall(r"checkpoint_(\d+)", json.dumps(snapshot))
    assert registered and all("state.pt" in kept.get(int(step), set()) for step in registered), (registered, kept)
    print(f"S3 outage: the launcher stopped {down_s:.0f}s after the store, kept {sorted(kept)}")

    newest = max(step for step, files in kept.items() if "state.pt" in files)
    key = f"{prefix}/checkpoint_{newest:09d}/state.pt"
    state = s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=state[: len(state) // 2])
    resumed = orchestrator(tmp_path, "resume", "s3-outage", "--storage-path", storage, env=env)
    assert resumed.wait(420) == 0, resumed.output[-4000:]
    assert re.search(rf"checkpoint checkpoint_{newest:09d} \(.*\) is unreadable; resuming from the previous intact",
                     resumed.output), resumed.output[-4000:]
    assert resumed_step(resumed.output) < newest
    [run] = runs_of(server.uri, "s3-outage")
    assert run.info.status == "FINISHED"
    assert_one_point_per_step(server.uri, run.info.run_id)
