"""A run's outputs after training (orchestrator/launch/deliver.py): the final evaluation's scores and files and the task's
files reach its MLflow run from storage exactly once, through an outage, a second delivery and a rewritten file.

A SQLite store stands in for the server that is up; a URI where nothing listens is the server that is down (the
real-process tier stops a real `mlflow server` across the end of a run: tests/test_faults.py)."""

from __future__ import annotations

import collections
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from orchestrator.launch import evaluate
from orchestrator.launch.deliver import deliver_outputs, store_task_files
from orchestrator.spec import validate_spec
from orchestrator.storage.layout import DELIVERED_FILE, RunLayout, evaluation_record
from orchestrator.storage.locations import write_json
from orchestrator.tracking.write import MlflowTracker
from orchestrator.training.scoring import Evaluation

STEP = 24
SCORES = {"test/loss": 1.484, "test/ppl": 4.41, "test/checkpoint_step": float(STEP)}


@pytest.fixture
def store(tmp_path, monkeypatch):
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.setenv(name, os.environ.get(name, "5"))  # the tracker sets them: restored after the test
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("deliver")).info.run_id
    return uri, client, run_id


def stored_run(folder, tokenizer_text="pieces"):
    """A run folder as the end of training leaves it: scores and files of the final evaluation, the task's files."""
    (folder / "evaluation" / "model").mkdir(parents=True)
    (folder / "evaluation" / "model" / "config.json").write_text('{"d_model": 16}')
    (folder / "evaluation" / "test.hyp").write_text("a hypothesis\n")
    write_json(evaluation_record(str(folder / "evaluation"), "test"),
               {"split": "test", "step": STEP, "metrics": SCORES, "tags": {"test.checkpoint": "best (step 24)"}})
    tokenizer = folder.parent / "spm.model"
    tokenizer.write_text(tokenizer_text)
    store_task_files(str(folder), {"tokenizer": tokenizer, "absent": folder.parent / "nothing-here"})
    return folder


def points(client, run_id):
    return {key: collections.Counter(m.step for m in client.get_metric_history(run_id, key)) for key in SCORES}


def artifacts(client, run_id, path=None):
    out = []
    for info in client.list_artifacts(run_id, path):
        out += artifacts(client, run_id, info.path) if info.is_dir else [info.path]
    return sorted(out)


def down_uri() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket is closed


EXPECTED_FILES = ["evaluation/test.hyp", "model/config.json", "task/tokenizer/spm.model"]


def test_outputs_arrive_once_however_often_they_are_delivered(store, tmp_path):
    uri, client, run_id = store
    folder = stored_run(tmp_path / "run")
    tracker = MlflowTracker(uri, spool=folder / "spool.jsonl")
    for _ in range(3):
        assert deliver_outputs(tracker, run_id, str(folder))
    assert points(client, run_id) == {key: {STEP: 1} for key in SCORES}
    run = client.get_run(run_id)
    assert run.data.metrics == SCORES and run.data.tags["test.checkpoint"] == "best (step 24)"
    assert artifacts(client, run_id) == EXPECTED_FILES
    assert not (folder / "task" / "absent").exists()


def test_an_outage_keeps_scores_in_the_spool_and_files_in_storage_until_the_server_is_back(store, tmp_path):
    """The server is down at the end of the run: nothing is marked delivered, the scores wait in the spool. A
    second try while it is still down spools none twice. Back up: the files go, the spooled scores are not sent
    again by the delivery but by the run's end; one point per metric."""
    uri, client, run_id = store
    folder = stored_run(tmp_path / "run")
    spool = folder / "spool.jsonl"
    for _ in range(2):
        down = MlflowTracker(down_uri(), retries=1, timeout_s=1, spool=spool)
        assert not deliver_outputs(down, run_id, str(folder))
    spooled = [json.loads(line) for line in spool.read_text().splitlines()]
    assert sorted(row["key"] for row in spooled) == sorted(SCORES) and {row["step"] for row in spooled} == {STEP}
    assert not (folder / DELIVERED_FILE).exists() or run_id not in json.loads((folder / DELIVERED_FILE).read_text())
    assert artifacts(client, run_id) == [] and client.get_run(run_id).data.metrics == {}

    up = MlflowTracker(uri, spool=spool)
    assert deliver_outputs(up, run_id, str(folder))
    assert artifacts(client, run_id) == EXPECTED_FILES
    assert up.end_run(run_id)  # the launcher's last step: the spool goes out
    assert points(client, run_id) == {key: {STEP: 1} for key in SCORES}
    assert not spool.exists()


