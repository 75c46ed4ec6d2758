"""`orchestrator report`: compare the methods of an MLflow experiment the way the MHE paper does.

Reads the runs of one experiment (or the trials of one sweep), groups seeds of the same method
configuration, and writes a PRR / PEoP table (Markdown + CSV) and plots to a folder, which it also
logs as artifacts under `report/` of the sweep's parent run so the comparison sits next to the runs
in the MLflow UI. The formulas live in `report_metrics`, the table formatting in `report_tables`,
the figures in `report_plots`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from orchestrator.report.compare import Statistics, analyse
from orchestrator.report.importance import importance, importance_markdown
from orchestrator.report.metrics import (
    MethodGroup,
    MethodRow,
    Mode,
    ReportError,
    RunRecord,
    Summary,
    group_keys,
    groups_with_metric,
    param_value,
    summarize,
)
from orchestrator.report.objectives import (
    TrialObjectives,
    as_list,
    check_objectives,
    objectives_markdown,
    trial_objectives,
    write_objectives,
)
from orchestrator.report.patching import REFERENCE, PatchingReport, is_patching, patching_markdown, patching_report
from orchestrator.report.plots import (
    find_knob_sweeps,
    knob_plot_name,
    plot_cost_front,
    plot_curves,
    plot_knob_sweep,
    plot_score_vs_params,
)
from orchestrator.report.runs import (
    REPORT_TAG,
    check_store_exists,
    compared_runs,
    counts,
    find_experiment_id,
    parent_ids,
    with_status,
)
from orchestrator.report.tables import comparison_markdown, markdown_document, rows_to_frame, rows_to_markdown
from orchestrator.tracking.describe import PARENT_TAG
from orchestrator.tracking.read import Run, TrackingReader
from orchestrator.tracking.write import log_files, new_run

__all__ = ["Report", "ReportError", "build_report", "report_cli", "report_command", "report_tables"]

ARTIFACT_DIR = "report"
# Metrics tried in order when neither --metric nor the spec's `tune.metric` names one.
_DEFAULT_METRICS = ("val/bleu", "val/ppl", "val/loss")


@dataclass(frozen=True)
class Report:
    """What `build_report` produced: the table as rows and data, the files, and where they were logged."""

    experiment: str
    metric: str
    mode: Mode
    reference: str | None
    """None: no PRR reference, and so no PRR, PEoP or tests against it (`without_reference` says why)."""
    lower_reference: str | None
    rows: list[MethodRow]
    table: pd.DataFrame
    markdown: str
    out_dir: Path
    files: list[Path]
    mlflow_run_id: str | None
    warnings: list[str]
    stats: Statistics | None = None
    """Intervals, tests against the reference, verdicts, power and Pareto fronts (report_compare)."""
    importance: Mapping[str, float] = field(default_factory=dict)
    """fANOVA importance of each knob that varied among the runs (report_importance); empty without knobs."""
    objectives: TrialObjectives | None = None
    """With several objectives: every run's values and whether it is non-dominated (report_objectives)."""
    patching: PatchingReport | None = None
    """A patching experiment's (task.kind pretrained_lm) rows by configuration and l against l = 0 (report_patching)."""
    without_reference: str = ""
    """Why the report has no PRR / PEoP or tests against a reference; empty when it has them."""


