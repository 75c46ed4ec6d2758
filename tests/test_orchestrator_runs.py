"""End-to-end runs on the session's local Ray (the slow tier): a sweep's MLflow layout, resume after a failure, a
2-worker DDP run and a dead tracking server; and, in the fast tier, what the launcher and the tracker do around
them without Ray. Tiny MLM models on the built-in corpus; one trial at a time."""

from __future__ import annotations

import collections
import itertools
import json
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from orchestrator.launch.evaluate import evaluate_stored
from orchestrator.launch.preflight import LaunchError
from orchestrator.launch.resuming import resume
from orchestrator.launch.run import run_training
from orchestrator.launch.sweep import run_sweep
from orchestrator.spec import SpecError, study_from_raw, validate_spec
from orchestrator.spec.plan import plan_study
from orchestrator.tracking.describe import PARENT_TAG, TRIAL_TAG
from orchestrator.tracking.write import TrackingWarning
from orchestrator.training.checkpoint import read_checkpoint


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict[str, str]:
    """One storage folder and one SQLite store for the module: the tokenizer cache and the store's schema
    migration are paid once."""
    root = tmp_path_factory.mktemp("orchestrator")
    return {"storage": str(root / "runs"), "uri": f"sqlite:///{root / 'mlflow.db'}"}


def tiny_spec(name: str, workspace: dict[str, str], **sections) -> dict:
    raw = {
        "name": name,
        "task": {"kind": "mlm", "seq_len": 16, "batch_size": 4, "vocab_size": 120, "eval_batches": 2,
                 "builtin": {"train_sentences": 300, "eval_sentences": 30}},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16, "dropout": 0.1,
                  "attention": {"kind": "mha", "heads": 2}},
        "optim": {"lr": 3e-3, "max_steps": 4, "warmup_steps": 1, "seed": 7},
        "run": {"checkpoint_every": 2, "eval_every": 2, "log_every": 1, "storage_path": workspace["storage"],
                "cpus_per_worker": 1},
        "tracking": {"uri": workspace["uri"], "retries": 2, "timeout_s": 2},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    return raw


def points_per_step(client: MlflowClient, run_id: str, key: str) -> collections.Counter:
    return collections.Counter(m.step for m in client.get_metric_history(run_id, key))


def loss_curve(client: MlflowClient, run_id: str) -> dict[int, float]:
    """train/loss by step; a step logged twice (re-run after a resume) keeps its latest value."""
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: (m.step, m.timestamp))
    return {m.step: m.value for m in history}


@pytest.mark.slow
def test_sweep_logs_parent_and_child_runs(ray_cluster, workspace):
    """A 2-trial sweep on the session's local Ray, through Tune, Ray Train and MLflow, with the layout every
    report and resume relies on (the slow tier: a minute of Ray actors starting on 2 cores)."""
    raw = tiny_spec("sweep2", workspace,
                    model={"attention": {"grid": [{"kind": "mha", "heads": 2}, {"kind": "mhe", "heads": 2, "mode": "mul"}]}},
                    tune={"scheduler": "fifo"}, tracking={"system_metrics": True, "system_metrics_interval_s": 0.5})
    study = study_from_raw(raw)
    outcome = run_sweep(study)
    assert outcome.errors == 0 and len(outcome.trials) == 2
    planned = {plan.values["model.attention"]["kind"]: plan.flops_per_token for plan in plan_study(study)}

    client = MlflowClient(workspace["uri"])
    experiment = client.get_experiment_by_name("sweep2")
    store = Path(workspace["uri"].removeprefix("sqlite:///")).parent
    assert experiment.artifact_location == (store / "mlartifacts" / "sweep2").as_uri()  # not pytest's ./mlruns
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    children = [r for r in runs if r.data.tags.get(PARENT_TAG) == outcome.parent_run_id]
    assert [p.info.run_id for p in parents] == [outcome.parent_run_id]
    assert len(children) == 2
    assert {c.data.params["model.attention.kind"] for c in children} == {"mha", "mhe"}
    assert len({c.data.tags[TRIAL_TAG] for c in children}) == 2
    for child in children:
        assert child.info.status == "FINISHED"
        assert int(child.data.params["params.attention"]) > 0
        assert int(child.data.params["params.total"]) > int(child.data.params["params.attention"])
        assert child.data.params["tune.metric"] == "val/ppl"
        # the worker's count is plan's (issue 48); a CPU has no peak in the GPU table, so no MFU
        assert float(child.data.params["flops_per_token"]) == planned[child.data.params["model.attention.kind"]] > 0
        assert "train/mfu" not in child.data.metrics
        assert {"train/loss", "val/loss", "val/ppl", "lr", "train/tokens_per_s", "test/ppl"} <= set(child.data.metrics)
        assert sorted(loss_curve(client, child.info.run_id)) == [1, 2, 3, 4]
        # What made the run, as MLflow users look for it; nothing that names this machine's folders.
        tags = child.data.tags
        assert len(tags["mlflow.source.git.commit"]) == 40 or tags["mlflow.source.git.commit"] == "unknown"
        assert tags["versions.torch"] == torch.__version__ and tags["versions.ray"] == ray_cluster.__version__
        assert tags["device.name"].startswith("cpu") and tags["device.workers"] == "1"
        assert tags["orchestrator.checkpoints"].startswith(workspace["storage"])
        assert not {"run.storage_path", "tracking.uri"} & set(child.data.params)
        assert not [v for v in child.data.params.values() if workspace["storage"] in v or v.startswith("/")]
        assert any(key.startswith("system/cpu_utilization") for key in child.data.metrics), sorted(child.data.metrics)
    # A second sweep of the same name must not silently mix into this one.
    with pytest.raises(LaunchError, match="orchestrator resume sweep2"):
        run_sweep(study_from_raw(raw))


