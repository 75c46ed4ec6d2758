"""Write the fine-tuned runs of a downstream study (configs/studies/downstream_sst2.yaml) from its MLflow store
and storage, for RESULTS.md and the repository, so no number there is copied by hand:

- `runs.csv`: one row per fine-tuned run: attention kind and knobs, seed, attention / total parameters, dev
  accuracy at the last evaluation and at the best one (the checkpoint the final evaluation scored), test
  accuracy and macro F1 of that checkpoint, whether it was pretrained, the pretraining run's best val/ppl;
- `<label>-seed<seed>.test.pred`: the test-set predictions that were scored (one label a line, the test
  file's order), copied from `<run folder>/evaluation/`, so anyone can re-score them.

The PRR / PEoP table itself comes from `orchestrator report` on the same experiment.

    python -m benchmarks.studies.downstream_results --tracking-uri sqlite:///mlflow.db --experiment sst2-downstream \
        --out benchmarks/results/sst2-downstream
"""

from __future__ import annotations

import argparse
import csv
import shutil
from collections.abc import Sequence
from pathlib import Path

from orchestrator.storage import EVALUATION_DIR
from orchestrator.tracking.describe import CHECKPOINTS_TAG, ROLE_TAG
from orchestrator.tracking.read import TrackingReader

_KNOBS = ("mode", "k", "bucket_size", "n_hashes")


def _last(reader: TrackingReader, run_id: str, key: str) -> float | None:
    history = reader.metric_history(run_id, key)
    return history[-1].value if history else None


def _label(params: dict[str, str]) -> str:
    knobs = [f"{k}={params[f'model.attention.{k}']}" for k in _KNOBS
             if params.get(f"model.attention.{k}") not in (None, "None")]
    return " ".join([params["model.attention.kind"], *knobs])


def collect(uri: str, experiment: str, out: Path) -> list[dict[str, object]]:
    out.mkdir(parents=True, exist_ok=True)
    reader = TrackingReader(uri)
    experiment_id = reader.experiment_id(experiment)
    if experiment_id is None:
        raise ValueError(f"no experiment {experiment!r} in {uri}")
    rows = []
    for run in reader.runs_with_tag(experiment_id, ROLE_TAG, "trial") + reader.runs_with_tag(experiment_id, ROLE_TAG, "run"):
        run_id, params, tags = run.info.run_id, run.data.params, run.data.tags
        if _last(reader, run_id, "test/acc") is None:
            continue  # not finished: no final evaluation yet
        pretrain_run = tags.get("init_from.run_id")
        row = {"method": _label(params), "seed": params["optim.seed"],
               "params_attention": params.get("params.attention"), "params_total": params.get("params.total"),
               "dev_acc_last": _last(reader, run_id, "val/acc"), "dev_acc_best": _last(reader, run_id, "best/val/acc"),
               "test_acc": _last(reader, run_id, "test/acc"), "test_f1": _last(reader, run_id, "test/f1"),
               "pretrained": pretrain_run is not None,
               "pretrain_val_ppl": _last(reader, pretrain_run, "best/val/ppl") if pretrain_run else None,
               "run_id": run_id}
        rows.append(row)
        predictions = Path(tags[CHECKPOINTS_TAG]) / EVALUATION_DIR / "test.pred"
        if predictions.is_file():
            name = f"{row['method'].replace(' ', '_').replace('=', '')}-seed{row['seed']}.test.pred"
            shutil.copy(predictions, out / name)
    rows.sort(key=lambda r: (str(r["method"]), str(r["seed"])))
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["method"])
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", required=True)
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = collect(args.tracking_uri, args.experiment, args.out)
    for row in rows:
        print(f"{row['method']:<28} seed {row['seed']}  dev {row['dev_acc_best']:.4f} (last {row['dev_acc_last']:.4f})  "
              f"test {row['test_acc']:.4f}  f1 {row['test_f1']:.4f}")
    print(f"wrote {len(rows)} rows to {args.out / 'runs.csv'}")


if __name__ == "__main__":
    main()