def build_report(
    tracking_uri: str,
    experiment: str,
    *,
    metric: str | Sequence[str] | None = None,
    mode: Mode | Sequence[Mode] | None = None,
    parent_run_id: str | None = None,
    reference: str | None = "mha",
    lower_reference: str | None = "sha",
    missing_reference_ok: bool = False,
    group_by: Sequence[str] | None = None,
    out_dir: Path,
    log_to_mlflow: bool = True,
    statuses: Sequence[str] | None = ("FINISHED",),
    alpha: float = 0.05,
    bootstrap: bool = False,
) -> Report:
    """Build the comparison report of `experiment` (or of the sweep `parent_run_id`) into `out_dir`.

    `metric` defaults to the spec's `tune.metric` param; `mode` defaults to the spec's `tune.mode`
    for that metric, else it is inferred from the metric name. `reference` / `lower_reference` name
    the methods PRR / PEoP are measured against, by kind ("mha") or by full label ("mha heads=12");
    `lower_reference=None` (or "none") skips PEoP; `reference=None` (or "none") skips PRR, PEoP and the tests, as
    does a reference not found with `missing_reference_ok` (a sweep's summary). Only runs whose MLflow status is in
    `statuses` are compared (default FINISHED: a run that failed, was stopped early by ASHA or interrupted ended at
    whatever its last value was); None compares every run. Several metrics (a list, or the spec's list
    `tune.metric`) are objectives: the first is compared in the table, and every run is marked non-dominated or not
    over all of them. `alpha` sets the tests' level and the intervals' (1 - alpha); `bootstrap` adds a bootstrap
    interval of each method's mean.

    Raises ReportError with a fix when the runs cannot be compared. Problems that still leave a
    useful table (no lower reference, skipped runs) are returned in `Report.warnings` and written
    into report.md rather than logged, so the caller decides how to show them.
    """
    if not 0.0 < alpha < 0.5:
        raise ReportError(f"--alpha {alpha}: the tests' level must be in (0, 0.5), e.g. 0.05 for 95% intervals")
    reference, lower_reference = (None if name is None or name.strip().lower() in ("", "none") else name
                                  for name in (reference, lower_reference))
    check_store_exists(tracking_uri)
    reader = TrackingReader(tracking_uri)
    experiment_id = find_experiment_id(reader, experiment)
    all_runs = reader.runs(experiment_id)
    runs, left_out = with_status(compared_runs(all_runs, parent_run_id, experiment), statuses)
    records = [RunRecord(run.info.run_id, dict(run.data.params), dict(run.data.metrics)) for run in runs]

    names, modes = _choose_objectives(records, metric, mode)
    metric, mode = names[0], modes[0]
    if is_patching(records):
        return _patching(tracking_uri, experiment, experiment_id, all_runs, records, metric, mode, parent_run_id,
                         Path(out_dir), log_to_mlflow, alpha, bootstrap, _status_warnings(left_out, records, metric),
                         group_by is not None or reference != "mha" or len(names) > 1)
    keys = group_keys(records, group_by)
    groups = groups_with_metric(records, keys, metric)
    summary = summarize(groups, metric, mode, reference, lower_reference, missing_reference_ok=missing_reference_ok)
    stats = analyse(summary, mode, alpha=alpha, bootstrap=bootstrap)
    why = "" if summary.reference is not None else "`--reference none` asked for none" if reference is None else \
        _missing_reference(tracking_uri, experiment, parent_run_id, reference, lower_reference, summary)
    warnings = list(summary.warnings) + _status_warnings(left_out, records, metric)
    skipped = sum(metric not in record.metrics for record in records)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = rows_to_frame(summary.rows, stats)
    files = [out_dir / "report.csv"]
    table.to_csv(files[0], index=False)
    extra = []
    scored = [record for record in records if metric in record.metrics]
    objectives = None
    if len(names) > 1:
        labels = {run.run_id: group.label for group in groups for run in group.runs}
        objectives = trial_objectives(scored, labels, names, modes)
        files.append(write_objectives(objectives, out_dir))
        extra.append(objectives_markdown(objectives))
    importance_scores, importance_files = importance(scored, metric, mode, out_dir, warnings)
    files += importance_files
    extra.append(importance_markdown(importance_scores, metric))
    files += _write_plots(reader, groups, summary, stats, metric, mode, out_dir)
    scope = f"children of parent run {parent_run_id}" if parent_run_id else "all runs of the experiment"
    markdown = markdown_document(experiment, metric, mode, summary, scope, len(records) - skipped, warnings, files,
                                 stats, [section for section in extra if section], without_reference=why)
    (out_dir / "report.md").write_text(markdown)
    files.insert(0, out_dir / "report.md")

    mlflow_run_id = _log(tracking_uri, experiment_id, all_runs, parent_run_id, files) if log_to_mlflow else None
    return Report(experiment=experiment, metric=metric, mode=mode, reference=summary.reference,
                  lower_reference=summary.lower_reference, rows=summary.rows, table=table, markdown=markdown,
                  out_dir=out_dir, files=files, mlflow_run_id=mlflow_run_id, warnings=warnings, stats=stats,
                  importance=importance_scores, objectives=objectives, without_reference=why)


