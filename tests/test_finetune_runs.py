"""Pretrain, then fine-tune, on the session's local Ray: a two-stage sweep trial runs both stages with their own
MLflow runs linked by lineage tags, scores the fine-tuned model on the test split (predictions kept), and the
report compares the fine-tuned runs only; a single run fine-tunes from an MLflow run id with a frozen encoder."""

from __future__ import annotations

import re

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from benchmarks.studies.downstream_results import collect
from orchestrator.launch.pretrained import CHECKPOINTS_TAG
from orchestrator.launch.run import run_training
from orchestrator.launch.sweep import run_sweep
from orchestrator.report.build import build_report
from orchestrator.spec import study_from_raw, validate_spec
from orchestrator.storage.layout import trained_to
from orchestrator.tracking.describe import PARENT_TAG, ROLE_TAG
from orchestrator.training.checkpoint import read_checkpoint

EVAL_SENTENCES = 24


def two_stage_spec(name: str, root: Path) -> dict:
    return {
        "name": name,
        "pretrain": {"task": {"kind": "mlm", "seq_len": 32, "batch_size": 8, "vocab_size": 150, "eval_batches": 2,
                              "builtin": {"train_sentences": 300, "eval_sentences": 30, "lexicon_size": 12}},
                     "optim": {"lr": 3e-3, "max_steps": 4, "warmup_steps": 1},
                     "run": {"final_eval": False}},
        "task": {"kind": "classify", "num_classes": 3, "max_len": 32, "batch_size": 8,
                 "builtin": {"train_sentences": 120, "eval_sentences": EVAL_SENTENCES, "lexicon_size": 12}},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 32, "attention": {"kind": "mha", "heads": 2}},
        "optim": {"lr": 3e-3, "max_steps": 4, "warmup_steps": 1, "seed": 3},
        "run": {"checkpoint_every": 2, "eval_every": 2, "log_every": 1, "storage_path": str(root / "runs")},
        "tune": {"scheduler": "fifo"},
        "tracking": {"uri": f"sqlite:///{root / 'mlflow.db'}", "retries": 2, "timeout_s": 2},
    }


@pytest.mark.slow
def test_two_stage_trial_pretrains_fine_tunes_and_links_the_runs(ray_cluster, tmp_path):
    raw = two_stage_spec("two-stage", tmp_path)
    outcome = run_sweep(study_from_raw(raw))
    assert outcome.errors == 0 and len(outcome.trials) == 1

    client = MlflowClient(raw["tracking"]["uri"])
    runs = client.search_runs([client.get_experiment_by_name("two-stage").experiment_id])
    by_role = {run.data.tags.get(ROLE_TAG): run for run in runs}
    assert set(by_role) == {"sweep", "pretrain", "trial"}
    pretrain, finetune = by_role["pretrain"], by_role["trial"]
    for run in (pretrain, finetune):
        assert run.info.status == "FINISHED"
        assert run.data.tags[PARENT_TAG] == outcome.parent_run_id  # both grouped under the sweep in the UI
    assert pretrain.data.params["task.kind"] == "mlm" and "val/ppl" in pretrain.data.metrics
    assert {"val/acc", "val/f1", "test/acc", "test/f1"} <= set(finetune.data.metrics)
    # lineage: the fine-tuning run names the pretraining run, its checkpoint and step
    assert finetune.data.tags["init_from.run_id"] == pretrain.info.run_id
    assert finetune.data.tags["init_from.step"] == "4"
    pretrain_folder = Path(pretrain.data.tags[CHECKPOINTS_TAG])
    # the checkpoint by its folder name (a path of this machine's would mean nothing on another)
    started_from = pretrain_folder / finetune.data.tags["init_from.checkpoint"]
    assert re.fullmatch(r"checkpoint_\d{9}", started_from.name) and (started_from / "state.pt").is_file()
    # a resumed trial skips a stage that checkpointed its last step, and only then
    assert trained_to(str(pretrain_folder), 4) and not trained_to(str(pretrain_folder), 5)

    # the fine-tuned checkpoints keep the pretraining tokenizer; the test predictions are one label a line
    finetune_folder = Path(finetune.data.tags[CHECKPOINTS_TAG])
    checkpoint = sorted(finetune_folder.glob("checkpoint_0*"))[-1]
    assert (checkpoint / "tokenizer.model").read_bytes() == \
        (started_from / "tokenizer.model").read_bytes()
    predictions = (finetune_folder / "evaluation" / "test.pred").read_text().split()
    assert len(predictions) == EVAL_SENTENCES and set(predictions) <= {"0", "1", "2"}

    # the report compares the fine-tuned run on the downstream metric, not the pretraining run
    report = build_report(raw["tracking"]["uri"], "two-stage", parent_run_id=outcome.parent_run_id,
                          out_dir=tmp_path / "report", log_to_mlflow=False, lower_reference=None)
    assert report.metric == "val/acc"
    assert [run_id for row in report.rows for run_id in row.run_ids] == [finetune.info.run_id]
    # the results script reads the same numbers from the store and keeps the scored predictions
    rows = collect(raw["tracking"]["uri"], "two-stage", tmp_path / "results")
    assert [(r["method"], r["run_id"], r["test_acc"], r["pretrained"]) for r in rows] == \
        [("mha", finetune.info.run_id, finetune.data.metrics["test/acc"], True)]
    assert (tmp_path / "results" / "mha-seed3.test.pred").read_text().split() == predictions

    # fine-tune again from the pretraining run's MLflow run id, the encoder frozen: a plain run
    single = validate_spec({**{k: v for k, v in raw.items() if k not in ("pretrain", "tune")}, "name": "probe",
                            "model": {**raw["model"], "init_from": pretrain.info.run_id, "freeze": "encoder"}})
    result = run_training(single)
    assert result.metrics["step"] == 4
    start = read_checkpoint(started_from).model
    end = read_checkpoint(Path(result.checkpoint)).model
    frozen = [name for name in start if name.startswith(("embed.", "stack."))]
    assert frozen and all(torch.equal(start[name], end[name]) for name in frozen)
    probe = client.get_run(result.mlflow_run_id)
    assert probe.data.tags["init_from.run_id"] == pretrain.info.run_id