def test_a_delivery_cut_short_after_sending_sends_nothing_twice(store, tmp_path):
    """Scores sent, then the launcher died before recording it: the next delivery finds them in the run."""
    uri, client, run_id = store
    folder = stored_run(tmp_path / "run")
    tracker = MlflowTracker(uri)
    assert deliver_outputs(tracker, run_id, str(folder))
    (folder / DELIVERED_FILE).unlink()  # the record of it, lost
    assert deliver_outputs(MlflowTracker(uri), run_id, str(folder))
    assert points(client, run_id) == {key: {STEP: 1} for key in SCORES}


def test_a_rewritten_file_is_sent_again_and_an_unchanged_one_is_not(store, tmp_path, monkeypatch):
    uri, client, run_id = store
    folder = stored_run(tmp_path / "run")
    tracker = MlflowTracker(uri)
    assert deliver_outputs(tracker, run_id, str(folder))
    hyp = folder / "evaluation" / "test.hyp"
    hyp.write_text("a better hypothesis\n")
    os.utime(hyp, ns=(hyp.stat().st_atime_ns, hyp.stat().st_mtime_ns + 10**9))
    sent = []
    original = MlflowTracker.log_artifact
    monkeypatch.setattr(MlflowTracker, "log_artifact",
                        lambda self, rid, path, artifact_path=None: sent.append(path.name) or
                        original(self, rid, path, artifact_path))
    assert deliver_outputs(tracker, run_id, str(folder))
    assert sent == ["test.hyp"]
    local = client.download_artifacts(run_id, "evaluation/test.hyp", str(tmp_path / "down"))
    assert open(local).read() == "a better hypothesis\n"


def test_a_run_without_an_mlflow_run_owes_nothing(tmp_path):
    assert deliver_outputs(MlflowTracker(down_uri(), retries=1, timeout_s=1), None, str(stored_run(tmp_path / "r")))


def test_scores_held_only_in_memory_are_not_recorded_as_delivered(store, tmp_path, monkeypatch):
    """Without a spool file (remote storage) a point the server did not take lives only in this process: the
    delivery is not complete, and not recorded, until the server has it."""
    uri, client, run_id = store
    folder = stored_run(tmp_path / "run")
    tracker = MlflowTracker(uri)
    monkeypatch.setattr(tracker, "flush", lambda rid, force=False: None)  # the server takes no metric batch
    assert not deliver_outputs(tracker, run_id, str(folder))
    ledger = json.loads((folder / DELIVERED_FILE).read_text())[run_id]
    assert not any(key.startswith("scores:") for key in ledger) and len(ledger) == len(EXPECTED_FILES)


def later_checkpoint_scores(folder, step=30, rewrite="", loss=9.0):
    """What `orchestrator evaluate --checkpoint latest` stores for a checkpoint after the best one: other scores,
    at a higher step, in that checkpoint's own folder (`rewrite` "-r1": a step checkpointed again)."""
    scored = folder / "evaluation" / f"checkpoint_{step:09d}{rewrite}"
    scored.mkdir(parents=True)
    (scored / "test.hyp").write_text("the latest hypothesis\n")
    metrics = {"test/loss": loss, "test/ppl": 8103.1, "test/checkpoint_step": float(step)}
    record = {"split": "test", "step": step, "metrics": metrics, "tags": {"test.checkpoint": f"latest (step {step})"}}
    write_json(evaluation_record(str(scored), "test"), record)
    return metrics


def test_another_checkpoints_scores_do_not_replace_the_final_evaluations_in_mlflow(store, tmp_path):
    """MLflow shows a metric's value at its highest step: sent as `test/*` at step 30, the latest checkpoint's
    scores became the run's test scores in place of the final evaluation's (step 24), and its tag replaced
    `test.checkpoint`. They go as `checkpoints/test/*` at their step, untagged; the final evaluation's stay."""
    uri, client, run_id = store
    folder = stored_run(tmp_path / "run")
    tracker = MlflowTracker(uri, spool=folder / "spool.jsonl")
    assert deliver_outputs(tracker, run_id, str(folder))  # the end of the run
    later = later_checkpoint_scores(folder)
    for _ in range(2):
        assert deliver_outputs(tracker, run_id, str(folder))  # `orchestrator evaluate`, twice
    run = client.get_run(run_id)
    assert {k: v for k, v in run.data.metrics.items() if k.startswith("test/")} == SCORES
    assert run.data.tags["test.checkpoint"] == "best (step 24)"
    assert {k: v for k, v in run.data.metrics.items() if k.startswith("checkpoints/")} == {
        f"checkpoints/{k}": v for k, v in later.items()}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "checkpoints/test/loss")] == [(30, 9.0)]
    assert "evaluation/checkpoint_000000030/test.hyp" in artifacts(client, run_id)


