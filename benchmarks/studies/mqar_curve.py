"""Learning curve of one MQAR model: validation accuracy against training steps, in this process.

Associative recall is learned after a sharp phase change (an induction-style circuit: a head that binds each
value to its key, then one that matches the query's key), so a single final score hides whether a budget sits
just before or just after it. This trains one point of a study (configs/studies/long_range_mqar_zoology.yaml,
the MQAR that mha learns on a CPU, unless `--spec` names another) with the training core
(`orchestrator.launch.local_run.train_locally`, the loop every `orchestrator train` worker runs, without Ray or
MLflow), scores the validation split every `--eval-every` steps, and writes one CSV row per evaluation (`Curve`).
Chance is 1 / (vocab_size / 2).

    nice -n 10 python -m benchmarks.studies.mqar_curve --scale cpu --threads 1 --steps 2000 --eval-every 100 \\
        --eval-batches 8 --set 'model.attention={kind: mha, heads: 4}'

The CSV goes to <out>/long-range/mqar-curves/<name>.csv (`--out benchmarks/results`).

`--from-store URI --experiment NAME` instead reads the curves a sweep logged (every trial's val/acc by step,
from its MLflow store) into the same folder, one row per trial and evaluation, and prints the first step at
which each trial reached `--reached` (the phase change, which the report's seed-mean curve blurs).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from benchmarks.harness import Row, write_csv
from orchestrator.launch import train_locally
from orchestrator.report import ReportError, compared_runs, find_experiment_id, with_status
from orchestrator.spec import ExperimentSpec, load_spec
from orchestrator.tracking.read import TrackingReader
from orchestrator.training import Trainer

STUDY = "configs/studies/long_range_mqar_zoology.yaml"


class Curve:
    """One row per evaluation: the step, seconds since the start (evaluations included), the training window's
    loss and answers/s, and the validation metrics. The CSV is rewritten after every row, so a probe stopped by
    a time limit keeps the curve it reached."""

    def __init__(self, path: Path) -> None:
        self.path, self.start = path, time.perf_counter()
        self.rows: list[Row] = []

    def __call__(self, metrics: Mapping[str, float], step: int) -> None:
        if "val/acc" not in metrics:
            return
        row = {"step": step, "elapsed_s": round(time.perf_counter() - self.start, 1),
               "train_loss": float(metrics.get("train/loss", float("nan"))),
               "answers_per_s": float(metrics.get("train/tokens_per_s", float("nan"))),
               "val_loss": float(metrics["val/loss"]), "val_acc": float(metrics["val/acc"])}
        self.rows.append(row)
        write_csv(self.rows, self.path)
        print("[mqar] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in row.items()), flush=True)


def run(spec: ExperimentSpec, path: Path, cache_dir: Path) -> tuple[Curve, Trainer]:
    """Train `spec` in this process, writing its evaluation curve to `path`."""
    curve = Curve(path)
    trainer, _ = train_locally(spec, cache_dir=cache_dir, on_metrics=curve)
    return curve, trainer


def store_curves(uri: str, experiment: str, metric: str = "val/acc") -> list[Row]:
    """Every finished trial's `metric` by step from a sweep's MLflow store: kind, seed, step, value. The trials
    are the ones `orchestrator report` compares (orchestrator/report/runs.py): sweep parents are left out, and so is a trial
    stopped or still running, whose curve ends early."""
    reader = TrackingReader(uri)
    runs = reader.runs(find_experiment_id(reader, experiment, store_flag="--from-store"))
    trials, _ = with_status(compared_runs(runs, None, experiment), ["FINISHED"])
    rows: list[Row] = []
    for run in trials:
        params = run.data.params
        for point in reader.metric_history(run.info.run_id, metric):
            rows.append({"kind": params["model.attention.kind"], "seed": int(params["optim.seed"]),
                         "step": point.step, metric.replace("/", "_"): point.value})
    return sorted(rows, key=lambda row: (row["kind"], row["seed"], row["step"]))


def first_reached(rows: Sequence[Row], column: str, threshold: float) -> dict[tuple[str, int], int | None]:
    """(kind, seed) -> the first step whose `column` is >= threshold (None: never)."""
    out: dict[tuple[str, int], int | None] = {}
    for row in rows:
        key = (row["kind"], row["seed"])
        out.setdefault(key, None)
        if out[key] is None and row[column] >= threshold:
            out[key] = row["step"]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=STUDY)
    parser.add_argument("--scale", default="cpu", help="the spec's scale (its `scales:` entry)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="spec overrides; model.attention must name one point, e.g. "
                             "'model.attention={kind: mha, heads: 4}'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="mqar_curve", help="file stem of the CSV")
    parser.add_argument("--cache-dir", default=None, help="generated-data cache (default: a temporary folder)")
    parser.add_argument("--from-store", default=None, metavar="URI", help="read a sweep's curves from this store")
    parser.add_argument("--experiment", default=None, help="with --from-store: the sweep's MLflow experiment")
    parser.add_argument("--reached", type=float, default=0.9, help="with --from-store: the accuracy to report")
    args = parser.parse_args(argv)
    if args.from_store:
        try:
            rows = store_curves(args.from_store, args.experiment)
        except ReportError as error:  # a wrong --experiment or --from-store: the message names the fix
            raise SystemExit(str(error)) from None
        path = write_csv(rows, Path(args.out) / "long-range" / "mqar-curves" / f"{args.name}.csv")
        for (kind, seed), step in first_reached(rows, "val_acc", args.reached).items():
            print(f"{kind} seed {seed}: val/acc >= {args.reached} first at step {step}")
        print(f"wrote {path}")
        return
    torch.set_num_threads(args.threads)
    overrides = [f"optim.max_steps={args.steps}", f"run.eval_every={args.eval_every}",
                 f"run.checkpoint_every={args.steps}", f"task.eval_batches={args.eval_batches}",
                 f"run.log_every={args.eval_every}", *args.set]
    spec = load_spec(args.spec, overrides, scale=args.scale)
    path = Path(args.out) / "long-range" / "mqar-curves" / f"{args.name}.csv"
    with tempfile.TemporaryDirectory() as tmp:
        run(spec, path, Path(args.cache_dir or tmp))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