def report_command(tracking_uri: str, experiment: str, parent_run_id: str | None, *options: str) -> str:
    """The `orchestrator report` command line that reads these runs again, with `options`."""
    command = ["orchestrator", "report", "--experiment", experiment, *options]
    command += ["--tracking-uri", tracking_uri] if tracking_uri != _parser().get_default("tracking_uri") else []
    return shlex.join(command + (["--parent-run", parent_run_id] if parent_run_id else []))


def _missing_reference(uri: str, experiment: str, parent: str | None, reference: str, lower: str | None,
                       summary: Summary) -> str:
    """Why a sweep's report has no PRR, and the command that gives the table against one of its methods."""
    labels = [row.label for row in summary.rows]
    pick = next((row.label for row in summary.rows if lower in (row.kind, row.label)), labels[0])
    command = report_command(uri, experiment, parent, "--reference", pick)
    return f"reference method {reference!r} not found among the methods ({', '.join(map(repr, labels))}); " \
           f"for PRR / PEoP against one of them: `{command}`"


def report_tables(rows: Sequence[MethodRow], metric: str, mode: Mode, stats: Statistics | None,
                  reference: str | None) -> str:
    """The table of the methods and the tests against the reference, as the command prints them and a sweep's
    description shows them; without a reference (statistics of a report without one) no PRR, PEoP or tests."""
    table = rows_to_markdown(rows, metric, mode, stats)
    if reference is None or stats is None:
        return table
    return table + "\n" + comparison_markdown(rows, stats, reference, metric)


def _status_warnings(left_out: Mapping[str, int], records: Sequence[RunRecord], metric: str) -> list[str]:
    warnings = []
    if left_out:
        warnings.append(f"{sum(left_out.values())} run(s) left out by status ({counts(left_out)}: failed, stopped "
                        "early by ASHA, interrupted or still running); `--status all` compares them at their last value")
    if skipped := sum(metric not in record.metrics for record in records):
        warnings.append(f"{skipped} run(s) without {metric!r} skipped (crashed or stopped before evaluation?)")
    return warnings


def _log(tracking_uri: str, experiment_id: str, all_runs: Sequence[Run], parent_run_id: str | None,
         files: Sequence[Path]) -> str:
    """Log the report's files under `report/` of the sweep's parent, else of a new report run; its id."""
    run_id = parent_run_id or _single_parent(all_runs) or \
        new_run(tracking_uri, experiment_id, run_name="report", tags={REPORT_TAG: "true"})
    log_files(tracking_uri, run_id, files, artifact_path=ARTIFACT_DIR)
    return run_id


def _patching(tracking_uri: str, experiment: str, experiment_id: str, all_runs: Sequence[Run],
              records: Sequence[RunRecord], metric: str, mode: Mode, parent_run_id: str | None, out_dir: Path,
              log_to_mlflow: bool, alpha: float, bootstrap: bool, warnings: list[str], ignored: bool) -> Report:
    """The report of a patching experiment (report_patching): rows by mechanism configuration and l against l = 0."""
    if ignored:
        warnings.append("--reference, --group-by and further objectives do not apply to a patching experiment "
                        "(task.kind pretrained_lm): rows are (configuration, l), the reference the unpatched model")
    scope = f"children of parent run {parent_run_id}" if parent_run_id else "all runs of the experiment"
    built = patching_report(records, metric, mode, out_dir, alpha=alpha, bootstrap=bootstrap, warnings=warnings,
                            experiment=experiment, scope=scope)
    (out_dir / "report.md").write_text(built.markdown)
    files = [out_dir / "report.md", *built.files]
    return Report(experiment=experiment, metric=metric, mode=mode, reference=built.summary.reference,
                  lower_reference=None, rows=built.summary.rows, table=built.table, markdown=built.markdown,
                  out_dir=out_dir, files=files, warnings=warnings, stats=built.stats, importance=built.importance,
                  mlflow_run_id=_log(tracking_uri, experiment_id, all_runs, parent_run_id, files) if log_to_mlflow
                  else None, patching=built)