def test_both_checkpoints_of_a_rewritten_step_keep_their_scores_in_mlflow(store, tmp_path):
    """After a resume fell back past step 30, `checkpoint_000000030-r1` sits beside `checkpoint_000000030`; scored
    with `--checkpoint all`, the rewrite's scores were at a step `checkpoints/test/loss` already held, and dropped."""
    uri, client, run_id = store
    folder = stored_run(tmp_path / "run")
    later_checkpoint_scores(folder, loss=9.0)
    later_checkpoint_scores(folder, rewrite="-r1", loss=7.0)
    assert deliver_outputs(MlflowTracker(uri, spool=folder / "spool.jsonl"), run_id, str(folder))
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
               for key in ("checkpoints/test/loss", "checkpoints-r1/test/loss")}
    assert history == {"checkpoints/test/loss": [(30, 9.0)], "checkpoints-r1/test/loss": [(30, 7.0)]}


def test_evaluate_of_the_latest_checkpoint_keeps_the_final_evaluations_record(store, tmp_path, monkeypatch):
    """`orchestrator evaluate NAME --checkpoint latest` wrote to `evaluation/`, over the final evaluation's
    `test.metrics.json` and files. Now it goes to `evaluation/<checkpoint folder>/`, as `--checkpoint all` does,
    and the default (best) still rewrites the final record with the same scores. Ray's stored result, the
    checkpoint and the scoring are stood in for (the real ones: tests/test_orchestrator_runs.py, slow)."""
    uri, client, run_id = store
    storage = str(tmp_path / "runs")
    layout = RunLayout(storage, "r")
    layout.write_meta({"kind": "run"})
    folder = stored_run(Path(layout.folder))
    assert deliver_outputs(MlflowTracker(uri), run_id, str(folder))  # the end of the run
    final = {p.relative_to(folder): p.read_bytes() for p in (folder / "evaluation").rglob("*") if p.is_file()}

    @contextmanager
    def as_directory():
        yield str(tmp_path)

    def kept(step):
        return SimpleNamespace(path=str(folder / f"checkpoint_{step:09d}"), as_directory=as_directory)

    best, latest = kept(STEP), kept(30)
    reports = [(best, {"step": STEP, "val/ppl": 3.0}), (latest, {"step": 30, "val/ppl": 4.0})]
    result = SimpleNamespace(checkpoint=latest, metrics=reports[-1][1], best_checkpoints=reports)
    spec = validate_spec({"name": "r", "task": {"kind": "clm"}, "tracking": {"uri": uri}})
    scored_step = {}

    def score(directory, split, *, out_dir, **_):
        step = scored_step["step"]
        (out_dir / f"{split}.hyp").write_text(f"hypotheses of step {step}\n")
        return Evaluation(split, step, SCORES if step == STEP else {"test/loss": 9.0, "test/checkpoint_step": 30.0})

    monkeypatch.setattr(evaluate, "stored_result", lambda run_path: result)
    monkeypatch.setattr(evaluate, "read_checkpoint",
                        lambda directory: SimpleNamespace(spec=spec.model_dump(mode="json"), mlflow_run_id=run_id))
    monkeypatch.setattr(evaluate, "evaluate_checkpoint", score)

    scored_step["step"] = 30
    [latest_scored] = evaluate.evaluate_stored("r", storage, which="latest")
    assert latest_scored["outputs"] == str(folder / "evaluation" / "checkpoint_000000030")
    assert (folder / "evaluation" / "checkpoint_000000030" / "test.hyp").read_text() == "hypotheses of step 30\n"
    assert {p.relative_to(folder): p.read_bytes() for p in (folder / "evaluation").rglob("*")
            if p.is_file() and "checkpoint_000000030" not in p.parts} == final
    run = client.get_run(run_id)
    assert {k: v for k, v in run.data.metrics.items() if k.startswith("test/")} == SCORES
    assert run.data.metrics["checkpoints/test/loss"] == 9.0 and run.data.tags["test.checkpoint"] == "best (step 24)"

    scored_step["step"] = STEP  # the default, best: the final evaluation's own record, the same scores again
    [best_scored] = evaluate.evaluate_stored("r", storage)
    assert best_scored["outputs"] == str(folder / "evaluation")
    assert json.loads((folder / "evaluation" / "test.metrics.json").read_text())["metrics"] == SCORES
    assert points(client, run_id) == {key: {STEP: 1} for key in SCORES}
