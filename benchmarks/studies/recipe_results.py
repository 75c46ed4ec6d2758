"""Write a recipe run's results from its MLflow store and storage folder, for RESULTS.md and the repository.

A recipe (configs/multi30k.yaml, configs/wikitext2.yaml) is trained with `orchestrator train`; this reads what
that run logged, so no number in RESULTS.md is copied by hand:

- `<stem>.final.json`: the `test/*` metrics of the final evaluation, `best/*`, the parameter counts, the
  steps, the wall-clock seconds from the first to the last training metric, the run id and the command;
- `<stem>.curve.csv`: every evaluation (step, val/* metrics, and validation/* from `orchestrator evaluate --split
  validation --checkpoint all`) and the train/loss logged at that step;
- `<stem>.test.hyp`: the test hypotheses the final evaluation scored (translation), from
  `<storage>/<run>/evaluation/`.

    python -m benchmarks.studies.recipe_results --tracking-uri sqlite:///mlflow.db --experiment recipes \
        --run multi30k-de-en --storage runs --stem multi30k --out benchmarks/results/recipes \
        --command "orchestrator train configs/multi30k.yaml"
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.storage import EVALUATION_DIR, RunLayout, resolve
from orchestrator.tracking.describe import RUN_KEY_TAG
from orchestrator.tracking.read import TrackingReader


def summarise(uri: str, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(final summary, evaluation curve rows) of one run."""
    reader = TrackingReader(uri)
    run = reader.run(run_id)
    keys = sorted(run.data.metrics)
    history = {key: [(m.step, m.value, m.timestamp) for m in reader.metric_history(run_id, key)] for key in keys}
    last = {key: rows[-1][1] for key, rows in history.items() if rows}
    train = history.get("train/loss", [])
    params, tags = run.data.params, run.data.tags
    summary: dict[str, Any] = {
        "run_id": run_id,
        "steps": max((step for step, _, _ in train), default=0),
        "train_wall_seconds": round((train[-1][2] - train[0][2]) / 1000, 1) if len(train) > 1 else None,
        "params.total": params.get("params.total"),
        "params.attention": params.get("params.attention"),
        "git.commit": tags.get("mlflow.source.git.commit") or tags.get("git.commit"),  # the older runs' tag
        "test.checkpoint": tags.get("test.checkpoint"),
        **{k: v for k, v in last.items() if k.startswith(("test/", "best/"))},
    }
    val_keys = sorted(k for k in keys if k.startswith(("val/", "validation/")))  # validation/*: evaluate --split validation
    by_step: dict[int, dict[str, Any]] = {}
    for key in val_keys:
        for step, value, _ in history[key]:
            by_step.setdefault(step, {"step": step})[key] = value
    train_at = {step: value for step, value, _ in train}
    curve = [{**row, "train/loss": train_at.get(step)} for step, row in sorted(by_step.items())]
    return summary, curve


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", required=True, help="the run's MLflow store (the spec's tracking.uri)")
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--run", required=True, help="the run name (the spec's name)")
    parser.add_argument("--storage", required=True, help="the spec's run.storage_path (finds the run by its key)")
    parser.add_argument("--stem", required=True, help="file stem, e.g. multi30k")
    parser.add_argument("--out", default="benchmarks/results/recipes")
    parser.add_argument("--command", required=True, help="the command that trained the run (recorded as is)")
    args = parser.parse_args(argv)
    # The run's key: where `orchestrator train` stored it (the run's name alone may be reused by another store).
    key = RunLayout(resolve(args.storage), args.run).folder
    run_id = TrackingReader(args.tracking_uri).run_of(args.experiment, RUN_KEY_TAG, key)
    summary, curve = summarise(args.tracking_uri, run_id)
    summary["command"] = args.command
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.final.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / f"{args.stem}.curve.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for row in curve for k in row)))
        writer.writeheader()
        writer.writerows(curve)
    hypotheses = Path(key) / EVALUATION_DIR / "test.hyp"
    if hypotheses.exists():
        shutil.copy(hypotheses, out / f"{args.stem}.test.hyp")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
