"""s3:// storage against a real S3 server (SeaweedFS on 127.0.0.1, tests/s3_server.py), without Ray: the
launcher's files through the layout, the preflight of the bucket, the leased name lock, the durable metric
spool, and `model.init_from` from a run stored in the bucket. The runs themselves (Ray Train and Tune on S3,
kills, outages) are in tests/test_s3_runs.py."""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.fs
import pytest

from orchestrator.launch.name_lock import S3Lease, name_lock
from orchestrator.launch.preflight import LaunchError, check_storage
from orchestrator.spec import SpecError, validate_spec
from orchestrator.storage.layout import (
    RunLayout,
    checkpoint_name,
    checkpoint_steps,
    diverged,
    finished,
    latest_checkpoint,
    mark_diverged,
    mark_finished,
)
from orchestrator.storage.locations import join, read_text, storage_fs, write_text

SPEC = {"name": "unit", "task": {"kind": "clm", "seq_len": 16, "batch_size": 4, "vocab_size": 120,
                                 "builtin": {"train_sentences": 50, "eval_sentences": 10}}}


def _spec(storage: str, **run):
    return validate_spec({**SPEC, "run": {"storage_path": storage, **run}})


def _dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_layout_reads_and_writes_a_run_in_the_bucket(s3):
    """Metadata, markers, checkpoints listing, the lock holder and clear() work on s3:// as on a local folder."""
    server, root = s3
    layout = RunLayout(join(root, "runs"), "unit")
    assert layout.read_meta() is None and not layout.has_checkpoint() and diverged(layout.folder) is None
    layout.write_meta({"kind": "run", "name": "unit"})
    assert layout.read_meta() == {"kind": "run", "name": "unit"}
    for step in (4, 12):
        write_text(join(layout.folder, checkpoint_name(step), "state.pt"), "x")
    assert checkpoint_steps(layout.folder) == {checkpoint_name(4): 4, checkpoint_name(12): 12}
    assert latest_checkpoint(layout.folder) == f"{root}/runs/unit/{checkpoint_name(12)}" and layout.has_checkpoint()
    mark_diverged(layout.folder, "loss is nan at step 3")
    mark_finished(layout.trial_folder("a"), {"val/loss": 1.5, "config": {"not": "scalar"}})
    assert diverged(layout.folder) == "loss is nan at step 3"
    assert finished(layout.trial_folder("a")) == {"val/loss": 1.5}
    write_text(layout.lock_location, json.dumps({"pid": 1}))
    layout.clear()
    prefix = root.removeprefix("s3://")
    bucket, top = prefix.split("/")
    # everything but the lock (pyarrow keeps the emptied folder as a marker object, "runs/unit/")
    assert [k for k in server.keys(bucket, f"{top}/runs/unit/") if not k.endswith("/")] == \
        [f"{top}/runs/unit/.orchestrator.lock"]
    fs, path = storage_fs(layout.folder)
    assert isinstance(fs, pyarrow.fs.S3FileSystem) and path == f"{prefix}/runs/unit"


