"""Re-report a finished study with the report's statistics, without retraining: Student-t intervals over seeds,
each method against mha by the paired t-test over the seeds both ran (the exact sign-flip test beside it as a
check) with Holm's correction and Holm-adjusted intervals, PRR / PEoP delta-method intervals, power, the Pareto front.

Three sources, as a study kept them:
- `runs.csv` (one row per run: method, seed, sizes, scores; benchmarks/studies/downstream_results.py writes it from the
  store): the full report tables, from the same functions `orchestrator report` uses.

    python -m benchmarks.studies.rereport benchmarks/results/sst2-downstream --column dev_acc_last --metric val/acc
    python -m benchmarks.studies.rereport benchmarks/results/sst2-downstream --column test_acc --metric test/acc

- `--from-curves CSV`: a learning-curve file (kind, seed, step, <column>; benchmarks/studies/mqar_curve.py --from-store)
  whose last step per run is the run's score; it is written out as the study's `runs.csv` (sizes from the
  study's report.csv), then reported as above.

    python -m benchmarks.studies.rereport benchmarks/results/long-range/mqar-zoology --metric val/acc \
        --from-curves benchmarks/results/long-range/mqar-curves/study_cpu.csv --column val_acc

- `--from-report`: only the study's published `report.csv` (the per-seed scores are gone). A paired t-test
  depends on the differences only through their mean, standard error and count, and the published 95% t
  interval gives the standard error back: se = half-width / t(0.975, n - 1). So each paired row's t-test is
  recomputed exactly (its earlier sign-flip p, where that was the test, is kept as the check), Holm is applied
  again, and `statistics-rereported.md` / `.csv` hold the corrected verdicts. Welch rows keep their p (their
  degrees of freedom are not in the table, so their Holm-adjusted interval is left blank).

    python -m benchmarks.studies.rereport benchmarks/results/long-range/bytes --from-report --metric val/loss
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from scipy import stats as scipy_stats

from orchestrator.report import (
    PAIRED_T,
    SIGN_FLIP,
    Comparison,
    Interval,
    RunRecord,
    analyse,
    comparison_markdown,
    default_group_keys,
    group_runs,
    holm,
    holm_level,
    infer_mode,
    rows_to_frame,
    rows_to_markdown,
    summarize,
    verdict_of,
)

ALPHA = 0.05


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


def runs_from_curves(curves: Path, report: Path, column: str, out: Path) -> Path:
    """`out` (a runs.csv) from a curve file's last step per (kind, seed), with each method's sizes from the
    study's report.csv."""
    table = pd.read_csv(curves).sort_values("step")
    sizes = pd.read_csv(report).set_index("method")
    last = table.groupby(["kind", "seed"]).tail(1).sort_values(["kind", "seed"])
    rows = pd.DataFrame({
        "run_id": [f"{k}-seed{s}" for k, s in zip(last["kind"], last["seed"])], "method": last["kind"],
        "seed": last["seed"], "params_attention": [sizes.loc[k, "params_attention"] for k in last["kind"]],
        "params_total": [sizes.loc[k, "params_total"] for k in last["kind"]], "step": last["step"],
        column: last[column]})
    rows.to_csv(out, index=False)
    return out


def comparison_from_row(row: pd.Series) -> Comparison | None:
    """A published row's test, recomputed: paired rows from diff, the 95% t interval and n; Welch rows as they
    were (p only)."""
    if not isinstance(row["test"], str) or not row["test"]:
        return None
    n, diff = int(row["n_compared"]), float(row["diff"])
    if row["test"].startswith("Welch"):
        return Comparison(row["test"], n, diff, Interval(row["diff_ci_low"], row["diff_ci_high"]),
                          float(row["p_value"]), math.nan, math.nan, str(row.get("test_note", "")))
    half = (float(row["diff_ci_high"]) - float(row["diff_ci_low"])) / 2.0
    se = half / float(scipy_stats.t.ppf(1 - ALPHA / 2, n - 1))
    if se == 0.0 and diff != 0.0:
        # Every seed the same difference: no t statistic (the live report says so too, stats._paired); all n
        # differences share a sign, so the exact sign-flip test's p is its smallest, 2 / 2^n.
        return Comparison(SIGN_FLIP, n, diff, Interval.none(), 2.0 / 2**n, math.nan, math.nan,
                          "every seed gives the same difference", check_p=2.0 / 2**n, check_min_p=2.0 / 2**n)
    p_value = 1.0 if se == 0.0 else float(2.0 * scipy_stats.t.sf(abs(diff) / se, n - 1))
    check = float(row["p_value"]) if row["test"] == "exact sign-flip" else math.nan
    comparison = Comparison(PAIRED_T, n, diff, Interval.none(), p_value, math.nan, math.nan, "", se, n - 1.0,
                            check, 2.0 / 2**n)
    return comparison


