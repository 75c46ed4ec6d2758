"""Re-report a finished study from its per-run CSV (benchmarks/downstream_results.py's `runs.csv`) with the
report's statistics: Student-t intervals over seeds, each method against mha paired by seed (exact sign-flip
test with few seeds) with Holm's correction, PRR / PEoP bootstrap intervals, power, and the Pareto front.

For a study whose MLflow store is gone but whose per-run numbers were written out: the numbers come from
`runs.csv` (written from the store by downstream_results.py), the statistics from the same functions
`orchestrator report` uses (orchestrator/report/metrics.py, compare.py, tables.py).

    python -m benchmarks.rereport benchmarks/results/sst2-downstream --column dev_acc_last --metric val/acc
    python -m benchmarks.rereport benchmarks/results/sst2-downstream --column test_acc --metric test/acc
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from pathlib import Path

from orchestrator.report import analyse, RunRecord, default_group_keys, group_runs, infer_mode, summarize
from orchestrator.report import comparison_markdown, rows_to_frame, rows_to_markdown


def records(path: Path, column: str, metric: str) -> list[RunRecord]:
    """One record per row of runs.csv: its method label split back into the logged params, seed, sizes."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            kind, *knobs = row["method"].split()
            params = {"model.attention.kind": kind, "optim.seed": row["seed"],
                      "params.attention": row["params_attention"], "params.total": row["params_total"]}
            params.update({f"model.attention.{k}": v for k, v in (knob.split("=", 1) for knob in knobs)})
            out.append(RunRecord(row["run_id"], params, {metric: float(row[column])}))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path, help="folder holding runs.csv")
    parser.add_argument("--column", required=True, help="runs.csv column holding the score")
    parser.add_argument("--metric", required=True, help="the metric's name in the tables (its direction too)")
    parser.add_argument("--reference", default="mha")
    parser.add_argument("--lower-reference", default="sha")
    args = parser.parse_args(argv)
    runs = records(args.study / "runs.csv", args.column, args.metric)
    mode = infer_mode(args.metric)
    summary = summarize(group_runs(runs, default_group_keys(runs)), args.metric, mode, args.reference,
                        args.lower_reference)
    stats = analyse(summary, mode)
    text = (f"# {args.study.name}: `{args.metric}` (runs.csv column `{args.column}`)\n\n"
            f"Mean [95% Student-t CI] over seeds; each method against {summary.reference} paired by seed, Holm's "
            f"correction over {stats.comparisons} comparisons at alpha 0.05 (orchestrator report's statistics).\n\n"
            + rows_to_markdown(summary.rows, args.metric, mode, stats) + "\n"
            + comparison_markdown(summary.rows, stats, summary.reference, args.metric))
    stem = f"statistics-{args.metric.replace('/', '_')}"
    (args.study / f"{stem}.md").write_text(text)
    rows_to_frame(summary.rows, stats).to_csv(args.study / f"{stem}.csv", index=False)
    print(text)


if __name__ == "__main__":
    main()
