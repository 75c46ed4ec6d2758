"""Part (e) of benchmarks.gpu.suite: a 2-trial `orchestrator sweep` on the suite's GPU with `run.precision: bf16`,
`run.strategy: fsdp` and `run.compile: true`, through the project's own launch path (`study_from_raw` and
`run_sweep`, as the CLI calls them: Tune, one Ray Train run per trial, MLflow parent and child runs), then
checked from its MLflow store: the parent and both children FINISHED, each child with its validation metric, the
precision, strategy and compile settings it logged, its `flops_per_token` param and, on a GPU of the table
(orchestrator/spec/gpus.py), `train/mfu` beside `train/tokens_per_s` (a dry run on the CPU must log no MFU).

The spec is the smallest masked-LM sweep (built-in corpus, a grid of two learning rates). On a GPU the two trials
share it (`run.gpus_per_worker: 0.5`, one worker each, so both run at once), each FSDP-wrapped over its one
worker, compiled with inductor. Its runs and its SQLite store are in `<out>/<machine>/sweep/` (git ignores
`runs/`, `mlflow.db` and `mlartifacts/`), replaced by each run of the suite: `mlflow ui --backend-store-uri
sqlite:///<that folder>/mlflow.db` shows the last one.

A dry run trains on the CPU with the same settings (bf16 autocast and FSDP2 over gloo both run there: a few steps
of a toy model, the aot_eager compile backend, which traces without inductor's code generation).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.common import PartResult, SuiteContext
from benchmarks.harness import Row
from orchestrator.launch import run_sweep
from orchestrator.spec import peak_bf16_flops, study_from_raw
from orchestrator.tracking.read import TrackingReader

NAME = "gpu-suite-sweep"
PRECISION, STRATEGY = "bf16", "fsdp"
LEARNING_RATES = (1e-3, 3e-3)
METRIC = "val/ppl"


def sweep_raw(ctx: SuiteContext, folder: Path, precision: str, strategy: str) -> dict[str, Any]:
    """The sweep's spec: 2 trials (a grid of learning rates) of the smallest masked LM."""
    gpu = not ctx.dry_run
    seq_len = 128 if gpu else 16
    return {
        "name": NAME,
        "task": {"kind": "mlm", "seq_len": seq_len, "batch_size": 32 if gpu else 4, "vocab_size": 1000 if gpu else 120,
                 "eval_batches": 2, "builtin": {"train_sentences": 2000 if gpu else 300, "eval_sentences": 60 if gpu else 30}},
        "model": {"d_model": 128 if gpu else 16, "layers": 2 if gpu else 1, "ffn": 512 if gpu else 32,
                  "max_seq_len": seq_len, "dropout": 0.0, "attention": {"kind": "mha", "heads": 4 if gpu else 2}},
        "optim": {"lr": {"grid": list(LEARNING_RATES)}, "max_steps": 30 if gpu else 2, "warmup_steps": 1, "seed": 0},
        "run": {"precision": precision, "strategy": strategy, "compile": True,
                "compile_backend": "inductor" if gpu else "aot_eager", "workers": 1,
                "gpus_per_worker": 0.5 if gpu else 0, "cpus_per_worker": 1, "checkpoint_every": 30 if gpu else 2,
                "eval_every": 10 if gpu else 2, "log_every": 5 if gpu else 1, "storage_path": str(folder / "runs")},
        "tune": {"scheduler": "fifo", "metric": METRIC, "mode": "min"},
        "tracking": {"uri": f"sqlite:///{folder / 'mlflow.db'}"},
    }


def mlflow_rows(uri: str, parent_run_id: str | None, gpu: bool = False) -> tuple[list[Row], list[str]]:
    """One row per run of the sweep as MLflow holds it, and what is wrong with them; `gpu`: the trials ran on a GPU
    of the table, so each must have logged train/mfu (on a CPU, none may)."""
    reader = TrackingReader(uri)
    experiment_id = reader.experiment_id(NAME)
    if experiment_id is None or parent_run_id is None:
        return [], [f"no MLflow experiment {NAME} or no parent run in {uri}"]
    parent = reader.run(parent_run_id)
    rows: list[Row] = [{"run": "parent", "run_id": parent_run_id, "status": parent.info.status}]
    problems = [] if parent.info.status == "FINISHED" else [f"parent run {parent.info.status}"]
    children = reader.children(experiment_id, parent_run_id)
    if len(children) != len(LEARNING_RATES):
        problems.append(f"{len(children)} child runs, expected {len(LEARNING_RATES)}")
    for child in sorted(children, key=lambda run: float(run.data.params.get("optim.lr", "nan"))):
        params, metrics = child.data.params, child.data.metrics
        row: Row = {"run": "trial", "run_id": child.info.run_id, "status": child.info.status,
                    **{key: params.get(key, "") for key in ("optim.lr", "run.precision", "run.strategy", "run.compile",
                                                            "run.compile_backend")},
                    "device": child.data.tags.get("device.name", ""),
                    "flops_per_token": params.get("flops_per_token", ""),
                    **{key: metrics.get(key, "") for key in ("train/loss", "train/tokens_per_s", "train/mfu", METRIC,
                                                             "test/ppl")}}
        rows.append(row)
        if child.info.status != "FINISHED":
            problems.append(f"trial run {child.info.run_id} {child.info.status}")
        if METRIC not in metrics:
            problems.append(f"trial run {child.info.run_id} has no {METRIC}")
        if "flops_per_token" not in params:
            problems.append(f"trial run {child.info.run_id} logged no flops_per_token")
        if gpu and "train/mfu" not in metrics:
            problems.append(f"trial run {child.info.run_id} logged no train/mfu on {row['device']}")
        if not gpu and "train/mfu" in metrics:
            problems.append(f"trial run {child.info.run_id} logged train/mfu on a CPU, against a guessed peak")
    return rows, problems


def run(ctx: SuiteContext) -> PartResult:
    folder = ctx.folder / "sweep"
    # The suite's own folder: each run of the suite sweeps afresh (a second sweep of the same name would be refused
    # as the first one's `orchestrator resume`).
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    ctx.case_started("the 2-trial sweep")
    study = study_from_raw(sweep_raw(ctx, folder, PRECISION, STRATEGY))
    run_settings = study.base.run
    precision, strategy = run_settings.precision, run_settings.strategy
    print(f"  sweep: 2 trials, precision={precision} strategy={strategy} compile={run_settings.compile_backend}",
          flush=True)
    outcome = run_sweep(study)
    gpu = not ctx.dry_run and peak_bf16_flops(torch.cuda.get_device_name(ctx.device)) is not None
    rows, problems = mlflow_rows(study.base.tracking.uri, outcome.parent_run_id, gpu)
    ctx.record(rows)
    ctx.case_finished()
    if outcome.errors:
        problems.insert(0, "; ".join(f"trial {t['trial_id']}: {t['error']}" for t in outcome.trials if t["error"]))
    settings = {"precision": precision, "strategy": strategy, "compile": f"true ({run_settings.compile_backend})",
                "gpus_per_worker": run_settings.gpus_per_worker, "store": f"{folder.name}/mlflow.db"}
    note = f"ran precision={precision}, strategy={strategy}, compile=true ({run_settings.compile_backend})"
    status = f"fail: {'; '.join(problems)}" if problems else ctx.passed
    return PartResult(rows, status, note, settings)