@pytest.mark.slow
def test_resume_continues_run_id_and_loss_curve(ray_cluster, workspace):
    optim = {"max_steps": 6}
    run = {"checkpoint_every": 2}
    reference = run_training(validate_spec(tiny_spec("uninterrupted", workspace, optim=optim, run=run)))
    assert reference.metrics["step"] == 6

    # No retries: the injected failure recurs at step 3 on each (Ray Train's retry path: tests/test_faults.py).
    spec = validate_spec(tiny_spec("interrupted", workspace, optim=optim, run={**run, "max_failures": 0}))
    with pytest.raises(LaunchError, match="orchestrator resume interrupted"):
        run_training(spec, fail_at_step=3)  # dies after step 3; its last checkpoint is step 2
    client = MlflowClient(workspace["uri"])
    first = client.search_runs([client.get_experiment_by_name("interrupted").experiment_id])
    assert len(first) == 1
    run_id = first[0].info.run_id
    assert max(loss_curve(client, run_id)) == 3

    resumed = resume("interrupted", workspace["storage"])  # what `orchestrator resume` calls
    assert resumed.mlflow_run_id == run_id and resumed.metrics["step"] == 6
    runs = client.search_runs([client.get_experiment_by_name("interrupted").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id] and runs[0].info.status == "FINISHED"
    # Steps 3..6 after resuming from step 2 reproduce the uninterrupted run exactly (same seed, CPU).
    assert loss_curve(client, run_id) == loss_curve(client, reference.mlflow_run_id)
    # So do the best validation score and the final test evaluation of the best checkpoint.
    got, want = client.get_run(run_id).data.metrics, client.get_run(reference.mlflow_run_id).data.metrics
    for key in ("best/val/ppl", "best/step", "test/loss", "test/ppl", "test/checkpoint_step"):
        assert got[key] == want[key], key
    assert resumed.metrics["test/loss"] == got["test/loss"]
    # The exported model is a run artifact; `orchestrator evaluate` re-scores the stored run identically.
    assert {a.path for a in client.list_artifacts(run_id, "model")} >= {"model/model.safetensors", "model/model.json"}
    scored = evaluate_stored("interrupted", workspace["storage"], split="test", which="best")
    assert [item["metrics"]["test/loss"] for item in scored] == [got["test/loss"]]
    validation = evaluate_stored("interrupted", workspace["storage"], split="validation", which="latest")
    assert validation[0]["metrics"]["validation/checkpoint_step"] == 6

    # A finished run trains further on `orchestrator resume NAME optim.max_steps=8`: same MLflow run, steps 7 and 8
    # added once each, steps 1..6 untouched; a field its checkpoints depend on cannot change on resume.
    with pytest.raises(SpecError, match="model.d_model cannot change on resume"):
        resume("uninterrupted", workspace["storage"], ["model.d_model=32"])
    before = loss_curve(client, reference.mlflow_run_id)
    extended = resume("uninterrupted", workspace["storage"], ["optim.max_steps=8"])
    assert extended.mlflow_run_id == reference.mlflow_run_id and extended.metrics["step"] == 8
    after = loss_curve(client, reference.mlflow_run_id)
    assert sorted(after) == list(range(1, 9)) and {s: after[s] for s in before} == before
    assert max(points_per_step(client, reference.mlflow_run_id, "train/loss").values()) == 1
    assert client.get_run(reference.mlflow_run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_resumed_sweep_restarts_a_failed_trial_from_its_checkpoint(ray_cluster, workspace):
    # No retries (Ray Train's or Tune's): the injected failure recurs at step 3 on each.
    raw = tiny_spec("sweep-resume", workspace, optim={"max_steps": 6}, run={"checkpoint_every": 2, "max_failures": 0},
                    tune={"scheduler": "fifo", "max_failures": 0})
    failed = run_sweep(study_from_raw(raw), fail_at_step=3)  # the trial dies after step 3; checkpoint at 2
    assert failed.errors == 1 and len(failed.trials) == 1
    client = MlflowClient(workspace["uri"])
    parent = client.get_run(failed.parent_run_id)
    assert parent.info.status == "FAILED"
    child_id = failed.trials[0]["mlflow_run_id"]
    assert max(loss_curve(client, child_id)) == 3

    resumed = resume("sweep-resume", workspace["storage"])  # what `orchestrator resume` calls
    assert resumed.errors == 0 and not resumed.interrupted
    assert resumed.parent_run_id == failed.parent_run_id
    assert [t["mlflow_run_id"] for t in resumed.trials] == [child_id]  # the trial kept its child run
    assert resumed.trials[0]["metrics"]["step"] == 6
    assert client.get_run(failed.parent_run_id).info.status == "FINISHED"
    assert client.get_run(child_id).info.status == "FINISHED"
    assert sorted(loss_curve(client, child_id)) == [1, 2, 3, 4, 5, 6]
    # The restarted trial began from its step-2 checkpoint, not from scratch, and recomputed step 3: every
    # metric holds one point per step (the failed attempt's step 3 is not logged again).
    for key in ("train/loss", "train/tokens_per_s", "lr"):
        logged = collections.Counter(m.step for m in client.get_metric_history(child_id, key))
        assert logged == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1}, key


@pytest.mark.slow
def test_two_worker_ddp_run_trains_with_tracking_server_down(ray_cluster, workspace, unused_port):
    """Two gloo DDP ranks train to the end while every MLflow call fails: logging warns, never stops training,
    and rank 0's points wait in the run folder's spool as points of a run not opened yet; `resume`, once a
    server answers (here the module's store, `tracking.uri=` on resume), opens the run and sends every point
    and the test scores. (One run checks all of it, to keep the suite's Ray time small.)"""
    raw = tiny_spec("ddp-no-server", workspace,
                    run={"workers": 2, "cpus_per_worker": 0.5, "checkpoint_every": 4},
                    tracking={"uri": f"http://127.0.0.1:{unused_port}", "retries": 2, "timeout_s": 1,
                              "offline_ok": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = run_training(validate_spec(raw))
    assert outcome.metrics["step"] == 4 and outcome.metrics["val/ppl"] > 0
    assert any(issubclass(w.category, TrackingWarning) and str(unused_port) in str(w.message) for w in caught)
    assert outcome.mlflow_run_id is None
    rows = [json.loads(line) for line in (Path(outcome.path) / "mlflow-spool.jsonl").read_text().splitlines()]
    assert {r["run_id"] for r in rows} == {None}
    assert sorted(r["step"] for r in rows if r.get("key") == "train/loss") == [1, 2, 3, 4]  # rank 0's, once each
    assert {k for r in rows if r.get("kind") == "params" for k in r["items"]} == {"params.attention", "params.total",
                                                                                      "flops_per_token"}
    closed = resume("ddp-no-server", workspace["storage"], [f"tracking.uri={workspace['uri']}"])
    run = MlflowClient(workspace["uri"]).get_run(closed.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["test/loss"] == outcome.metrics["test/loss"]
    assert run.data.params["params.attention"] == str(int(outcome.metrics["params.attention"]))  # rank 0's
    assert loss_curve(MlflowClient(workspace["uri"]), run.info.run_id).keys() == {1, 2, 3, 4}
    assert not (Path(outcome.path) / "mlflow-spool.jsonl").exists()
    state = read_checkpoint(Path(outcome.checkpoint))
    assert state.step == 4 and len(state.data_positions) == 2 and len(state.rng) == 2  # one entry per rank
    assert not torch.equal(state.rng[0]["torch"], state.rng[1]["torch"])  # each rank's own dropout stream


@pytest.fixture
def unused_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- pieces of a run, without Ray ---------------------------------------------------------------------


def test_tracker_with_dead_server_warns_then_skips_quickly(unused_port):
    from orchestrator.tracking.describe import RunHandle
    from orchestrator.tracking.write import MlflowTracker

    tracker = MlflowTracker(f"http://127.0.0.1:{unused_port}", retries=2, timeout_s=1, backoff_s=0.01)
    with pytest.warns(TrackingWarning, match=f"127.0.0.1:{unused_port}.*retries in 30s"):
        assert tracker.ensure_run(RunHandle("exp", "run", key=("orchestrator.run", "/runs/run"))) is None
    assert not tracker.available
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cooling down: calls are skipped silently and metrics are kept
        for step in range(3):
            tracker.log_metrics("some-run", {"train/loss": 1.0}, step)
    # Ending a run is the last chance to send: it tries through the cool-down, and with the server still
    # down it keeps the points and leaves the run open.
    with pytest.warns(TrackingWarning):
        assert tracker.end_run("some-run") is False
    assert len(tracker._waiting.points_of("some-run")) == 3


def test_checkpoint_roundtrip_restores_rng(tmp_path):
    import random

    from orchestrator.training.checkpoint import (
        TrainingState,
        capture_rng,
        restore_rng,
        write_checkpoint,
    )

    rng = capture_rng()
    expected = (random.random(), torch.rand(3))
    state = TrainingState(step=7, model={"w": torch.ones(2)}, optimizer={}, scheduler={}, scaler={},
                          data_positions=[{"epoch": 0, "step": 7}], rng=[rng], mlflow_run_id="abc", spec={"name": "x"})
    path = write_checkpoint(tmp_path, state, "name: x\n")
    assert path.name == "checkpoint_000000007" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    loaded = read_checkpoint(path)
    assert (loaded.step, loaded.mlflow_run_id, loaded.data_positions) == (7, "abc", [{"epoch": 0, "step": 7}])
    restore_rng(loaded.rng[0])
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


@pytest.mark.parametrize("schedule", ["cosine", "linear", "inverse_sqrt", "constant"])
def test_lr_schedules_warm_up_then_decay(schedule):
    from orchestrator.spec import OptimConfig
    from orchestrator.training.optimizer_step import lr_lambda

    factor = lr_lambda(OptimConfig(schedule=schedule, warmup_steps=4, max_steps=20))
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    tail = [factor(s) for s in range(4, 20)]
    assert all(a >= b for a, b in itertools.pairwise(tail)) and 0.0 <= tail[-1] <= 1.0
    if schedule == "constant":
        assert set(tail) == {1.0}
    if schedule in ("cosine", "linear"):
        assert tail[-1] < 0.1


def test_a_run_that_diverged_is_not_trained_again_on_retry_or_resume(tmp_path):
    """The worker marks a NaN run's folder; a retried trial or a resume then fails at once with the reason."""
    from types import SimpleNamespace

    from orchestrator.launch.run import fit_and_finish
    from orchestrator.storage.layout import diverged, mark_diverged
    from orchestrator.tracking.describe import run_handle
    from orchestrator.tracking.write import MlflowTracker

    folder = tmp_path / "runs" / "nan"
    assert diverged(str(folder)) is None
    mark_diverged(str(folder), "train/loss is nan at step 7 (lr 10)")

    class NeverFit:
        run_config = SimpleNamespace(storage_path=str(tmp_path / "runs"), storage_filesystem=None, name="nan")

        def fit(self):
            raise AssertionError("a diverged run must not start its workers again")

    spec = validate_spec(tiny_spec("nan", {"storage": str(tmp_path / "runs"), "uri": f"sqlite:///{tmp_path}/m.db"}))
    tracker = MlflowTracker(spec.tracking.uri)
    handle = run_handle({}, "", experiment="nan", run_name="nan", role="run", kind="mha", commit="abc",
                        key=("orchestrator.run", str(folder)))
    with pytest.raises(LaunchError, match=r"run 'nan' failed: NonFiniteLoss: train/loss is nan at step 7"):
        fit_and_finish(spec, NeverFit(), handle, tracker, str(tmp_path), label="run 'nan'", advice=None)
    [run] = MlflowClient(spec.tracking.uri).search_runs(
        [MlflowClient(spec.tracking.uri).get_experiment_by_name("nan").experiment_id])
    assert run.info.status == "FAILED"
    # The MLflow run says why, as a tag and as its description (not only the console).
    assert run.data.tags["orchestrator.failure"] == "NonFiniteLoss: train/loss is nan at step 7 (lr 10)"
    assert "train/loss is nan at step 7" in run.data.tags["mlflow.note.content"]


@pytest.mark.parametrize("error, reason", [
    ("lost", "ray.exceptions.ActorDiedError: the actor died unexpectedly: its node was lost"),
    ("raised", "ValueError: bad batch"),
], ids=["node-lost", "exception"])
def test_the_reason_a_run_failed_is_on_its_mlflow_run(tmp_path, error, reason):
    """Ray Train giving up (a node lost past run.max_failures, a worker's exception) or the launcher's own error:
    the FAILED run carries the one-line reason as `orchestrator.failure` and as its MLflow description."""
    from types import SimpleNamespace

    from orchestrator.cluster.ray_env import use_train_v2
    from orchestrator.launch.run import fit_and_finish
    from orchestrator.tracking.describe import run_handle
    from orchestrator.tracking.write import MlflowTracker

    use_train_v2()
    from ray.train.v2.api.exceptions import WorkerGroupError

    class Fails:
        run_config = SimpleNamespace(storage_path=str(tmp_path / "runs"), storage_filesystem=None, name="fails")

        def fit(self):
            if error == "lost":
                raise WorkerGroupError("Training failed", {0: RuntimeError(reason)})
            raise ValueError("bad batch")

    spec = validate_spec(tiny_spec("fails", {"storage": str(tmp_path / "runs"), "uri": f"sqlite:///{tmp_path}/m.db"}))
    tracker = MlflowTracker(spec.tracking.uri)
    handle = run_handle({}, "", experiment="fails", run_name="fails", role="run", kind="mha", commit="abc",
                        key=("orchestrator.run", str(tmp_path / "runs" / "fails")))
    with pytest.raises(LaunchError if error == "lost" else ValueError):
        fit_and_finish(spec, Fails(), handle, tracker, str(tmp_path), label="run 'fails'", advice=None)
    client = MlflowClient(spec.tracking.uri)
    [run] = client.search_runs([client.get_experiment_by_name("fails").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["orchestrator.failure"] == reason
    assert reason in run.data.tags["mlflow.note.content"]


def test_a_create_whose_answer_was_lost_is_not_made_twice(tmp_path):
    """The server made the run but its answer timed out (a loaded server): the retry finds the run by its key."""
    from orchestrator.tracking.describe import run_handle
    from orchestrator.tracking.write import MlflowTracker

    class AnswerLostOnce(MlflowClient):
        lost = 0

        def create_run(self, *args, **kwargs):
            run = super().create_run(*args, **kwargs)
            if not AnswerLostOnce.lost:
                AnswerLostOnce.lost += 1
                raise TimeoutError("read timed out")  # what the client sees; the store has the run
            return run

    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", retries=2, timeout_s=1, backoff_s=0.0)
    tracker._client = AnswerLostOnce(tracking_uri=tracker.uri)
    handle = run_handle({}, "name: once\n", experiment="once", run_name="run", role="run", kind="mha", commit="abc",
                        key=("orchestrator.run", "/runs/once"))
    run_id = tracker.ensure_run(handle)
    assert AnswerLostOnce.lost == 1 and run_id is not None
    experiment = MlflowClient(tracker.uri).get_experiment_by_name("once").experiment_id
    assert [r.info.run_id for r in MlflowClient(tracker.uri).search_runs([experiment])] == [run_id]


def test_run_opened_during_an_outage_gets_its_backlog(tmp_path):
    """The store is unreachable at the start (a file stands where its folder must be), then comes up: the run
    is created then from the launcher's handle (tags and params included), the metrics logged meanwhile arrive
    in order, and the run is left for its owner, the launcher, to end; the launcher finds the same run."""
    from orchestrator.tracking.describe import run_handle
    from orchestrator.tracking.loggers import MlflowLogger
    from orchestrator.tracking.write import MlflowTracker

    store = tmp_path / "late"
    store.write_text("not a folder")
    tracker = MlflowTracker(f"sqlite:///{store / 'mlflow.db'}", retries=1, timeout_s=1, cooldown_s=0.0)
    handle = run_handle({"model.d_model": 16}, "name: late\n", experiment="late", run_name="run", role="run",
                        kind="mha", commit="abc", key=("orchestrator.run", "/runs/late"))
    with pytest.warns(TrackingWarning):
        logger = MlflowLogger(tracker, lambda: tracker.ensure_run(handle))
    assert logger.run_id is None
    with pytest.warns(TrackingWarning):
        logger.log({"train/loss": 3.0}, 1)  # still down: kept in the backlog
    store.unlink()
    store.mkdir()
    logger.log({"train/loss": 2.0}, 2)
    logger.close()
    client = MlflowClient(tracker.uri)
    assert loss_curve(client, logger.run_id) == {1: 3.0, 2: 2.0}
    run = client.get_run(logger.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.params["model.d_model"] == "16" and run.data.tags["method.family"] == "mha"
    assert tracker.ensure_run(handle) == logger.run_id  # found again by its key, not duplicated


def test_restarted_logger_logs_each_step_once_and_spool_survives_the_process(tmp_path, unused_port):
    """A resumed worker recomputes steps it logged before its failure: they are not logged again. Points a
    dead server did not take wait in the spool file, and a later tracker (the launcher) sends them before it
    ends the run; until they are sent, the run is not ended."""
    from orchestrator.tracking.describe import run_handle
    from orchestrator.tracking.loggers import MlflowLogger
    from orchestrator.tracking.write import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spool = tmp_path / "run" / "mlflow-spool.jsonl"
    handle = run_handle({}, "", experiment="dedupe", run_name="run", role="run", kind="mha", commit="abc",
                        key=("orchestrator.run", str(tmp_path / "run")))
    tracker = MlflowTracker(uri, retries=1, timeout_s=1, spool=spool)
    first = MlflowLogger(tracker, lambda: tracker.ensure_run(handle))
    for step in (1, 2, 3):
        first.log({"train/loss": float(step)}, step)
    restarted = MlflowTracker(uri, retries=1, timeout_s=1, spool=spool)
    resumed = MlflowLogger(restarted, lambda: restarted.ensure_run(handle))  # resumed from a step-1 checkpoint
    for step in (2, 3, 4):
        resumed.log({"train/loss": 10.0 * step, "val/loss": 1.0}, step)
    assert loss_curve(MlflowClient(uri), resumed.run_id) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0}
    assert collections.Counter(m.step for m in MlflowClient(uri).get_metric_history(resumed.run_id, "val/loss")) \
        == {2: 1, 3: 1, 4: 1}
    assert not spool.exists()  # everything was taken

    down = MlflowTracker(f"http://127.0.0.1:{unused_port}", retries=1, timeout_s=1, spool=spool)
    with pytest.warns(TrackingWarning):
        down.log_metrics(resumed.run_id, {"train/loss": 5.0}, 5)
    assert spool.is_file()
    assert down.end_run(resumed.run_id) is False  # cannot send: the run is left open
    launcher = MlflowTracker(uri, retries=1, timeout_s=1, spool=spool)
    assert launcher.end_run(resumed.run_id, "FINISHED") is True
    assert loss_curve(MlflowClient(uri), resumed.run_id)[5] == 5.0 and not spool.exists()
    assert MlflowClient(uri).get_run(resumed.run_id).info.status == "FINISHED"


@pytest.mark.parametrize("opened_by", ["the launcher at the run's end", "the next launcher, after a kill",
                                       "a resumed worker"])
def test_points_of_a_run_never_opened_outlive_the_process_and_go_to_the_run_once_opened(tmp_path, unused_port,
                                                                                     opened_by):
    """The server is away for a worker's whole life (a trial that started during an outage): its run is never
    opened there, so its points are spooled without a run id, not kept in memory. Whoever opens the run later
    through the spool's tracker gets them: the launcher that started the worker (its tracker made before the
    worker logged), the next launcher when that one was killed after opening the run (a resumed sweep closing
    a finished trial), or a resumed worker after a sweep's resume sent every spool it could (these it cannot)."""
    from orchestrator.tracking.describe import run_handle
    from orchestrator.tracking.loggers import MlflowLogger
    from orchestrator.tracking.write import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spool = tmp_path / "trial" / "mlflow-spool.jsonl"
    handle = run_handle({}, "", experiment="late", run_name="trial", role="trial", kind="mha", commit="abc",
                        key=("orchestrator.trial", "t0"))
    launcher = MlflowTracker(uri, retries=1, timeout_s=1, spool=spool)  # the trial driver, before its worker
    down = MlflowTracker(f"http://127.0.0.1:{unused_port}", retries=1, timeout_s=1, cooldown_s=0.0, spool=spool)
    with pytest.warns(TrackingWarning):
        worker = MlflowLogger(down, lambda: down.ensure_run(handle))
        down.defer(worker.run_id, "params", {"params.attention": 96})  # what only the worker knows (RayHooks)
        down.defer(worker.run_id, "tags", {"device.name": "cpu"})
        for step in (1, 2, 3):
            worker.log({"train/loss": float(step)}, step)
        worker.close()
    assert worker.run_id is None
    rows = [json.loads(line) for line in spool.read_text().splitlines()]
    assert [(r["run_id"], r["step"], r["value"]) for r in rows if "step" in r] == [
        (None, 1, 1.0), (None, 2, 2.0), (None, 3, 3.0)]
    assert [(r["run_id"], r["kind"], r["items"]) for r in rows if "items" in r] == [
        (None, "params", {"params.attention": "96"}), (None, "tags", {"device.name": "cpu"})]

    if opened_by != "a resumed worker":
        run_id = launcher.ensure_run(handle)
        closer = launcher if opened_by == "the launcher at the run's end" else MlflowTracker(uri, spool=spool)
        assert closer.end_run(run_id, "FINISHED") is True
        expected = {1: 1.0, 2: 2.0, 3: 3.0}
    else:
        MlflowTracker(uri, retries=1, timeout_s=1, spool=spool).send_spooled()  # `resume` of the sweep
        assert spool.read_text().splitlines() == [json.dumps(r) for r in rows]  # kept for the run's opener
        resumed_tracker = MlflowTracker(uri, retries=1, timeout_s=1, spool=spool)
        resumed = MlflowLogger(resumed_tracker, lambda: resumed_tracker.ensure_run(handle))
        resumed.log({"train/loss": 40.0}, 4)
        resumed.log({"train/loss": 30.0}, 3)  # recomputed after a checkpoint: the spooled point stays
        run_id = resumed.run_id
        expected = {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0}
    assert loss_curve(MlflowClient(uri), run_id) == expected
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.params["params.attention"] == "96" and run.data.tags["device.name"] == "cpu"
    assert not spool.exists()  # everything was taken
    experiment = MlflowClient(uri).get_experiment_by_name("late").experiment_id
    assert [r.info.run_id for r in MlflowClient(uri).search_runs([experiment])] == [run_id]


def test_a_deferred_param_the_server_refuses_is_dropped_and_does_not_hold_the_points_behind_it(tmp_path):
    """Deferred params are retried until the server takes them, but a param it refuses (logged before with
    another value) can never be taken: it is dropped with a warning, and the run's points still go out."""
    from orchestrator.tracking.describe import run_handle
    from orchestrator.tracking.write import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spool = tmp_path / "run" / "mlflow-spool.jsonl"
    tracker = MlflowTracker(uri, retries=1, timeout_s=1, cooldown_s=0.0, spool=spool)
    run_id = tracker.ensure_run(run_handle({}, "", experiment="refused", run_name="run", role="run", kind="mha",
                                           commit="abc", key=("orchestrator.run", "/runs/refused")))
    tracker.defer(run_id, "params", {"params.attention": 96})
    with pytest.warns(TrackingWarning, match=r"refused the params \['params.attention'\] .* dropped"):
        tracker.defer(run_id, "params", {"params.attention": 97})
    tracker.log_metrics(run_id, {"train/loss": 1.0}, 1)
    assert loss_curve(MlflowClient(uri), run_id) == {1: 1.0}
    assert MlflowClient(uri).get_run(run_id).data.params["params.attention"] == "96"
    assert not spool.exists() and not tracker.holds_unsent(run_id)


def test_artifacts_of_a_sqlite_store_live_next_to_it_whatever_the_working_directory(tmp_path, monkeypatch):
    """A run started in another folder than its SQLite store's keeps its artifacts in `mlartifacts/` next to the
    database, writes nothing to `./mlruns` of its working directory, and `orchestrator ui` serves them there."""
    from orchestrator.cli import main
    from orchestrator.tracking.describe import run_handle
    from orchestrator.tracking.write import MlflowTracker

    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    uri = f"sqlite:///{store / 'mlflow.db'}"
    handle = run_handle({}, "name: far\n", experiment="far away", run_name="run", role="run", kind="mha",
                        commit="abc", key=("orchestrator.run", "/runs/far"))
    run_id = MlflowTracker(uri, retries=1).ensure_run(handle)
    assert (store / "mlartifacts" / "far_away" / run_id / "artifacts" / "spec.yaml").read_text() == "name: far\n"
    assert list(elsewhere.iterdir()) == []  # no ./mlruns, nothing else

    commands = []
    from orchestrator.tracking import ui

    monkeypatch.setattr(ui, "run_server", lambda cmd, env, port, lines: commands.append((cmd, env)) or 0)
    assert main(["ui", str(Path(__file__).parents[1] / "configs" / "smoke.yaml"), f"tracking.uri={uri}"]) == 0
    [(cmd, env)] = commands
    assert cmd[cmd.index("--artifacts-destination") + 1] == str(store / "mlartifacts")
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"  # no job runner: seven idle processes less


@pytest.mark.slow
def test_multi_objective_optuna_sweep_reports_its_non_dominated_trials(ray_cluster, workspace):
    """Optuna's multi-objective TPE through Ray Tune on [val/ppl, params.attention]; the sweep's report marks the
    trials no other beats on both, and logs parallel coordinates to the parent (importance needs more runs)."""
    raw = tiny_spec("moo", workspace, model={"attention": {"kind": {"choice": ["mha", "sha"]}, "heads": 2}},
                    optim={"lr": {"loguniform": [1e-3, 1e-2]}},
                    tune={"scheduler": "fifo", "search": "optuna", "num_samples": 3, "seeds": [0],
                          "metric": ["val/ppl", "params.attention"], "mode": ["min", "min"]})
    outcome = run_sweep(study_from_raw(raw))
    assert outcome.errors == 0 and len(outcome.trials) == 3
    client = MlflowClient(workspace["uri"])
    parent = outcome.parent_run_id
    files = {f.path for f in client.list_artifacts(parent, "report")}
    # importance needs repeats or 20 drawn runs (orchestrator/report/importance.py): three draws get the plot only
    assert {"report/objectives.csv", "report/parallel_coordinates.png"} <= files, files
    assert "report/importance.csv" not in files
    children = client.search_runs([client.get_experiment_by_name("moo").experiment_id],
                                  filter_string=f"tags.`{PARENT_TAG}` = '{parent}'")
    assert {c.data.tags["orchestrator.seed"] for c in children} == {"0"}
    assert all("lr=" in c.data.tags["orchestrator.point"] for c in children)
    table = pd.read_csv(client.download_artifacts(parent, "report/objectives.csv"))
    values = {row.run_id: (row["val/ppl"], row["params.attention"]) for _, row in table.iterrows()}
    for _, row in table.iterrows():
        mine = values[row.run_id]
        beaten = any(v[0] <= mine[0] and v[1] <= mine[1] and v != mine for v in values.values())
        assert row.non_dominated == (not beaten), table
    assert table.non_dominated.any()