def _spec_setting(records: Sequence[RunRecord], key: str) -> str | None:
    """A spec param (e.g. `tune.metric`) when all runs that logged it agree, else None."""
    values = {param_value(record.params, key) for record in records} - {None}
    return values.pop() if len(values) == 1 else None


def _choose_objectives(records: Sequence[RunRecord], metric: str | Sequence[str] | None,
                       mode: Mode | Sequence[Mode] | None) -> tuple[list[str], list[Mode]]:
    """The compared metric(s) and direction(s): explicit, else the spec's tune settings, else defaults. The first
    is the table's metric; it must be a metric some run logged."""
    available = sorted({name for record in records for name in record.metrics})
    spec_names = as_list(_spec_setting(records, "tune.metric"))
    names = as_list(metric) if isinstance(metric, str) else list(metric) if metric is not None else None
    if names is None:
        default = next((name for name in _DEFAULT_METRICS if name in available), None)
        names = spec_names or ([default] if default else None)
        if names is None:
            raise ReportError(
                f"no metric given and none of {list(_DEFAULT_METRICS)} was logged; "
                f"pass --metric with one of: {', '.join(available) or '(no metrics logged)'}"
            )
    if not any(names[0] in record.metrics for record in records):
        raise ReportError(
            f"no run logged the metric {names[0]!r}; metrics that exist: "
            f"{', '.join(available) or '(no metrics logged)'}. Pass one of them to --metric."
        )
    modes = as_list(mode) if isinstance(mode, str) else list(mode) if mode is not None else None
    if modes is None:
        spec_modes = as_list(_spec_setting(records, "tune.mode"))
        same = spec_names is not None and spec_modes is not None and len(spec_modes) == len(spec_names)
        by_name = dict(zip(spec_names, spec_modes)) if same else {}  # type: ignore[arg-type]
        modes = [by_name.get(name) for name in names]
    return names, check_objectives(records, names, modes)


def _seed_mean_curve(reader: TrackingReader, group: MethodGroup, metric: str) -> pd.Series:
    """Mean over seeds of the metric history, step by step (steps a seed lacks are skipped)."""
    per_run = []
    for run in group.runs:
        history = reader.metric_history(run.run_id, metric)
        if history:
            # A resumed run may log a step twice; the later value is the one that continued.
            values = {point.step: point.value for point in history}
            per_run.append(pd.Series(values, dtype=float))
    if not per_run:
        return pd.Series(dtype=float)
    return pd.concat(per_run, axis=1).mean(axis=1, skipna=True).sort_index()


def _write_plots(
    reader: TrackingReader,
    groups: Sequence[MethodGroup],
    summary: Summary,
    stats: Statistics,
    metric: str,
    mode: Mode,
    out_dir: Path,
) -> list[Path]:
    rows = summary.rows
    written = [plot_score_vs_params(rows, metric, mode, out_dir / "score_vs_params.png", stats),
               plot_cost_front(rows, stats, metric, mode, out_dir / "cost_front.png")]
    by_label = {group.label: group for group in groups}
    # Table order (references first), so the curve colours match the reading order of the table.
    curves = {row.label: _seed_mean_curve(reader, by_label[row.label], metric) for row in rows}
    written.append(plot_curves(curves, metric, mode, out_dir / "curves.png"))
    references = [row for row in rows if row.label in (summary.reference, summary.lower_reference)]
    for sweep in find_knob_sweeps(rows):
        written.append(plot_knob_sweep(sweep, metric, mode, references, out_dir / knob_plot_name(sweep)))
    return [path for path in written if path is not None]