def from_report(study: Path, metric: str) -> str:
    """statistics-rereported.md / .csv of a study that kept only its report.csv (see the module docstring)."""
    table = pd.read_csv(study / "report.csv")
    mode = infer_mode(metric)
    comparisons = {row["method"]: comparison_from_row(row) for _, row in table.iterrows()}
    tested = [m for m, c in comparisons.items() if c is not None]
    adjusted = dict(zip(tested, holm([comparisons[m].p_value for m in tested])))
    reference = table.loc[[c is None for c in comparisons.values()], "method"].iloc[0]
    lines = [f"# {study.name}: `{metric}`, re-reported from report.csv", "",
             f"Each method against {reference}: the paired t-test recomputed from the published difference, 95% t "
             f"interval and seed count; Holm's correction over {len(tested)} comparisons at alpha {ALPHA}; the "
             "interval at the Holm-adjusted level. `sign-flip p`: the exact sign-flip test the report used "
             "before (the check now). `old verdict`: what the report said.", "",
             f"| Method | Δ {metric} vs {reference} [95% CI, Holm-adjusted] | test | n | p | p (Holm) | verdict | "
             "sign-flip p | old verdict |", "|---|---|---|---|---|---|---|---|---|"]
    records = []
    for _, row in table.iterrows():
        comparison = comparisons[row["method"]]
        if comparison is None:
            continue
        p_holm = adjusted[row["method"]]
        interval = (comparison.interval(holm_level(ALPHA, comparison.p_value, p_holm))
                    if comparison.test == PAIRED_T else Interval.none())
        verdict = verdict_of(comparison, p_holm, ALPHA, mode)
        record = {"method": row["method"], "test": comparison.test, "n_compared": comparison.n,
                  "diff": comparison.diff, "diff_ci_holm_low": interval.low, "diff_ci_holm_high": interval.high,
                  "p_value": comparison.p_value, "p_holm": p_holm, "verdict": verdict,
                  "sign_flip_p": comparison.check_p, "old_test": row["test"], "old_verdict": row["verdict"]}
        records.append(record)
        low = "-" if math.isnan(interval.low) else f"{interval.low:+.4g}"
        high = "-" if math.isnan(interval.high) else f"{interval.high:+.4g}"
        check = "-" if math.isnan(comparison.check_p) else f"{comparison.check_p:.3g}"
        lines.append(f"| {row['method']} | {comparison.diff:+.4g} [{low}, {high}] | {comparison.test} | "
                     f"{comparison.n} | {comparison.p_value:.3g} | {p_holm:.3g} | {verdict} | {check} | "
                     f"{row['verdict']} |")
    text = "\n".join(lines) + "\n"
    (study / "statistics-rereported.md").write_text(text)
    pd.DataFrame(records).to_csv(study / "statistics-rereported.csv", index=False)
    return text


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path, help="folder holding runs.csv")
    parser.add_argument("--column", help="runs.csv (or --from-curves) column holding the score")
    parser.add_argument("--from-curves", type=Path, help="write runs.csv from this curve file first")
    parser.add_argument("--from-report", action="store_true", help="only report.csv is left: recompute its tests")
    parser.add_argument("--metric", required=True, help="the metric's name in the tables (its direction too)")
    parser.add_argument("--reference", default="mha")
    parser.add_argument("--lower-reference", default="sha")
    args = parser.parse_args(argv)
    if args.from_report:
        print(from_report(args.study, args.metric))
        return
    if args.column is None:
        parser.error("--column is required (the score's column)")
    if args.from_curves is not None:
        runs_from_curves(args.from_curves, args.study / "report.csv", args.column, args.study / "runs.csv")
    runs = records(args.study / "runs.csv", args.column, args.metric)
    mode = infer_mode(args.metric)
    summary = summarize(group_runs(runs, default_group_keys(runs)), args.metric, mode, args.reference,
                        args.lower_reference)
    stats = analyse(summary, mode)
    text = (f"# {args.study.name}: `{args.metric}` (runs.csv column `{args.column}`)\n\n"
            f"Mean [95% Student-t CI] over seeds; each method against {summary.reference} by the paired t-test over "
            f"the seeds both ran, Holm's correction over {stats.comparisons} comparisons at alpha 0.05, intervals "
            "of Δ at the Holm-adjusted level (orchestrator report's statistics).\n\n"
            + rows_to_markdown(summary.rows, args.metric, mode, stats) + "\n"
            + comparison_markdown(summary.rows, stats, summary.reference, args.metric))
    stem = f"statistics-{args.metric.replace('/', '_')}"
    (args.study / f"{stem}.md").write_text(text)
    rows_to_frame(summary.rows, stats).to_csv(args.study / f"{stem}.csv", index=False)
    print(text)


if __name__ == "__main__":
    main()
