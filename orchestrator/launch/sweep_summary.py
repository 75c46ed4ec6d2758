"""What a sweep's parent MLflow run shows once its trials ended: the comparison `orchestrator report` makes.

The parent gets the best trial (tags `sweep.best_trial`, `sweep.best_run_id`), a few summary metrics
(`best/<metric>`, `trials/total|finished|errored`, per method `prr/<method>`, `peop/<method>`, its difference to
the reference `diff/<method>` and Holm's p `p_holm/<method>`, per knob its fANOVA `importance/<knob>`), the
report's files under `report/` (tables as Markdown and CSV, plots, importance, parallel coordinates) and, as its
MLflow description (`mlflow.note.content`, shown on the run's page), the best trial, the PRR / PEoP table with
intervals and the tests against the reference. A sweep without the report's reference method (mha; e.g. mhe
against sha, or a learning-rate sweep of one kind) gets everything but PRR / PEoP and the tests, which need it; its
description says so and gives the `orchestrator report --reference ...` command that measures against one of its
methods. Tracking trouble here never fails the sweep: its trials are done; `orchestrator report` can redo this.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.console.progress import describe_config
from orchestrator.tracking.describe import MAX_TAG_CHARS, NOTE_TAG
from orchestrator.tracking.write import MlflowTracker

BEST_TRIAL_TAG = "sweep.best_trial"
BEST_RUN_TAG = "sweep.best_run_id"


def best_trial(trials: Sequence[Mapping[str, Any]], metric: str, mode: str) -> Mapping[str, Any] | None:
    """The trial with the best finite `metric` in its last report (errored trials included: their last
    evaluation still counts, as in Tune's own best result)."""
    scored = [t for t in trials if isinstance(t["metrics"].get(metric), (int, float))
              and t["metrics"][metric] == t["metrics"][metric]]
    if not scored:
        return None
    pick = min if mode == "min" else max
    return pick(scored, key=lambda t: t["metrics"][metric])


def metric_key(label: str) -> str:
    """A method label (`mhe heads=4 mode=mul`) as part of an MLflow metric name, which takes no `=`."""
    return re.sub(r"[^\w\-. :/]", ":", label)


def summary_metrics(trials: Sequence[Mapping[str, Any]], metric: str, mode: str,
                    rows: Sequence[Any] = (), report: Any = None) -> dict[str, float]:
    counts = {state: sum(t["state"] == state for t in trials) for state in ("done", "error")}
    metrics = {"trials/total": float(len(trials)), "trials/finished": float(counts["done"]),
               "trials/errored": float(counts["error"])}
    best = best_trial(trials, metric, mode)
    if best is not None:
        metrics[f"best/{metric}"] = float(best["metrics"][metric])
    for row in rows:
        for name in ("prr", "peop"):
            value = getattr(row, name)
            if value == value:  # NaN: not computed (the reference itself, or no lower reference)
                metrics[f"{name}/{metric_key(row.label)}"] = float(value)
    if report is not None and report.stats is not None:
        for label, row_stats in report.stats.rows.items():
            comparison = row_stats.comparison
            if comparison is not None and comparison.p_value == comparison.p_value:
                # The paired difference to the reference and Holm's p: sortable columns of the runs page.
                metrics[f"diff/{metric_key(label)}"] = float(comparison.diff)
                metrics[f"p_holm/{metric_key(label)}"] = float(row_stats.p_holm)
    for knob, value in (report.importance if report is not None else {}).items():
        metrics[f"importance/{metric_key(knob)}"] = float(value)
    return metrics


def note(name: str, metric: str, best: Mapping[str, Any] | None, table: str | None, problem: str | None,
         without_reference: str = "") -> str:
    lines = [f"## Sweep {name}", ""]
    if best is not None:
        lines.append(f"Best trial: **{describe_config(best['config']) or best['trial_id']}** "
                     f"({best['trial_id']}), {metric} = {best['metrics'][metric]:.4g}.")
    else:
        lines.append(f"No trial reported {metric}.")
    lines.append("")
    if table and without_reference:
        lines += [f"No PRR / PEoP: {without_reference}.", "", "Scores with intervals, costs and the Pareto front "
                  "(orchestrator report; files, importance and plots under the `report/` artifacts):", "", table]
    elif table:
        lines += ["PRR / PEoP and the tests against the reference (orchestrator report; files, importance and "
                  "plots under the `report/` artifacts):", "", table]
    elif problem:
        lines.append(f"No PRR / PEoP table: {problem}")
    return "\n".join(lines) + "\n"


def summarize_sweep(*, tracking_uri: str, tracker: MlflowTracker, experiment: str, parent_run_id: str | None,
                    name: str, trials: Sequence[Mapping[str, Any]], metric: str, mode: str,
                    out_dir: Path | None, objectives: Sequence[tuple[str, str]] = ()) -> str | None:
    """Log the comparison to the parent run; returns where the report's files are (None without them)."""
    if parent_run_id is None:
        return None
    # Deferred: the report's pandas and matplotlib, only once a sweep has a parent run to summarize.
    from orchestrator.report.build import ReportError, build_report, report_command, report_tables

    report, problem = None, None
    with tempfile.TemporaryDirectory(prefix="sweep-report-") as tmp:
        try:
            names = [name for name, _ in objectives] or metric
            modes = [sense for _, sense in objectives] or mode
            report = build_report(tracking_uri, experiment, metric=names, mode=modes,  # type: ignore[arg-type]
                                  parent_run_id=parent_run_id, out_dir=out_dir or Path(tmp), log_to_mlflow=True,
                                  missing_reference_ok=True)
        except ReportError as err:  # its fixes are options of `orchestrator report`, which the sweep does not take
            problem = f"{err} (options of `{report_command(tracking_uri, experiment, parent_run_id)}`)"
        except Exception as err:  # noqa: BLE001 - a tracking outage: the trials are done; report later
            problem = f"{type(err).__name__}: {str(err)[:300]}"
    best = best_trial(trials, metric, mode)
    rows = report.rows if report is not None else ()
    tracker.log_metrics(parent_run_id, summary_metrics(trials, metric, mode, rows, report), step=0)
    table = report_tables(rows, report.metric, report.mode, report.stats, report.reference) if report else None
    why = report.without_reference if report is not None else ""
    description = note(name, metric, best, table, problem, why)
    if len(description) > MAX_TAG_CHARS:  # a tag value's limit: the full tables are in report/report.md
        description = description[:MAX_TAG_CHARS - 80] + "\n\n(cut here: the full tables are in report/report.md)\n"
    tags = {NOTE_TAG: description}
    if best is not None:
        tags[BEST_TRIAL_TAG] = str(best["trial_id"])
        if best.get("mlflow_run_id"):
            tags[BEST_RUN_TAG] = best["mlflow_run_id"]
    tracker.set_tags(parent_run_id, tags)
    tracker.flush(parent_run_id, force=True)
    if problem or why:
        print(f"[{name}] no PRR / PEoP table on the sweep's MLflow run: {(problem or why).splitlines()[0]}")
    return str(out_dir) if report is not None and out_dir is not None else None


def best_of(candidates: Sequence[Mapping[str, Any]], metric: str, mode: str) -> dict[str, Any] | None:
    """The candidate ({"config", "metrics"}) with the best value of `metric`, or None when none has it. A sweep
    passes Tune's best over every trial's history and each trial's newest report: after an interrupt Tune's results
    lag the reports the trial folders hold (sweep.newest_report), which the trial lines show."""
    scored = [c for c in candidates
              if isinstance(value := c["metrics"].get(metric), (int, float)) and math.isfinite(value)]
    sign = 1.0 if mode == "min" else -1.0
    best = min(scored, key=lambda c: sign * c["metrics"][metric], default=None)
    return None if best is None else {"config": best["config"], "metrics": best["metrics"]}