def _single_parent(runs: Sequence[Run]) -> str | None:
    """The sweep parent to attach the report to, when the experiment holds exactly one sweep."""
    known = {run.info.run_id for run in runs}
    parents = parent_ids(runs) & known
    return parents.pop() if len(parents) == 1 else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrator report",
        description="PRR / PEoP comparison table and plots from the MLflow runs of an experiment.",
    )
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="MLflow tracking URI")
    parser.add_argument("--experiment", required=True, help="MLflow experiment name (one study)")
    parser.add_argument("--parent-run", help="only the trials of this sweep parent run id")
    parser.add_argument(
        "--metric", help="compared metric (default: the spec's tune.metric, else val/bleu|val/ppl|val/loss); "
                         "several comma-separated are objectives: the first is compared, runs are marked "
                         "non-dominated over all"
    )
    parser.add_argument(
        "--mode", help="min or max per metric, comma-separated (default: tune.mode, else from the name)"
    )
    parser.add_argument("--alpha", type=float, default=0.05,
                        help="level of the tests; intervals are 1 - alpha (default 0.05: 95%%)")
    parser.add_argument("--bootstrap", action="store_true",
                        help="add a percentile bootstrap interval of each method's mean")
    parser.add_argument("--reference", default="mha",
                        help="PRR reference method: kind or full label; 'none' leaves PRR, PEoP and the tests out")
    parser.add_argument("--lower-reference", default="sha",
                        help="PEoP reference method: kind or full label; 'none' skips PEoP")
    parser.add_argument("--group-by", help="comma-separated params defining a method (default: the attention knobs)")
    parser.add_argument("--status", default="FINISHED",
                        help="comma-separated MLflow run statuses to compare (FINISHED, FAILED, KILLED, RUNNING) or "
                             "'all' (default: FINISHED; failed, early-stopped and running runs end at any value)")
    parser.add_argument("--out", type=Path, help="output folder (default: reports/<experiment>)")
    parser.add_argument("--no-log", action="store_true", help="write files only, do not log them to MLflow")
    return parser


def report_cli(argv: Sequence[str] | None = None) -> int:
    """Entry point of `orchestrator report`; returns the exit code (2 on a ReportError)."""
    args = _parser().parse_args(argv)
    group_by = [key.strip() for key in args.group_by.split(",") if key.strip()] if args.group_by else None
    try:
        report = build_report(
            args.tracking_uri, args.experiment, metric=args.metric, mode=args.mode, parent_run_id=args.parent_run,
            reference=args.reference, lower_reference=args.lower_reference, group_by=group_by,
            out_dir=args.out or Path("reports") / args.experiment, log_to_mlflow=not args.no_log,
            statuses=None if args.status.strip().lower() == "all" else
            [status.strip() for status in args.status.split(",") if status.strip()],
            alpha=args.alpha, bootstrap=args.bootstrap)
    except ReportError as err:
        print(f"orchestrator report: error: {err}", file=sys.stderr)
        return 2
    if report.patching is not None:
        print(patching_markdown(report.patching.rows, report.patching.stats, report.metric, report.mode))
        print(comparison_markdown(report.rows, report.patching.stats, REFERENCE, report.metric))
    else:
        print(report_tables(report.rows, report.metric, report.mode, report.stats, report.reference))
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {len(report.files)} files to {report.out_dir}")
    if report.mlflow_run_id:
        print(f"logged under '{ARTIFACT_DIR}/' of MLflow run {report.mlflow_run_id}")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m orchestrator.report ...` without the CLI wrapper."""
    sys.exit(report_cli(argv))


if __name__ == "__main__":
    main()