def test_preflight_checks_the_bucket_answers_and_takes_writes_naming_field_and_fix(s3, monkeypatch):
    server, root = s3
    check_storage(_spec(join(root, "runs")))  # answers, writable, honours If-None-Match
    bucket, top = root.removeprefix("s3://").split("/")
    assert server.keys(bucket, top) == []  # the probe is gone
    with pytest.raises(SpecError, match=r"run.storage_path='s3://no-such-bucket-x/runs'.*create the bucket"):
        check_storage(_spec("s3://no-such-bucket-x/runs"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(SpecError, match=r"run.storage_path=.*AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"):
        check_storage(_spec(join(root, "runs")))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setattr("orchestrator.storage.object_store.ATTEMPTS", 1)
    with pytest.raises(SpecError, match=rf"endpoint {nowhere}.*run.storage_endpoint"):
        check_storage(_spec(join(root, "runs"), storage_endpoint=nowhere))  # the spec's endpoint wins


def test_credentials_and_options_never_enter_the_spec():
    """A URI with credentials or options would be logged as an MLflow param: refused, naming the fix."""
    for uri in ("s3://KEY:SECRET@bucket/runs", "s3://bucket/runs?endpoint_override=host:9000"):
        with pytest.raises(SpecError, match="AWS_ACCESS_KEY_ID.*run.storage_endpoint"):
            _spec(uri)
    with pytest.raises(SpecError, match="run.storage_endpoint is set but run.storage_path"):
        _spec("/tmp/runs", storage_endpoint="http://127.0.0.1:9000")
    with pytest.raises(SpecError, match="must be the store's URL"):
        _spec("s3://bucket/runs", storage_endpoint="127.0.0.1:9000")


def test_the_name_lock_on_s3_refuses_a_second_launcher_and_takes_over_a_dead_or_expired_one(s3):
    """Conditional writes: a live holder is named; a holder of this host whose process is gone, or whose lease
    ran out, is taken over; a holder that lost its lease says so on its next renewal and does not delete the
    new holder's lock; giving the lock back deletes it."""
    server, root = s3
    layout = RunLayout(join(root, "runs"), "unit")
    with name_lock(layout):
        holder = layout.lock_holder()
        assert holder["pid"] == os.getpid() and holder["lease_s"] == 300
        with pytest.raises(LaunchError, match=rf"'unit' is in use by process {os.getpid()} on .*lease runs out"):
            S3Lease(layout).acquire()
    assert layout.lock_holder() is None  # given back

    first = S3Lease(layout, lease_s=300)
    first.acquire()
    first.me["pid"] = _dead_pid()  # as if its launcher had been SIGKILLed (the lock says so on its next write)
    assert first.renew()
    second = S3Lease(layout)
    second.acquire()  # taken over at once: same host, process gone
    assert layout.lock_holder()["owner"] == second.me["owner"]
    assert not first.renew() and first.lost  # the old holder learns it lost the lock...
    first.release()
    assert layout.lock_holder()["owner"] == second.me["owner"]  # ...and leaves the new holder's lock alone
    second.release()

    elsewhere = S3Lease(layout, lease_s=3)  # another machine's launcher, which then stops renewing
    elsewhere.me["host"] = "another-host"
    elsewhere.acquire()
    elsewhere._stop.set()
    with pytest.raises(LaunchError, match="in use by process .* on another-host"):
        S3Lease(layout).acquire()  # its lease still runs: no pid check across hosts
    assert _lease_ran_out(layout)
    third = S3Lease(layout)
    third.acquire()  # the lease ran out by the store's clock: taken over
    assert layout.lock_holder()["owner"] == third.me["owner"]
    third.release()
    assert layout.lock_holder() is None


def _lease_ran_out(layout: RunLayout) -> bool:
    """Wait (at most 10 s) until the store's clock says the holder's lease ran out."""
    import time

    probe = S3Lease(layout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = probe._read()
        if found is not None and found[2] > found[0]["lease_s"]:
            return True
        time.sleep(0.25)
    return False


def test_metric_spool_in_the_bucket_survives_killed_processes_and_each_point_is_sent_once(s3, tmp_path):
    """Two workers resumed one after the other during a tracking outage (neither can ask MLflow which steps the
    run holds), each killed: their points wait in the run's spool object in the bucket, the second attempt's
    recomputed steps beside the first's. The resumed launcher sends each (metric, step) once, the step the
    server already had not again, and deletes the spool; a second resume has nothing left to send."""
    from mlflow import MlflowClient

    from orchestrator.tracking.describe import run_handle
    from orchestrator.tracking.loggers import MlflowLogger
    from orchestrator.tracking.write import MlflowTracker, TrackingWarning

    server, root = s3
    layout = RunLayout(join(root, "runs"), "unit")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    handle = run_handle({}, "", experiment="spool", run_name="unit", role="run", kind="mha", commit="abc",
                        key=("orchestrator.run", layout.folder))
    live = MlflowTracker(uri, retries=1, timeout_s=1, spool=layout.spool)
    logger = MlflowLogger(live, lambda: live.ensure_run(handle))
    logger.log({"train/loss": 1.0, "val/loss": 11.0}, 1)
    run_id = logger.run_id
    assert read_text(layout.spool) is None  # the server took it: nothing spooled, nothing written

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for attempt, steps in ((1, (1, 2, 3)), (2, (1, 2, 3, 4))):  # each resumed from the step-0 checkpoint
        worker = MlflowTracker(dead_uri, retries=1, timeout_s=1, spool=layout.spool)
        with pytest.warns(TrackingWarning):
            resumed = MlflowLogger(worker, lambda: run_id)
            for step in steps:
                resumed.log({"train/loss": float(10 * attempt + step), "val/loss": 10.0 + step}, step)
        del worker, resumed  # killed with the launcher: only the object in the bucket remains
    spooled = [json.loads(line) for line in read_text(layout.spool).splitlines()]
    assert [row["step"] for row in spooled if row["key"] == "train/loss"] == [1, 2, 3, 1, 2, 3, 4]

    launcher = MlflowTracker(uri, retries=1, timeout_s=1, spool=layout.spool)
    assert launcher.last_steps(run_id) == {"train/loss": 4, "val/loss": 4}  # a next worker skips these steps
    assert launcher.end_run(run_id, "FINISHED")
    MlflowTracker(uri, retries=1, timeout_s=1, spool=layout.spool).send_spooled()  # nothing left to send
    client = MlflowClient(uri)
    for key in ("train/loss", "val/loss"):
        assert collections.Counter(m.step for m in client.get_metric_history(run_id, key)) == \
            {1: 1, 2: 1, 3: 1, 4: 1}, key
    # The server's own point of step 1 stays; of the recomputed steps, the first attempt's reached it first.
    assert {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")} == \
        {1: 1.0, 2: 12.0, 3: 13.0, 4: 24.0}
    assert client.get_run(run_id).info.status == "FINISHED"
    assert read_text(layout.spool) is None


def test_init_from_a_run_stored_in_the_bucket(s3, tmp_path):
    """`model.init_from` names a pretraining run in s3:// storage (by name, or by its folder's URI): its
    checkpoint is found in the bucket, checked, downloaded, and its encoder and tokenizer fine-tune."""
    from orchestrator.launch.local_run import train_locally
    from orchestrator.launch.pretrained import preflight

    server, root = s3
    model = {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 32, "attention": {"kind": "mha", "heads": 2}}
    local = tmp_path / "runs"
    pre = validate_spec({"name": "mlm", "model": model, "optim": {"max_steps": 2},
                         "task": {"kind": "mlm", "seq_len": 32, "batch_size": 4, "vocab_size": 150,
                                  "builtin": {"train_sentences": 100, "eval_sentences": 10}},
                         "run": {"eval_every": 2, "checkpoint_every": 2, "storage_path": str(local)}})
    train_locally(pre, cache_dir=tmp_path / "cache", folder=local / "mlm")
    fs, path = storage_fs(join(root, "runs"))
    pyarrow.fs.copy_files(str(local), path, source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs)
    for init_from in ("mlm", join(root, "runs", "mlm")):
        spec = validate_spec({"name": "ft", "model": {**model, "init_from": init_from}, "optim": {"max_steps": 1},
                              "task": {"kind": "classify", "max_len": 32, "batch_size": 8, "num_classes": 3,
                                       "builtin": {"train_sentences": 40, "eval_sentences": 10}},
                              "run": {"eval_every": 1, "checkpoint_every": 1, "storage_path": join(root, "runs")}})
        pretrained = preflight(spec)
        assert pretrained.location == join(root, "runs", "mlm", checkpoint_name(2)), init_from
    trainer, _ = train_locally(spec, cache_dir=tmp_path / "cache-ft")
    tokenizer = (local / "mlm" / checkpoint_name(2) / "tokenizer.model").read_bytes()
    assert trainer.task.tokenizer.model_path.read_bytes() == tokenizer  # the pretraining tokenizer, from S3
    assert Path(trainer.task.tokenizer.model_path).is_file()
