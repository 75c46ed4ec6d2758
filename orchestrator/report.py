"""`orchestrator report`: compare the methods of an MLflow experiment the way the MHE paper does.

Reads the runs of one experiment (or the trials of one sweep), groups seeds of the same method
configuration, and writes a PRR / PEoP table (Markdown + CSV) and plots to a folder, which it also
logs as artifacts under `report/` of the sweep's parent run so the comparison sits next to the runs
in the MLflow UI. The formulas live in `report_metrics`, the table formatting in `report_tables`,
the figures in `report_plots`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from orchestrator.report_metrics import (
    MethodGroup,
    MethodRow,
    Mode,
    ReportError,
    RunRecord,
    Summary,
    default_group_keys,
    group_runs,
    infer_mode,
    param_value,
    summarize,
)
from orchestrator.tracking.describe import PARENT_TAG, ROLE_TAG
from orchestrator.tracking.read import RUN_STATUSES, Run, TrackingReader
from orchestrator.tracking.write import log_files, new_run
from orchestrator.report_tables import markdown_document, rows_to_frame, rows_to_markdown
from orchestrator.report_plots import (
    find_knob_sweeps,
    knob_plot_name,
    plot_curves,
    plot_knob_sweep,
    plot_score_vs_params,
)

__all__ = ["Report", "ReportError", "build_report", "report_cli"]

# Marks the run this module creates when there is no sweep parent to attach to; such runs hold
# only artifacts and are never read back as compared runs.
REPORT_TAG = "orchestrator.report"
ARTIFACT_DIR = "report"
# Metrics tried in order when neither --metric nor the spec's `tune.metric` names one.
_DEFAULT_METRICS = ("val/bleu", "val/ppl", "val/loss")


@dataclass(frozen=True)
class Report:
    """What `build_report` produced: the table as rows and data, the files, and where they were logged."""

    experiment: str
    metric: str
    mode: Mode
    reference: str
    lower_reference: str | None
    rows: list[MethodRow]
    table: pd.DataFrame
    markdown: str
    out_dir: Path
    files: list[Path]
    mlflow_run_id: str | None
    warnings: list[str]


def build_report(
    tracking_uri: str,
    experiment: str,
    *,
    metric: str | None = None,
    mode: Mode | None = None,
    parent_run_id: str | None = None,
    reference: str = "mha",
    lower_reference: str | None = "sha",
    group_by: Sequence[str] | None = None,
    out_dir: Path,
    log_to_mlflow: bool = True,
    statuses: Sequence[str] | None = ("FINISHED",),
) -> Report:
    """Build the comparison report of `experiment` (or of the sweep `parent_run_id`) into `out_dir`.

    `metric` defaults to the spec's `tune.metric` param; `mode` defaults to the spec's `tune.mode`
    for that metric, else it is inferred from the metric name. `reference` / `lower_reference` name
    the methods PRR / PEoP are measured against, by kind ("mha") or by full label ("mha heads=12");
    `lower_reference=None` (or "none") skips PEoP. Only runs whose MLflow status is in `statuses` are compared
    (default FINISHED: a run that failed, was stopped early by ASHA or interrupted ended at whatever its last
    value was); None compares every run.

    Raises ReportError with a fix when the runs cannot be compared. Problems that still leave a
    useful table (no lower reference, skipped runs) are returned in `Report.warnings` and written
    into report.md rather than logged, so the caller decides how to show them.
    """
    if lower_reference is not None and lower_reference.strip().lower() in ("", "none"):
        lower_reference = None
    _check_store_exists(tracking_uri)
    reader = TrackingReader(tracking_uri)
    experiment_id = _experiment_id(reader, experiment)
    all_runs = reader.runs(experiment_id)
    runs, left_out = _with_status(_compared_runs(all_runs, parent_run_id, experiment), statuses)
    records = [RunRecord(run.info.run_id, dict(run.data.params), dict(run.data.metrics)) for run in runs]

    metric, mode = _choose_metric(records, metric, mode)
    keys = _group_keys(records, group_by)
    groups = _groups_with_metric(records, keys, metric)
    summary = summarize(groups, metric, mode, reference, lower_reference)
    warnings = list(summary.warnings)
    if left_out:
        warnings.append(f"{sum(left_out.values())} run(s) left out by status ({_counts(left_out)}: failed, stopped "
                        "early by ASHA, interrupted or still running); `--status all` compares them at their last value")
    skipped = sum(metric not in record.metrics for record in records)
    if skipped:
        warnings.append(
            f"{skipped} run(s) without {metric!r} skipped (crashed or stopped before evaluation?)"
        )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = rows_to_frame(summary.rows)
    files = [out_dir / "report.csv"]
    table.to_csv(files[0], index=False)
    files += _write_plots(reader, groups, summary, metric, mode, out_dir)
    scope = f"children of parent run {parent_run_id}" if parent_run_id else "all runs of the experiment"
    markdown = markdown_document(
        experiment, metric, mode, summary, scope, len(records) - skipped, warnings, files
    )
    (out_dir / "report.md").write_text(markdown)
    files.insert(0, out_dir / "report.md")

    mlflow_run_id = None
    if log_to_mlflow:
        mlflow_run_id = parent_run_id or _single_parent(all_runs) or \
            new_run(tracking_uri, experiment_id, run_name="report", tags={REPORT_TAG: "true"})
        log_files(tracking_uri, mlflow_run_id, files, artifact_path=ARTIFACT_DIR)
    return Report(
        experiment=experiment,
        metric=metric,
        mode=mode,
        reference=summary.reference,
        lower_reference=summary.lower_reference,
        rows=summary.rows,
        table=table,
        markdown=markdown,
        out_dir=out_dir,
        files=files,
        mlflow_run_id=mlflow_run_id,
        warnings=warnings,
    )


def _check_store_exists(tracking_uri: str) -> None:
    """Refuse a SQLite path that does not exist: MLflow would create an empty store there instead."""
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix) and tracking_uri != prefix + ":memory:":
        path = Path(tracking_uri[len(prefix) :])
        if not path.exists():
            raise ReportError(
                f"no MLflow database at {path.resolve()}; pass --tracking-uri pointing at the store the "
                "runs were logged to (the spec's tracking.uri)"
            )


def _experiment_id(reader: TrackingReader, name: str) -> str:
    experiment = reader.experiment(name)
    if experiment is None:
        names = sorted(reader.experiment_names())
        raise ReportError(
            f"experiment {name!r} does not exist in this tracking store; existing experiments: "
            f"{', '.join(repr(n) for n in names) or '(none)'}. Check --experiment and --tracking-uri."
        )
    if experiment.lifecycle_stage == "deleted":
        raise ReportError(
            f"experiment {name!r} is deleted; restore it with `mlflow experiments restore "
            f"--experiment-id {experiment.experiment_id}` to report on it."
        )
    return experiment.experiment_id


def _parent_ids(runs: Sequence[Run]) -> set[str]:
    return {parent for run in runs if (parent := run.data.tags.get(PARENT_TAG))}


def _describe_parents(runs: Sequence[Run]) -> str:
    parents = _parent_ids(runs)
    described = [f"{run.info.run_id} ({run.info.run_name})" for run in runs if run.info.run_id in parents]
    return ", ".join(described) or "(none)"


def _compared_runs(runs: Sequence[Run], parent_run_id: str | None, experiment: str) -> list[Run]:
    """The trials to compare: children of one sweep, or every run that is not a sweep parent."""
    parents = _parent_ids(runs)
    compared = [
        run
        for run in runs
        if run.info.run_id not in parents
        and not run.data.tags.get(REPORT_TAG)
        and run.data.tags.get(ROLE_TAG) != "pretrain"  # a two-stage study compares its fine-tuned runs
        and (parent_run_id is None or run.data.tags.get(PARENT_TAG) == parent_run_id)
    ]
    if parent_run_id is not None and not compared:
        known = {run.info.run_id for run in runs}
        what = "has no child runs" if parent_run_id in known else f"is not a run of experiment {experiment!r}"
        raise ReportError(
            f"parent run {parent_run_id!r} {what}; sweep parent runs in this experiment: "
            f"{_describe_parents(runs)}. Pass one of them to --parent-run, or omit it to use all runs."
        )
    if not compared:
        raise ReportError(f"experiment {experiment!r} has no runs to compare; run a sweep first.")
    return compared


def _with_status(runs: Sequence[Run], statuses: Sequence[str] | None) -> tuple[list[Run], dict[str, int]]:
    """The runs whose status is in `statuses` (all when None), and how many of each other status were left out."""
    if statuses is None:
        return list(runs), {}
    wanted = {status.upper() for status in statuses}
    known = RUN_STATUSES
    if unknown := sorted(wanted - known):
        raise ReportError(f"--status {','.join(unknown)}: not an MLflow run status; use a comma-separated list of "
                          f"{', '.join(sorted(known))}, or 'all'")
    left_out: dict[str, int] = {}
    for run in runs:
        if run.info.status not in wanted:
            left_out[run.info.status] = left_out.get(run.info.status, 0) + 1
    kept = [run for run in runs if run.info.status in wanted]
    if not kept:
        raise ReportError(f"no run to compare has status {'/'.join(sorted(wanted))} (there are {_counts(left_out)}); "
                          "wait for the sweep to finish, or pass --status all to compare runs at their last value")
    return kept, left_out


def _counts(by_status: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {status}" for status, n in sorted(by_status.items()))


def _spec_setting(records: Sequence[RunRecord], key: str) -> str | None:
    """A spec param (e.g. `tune.metric`) when all runs that logged it agree, else None."""
    values = {param_value(record.params, key) for record in records} - {None}
    return values.pop() if len(values) == 1 else None


def _choose_metric(records: Sequence[RunRecord], metric: str | None, mode: Mode | None) -> tuple[str, Mode]:
    """The compared metric and its direction: explicit, else the spec's tune settings, else defaults."""
    available = sorted({name for record in records for name in record.metrics})
    spec_metric = _spec_setting(records, "tune.metric")
    if metric is None:
        metric = spec_metric or next((name for name in _DEFAULT_METRICS if name in available), None)
        if metric is None:
            raise ReportError(
                f"no metric given and none of {list(_DEFAULT_METRICS)} was logged; "
                f"pass --metric with one of: {', '.join(available) or '(no metrics logged)'}"
            )
    if not any(metric in record.metrics for record in records):
        raise ReportError(
            f"no run logged the metric {metric!r}; metrics that exist: "
            f"{', '.join(available) or '(no metrics logged)'}. Pass one of them to --metric."
        )
    if mode is None and metric == spec_metric:
        spec_mode = _spec_setting(records, "tune.mode")
        mode = spec_mode if spec_mode in ("min", "max") else None  # type: ignore[assignment]
    if mode is None:
        mode = infer_mode(metric)
    if mode not in ("min", "max"):
        raise ReportError(f"mode must be 'min' or 'max', got {mode!r}")
    return metric, mode


def _group_keys(records: Sequence[RunRecord], group_by: Sequence[str] | None) -> list[str]:
    if not group_by:
        return default_group_keys(records)
    logged = sorted({name for record in records for name in record.params})
    unknown = [key for key in group_by if key not in logged]
    if unknown:
        model_params = [name for name in logged if name.startswith("model.")] or logged
        raise ReportError(
            f"--group-by names params no run logged: {unknown}; "
            f"logged model params: {', '.join(model_params)}"
        )
    return list(group_by)


def _groups_with_metric(records: Sequence[RunRecord], keys: Sequence[str], metric: str) -> list[MethodGroup]:
    """Group the runs that have the metric, after checking that no method lacks it entirely.

    A method whose runs all lack the metric usually means the runs logged different metrics (an
    MT run has val/bleu, an LM run val/ppl); silently dropping it would hide it from the table.
    """
    lacking = [
        group for group in group_runs(records, keys) if not any(metric in run.metrics for run in group.runs)
    ]
    if lacking:
        details = "; ".join(
            f"{group.label!r} has {sorted({m for r in group.runs for m in r.metrics}) or 'no metrics'}"
            for group in lacking
        )
        common = set.intersection(*(set(record.metrics) for record in records))
        raise ReportError(
            f"the runs logged different metrics: no run of {len(lacking)} method(s) has {metric!r} "
            f"({details}). "
            f"Metrics every run has: {', '.join(sorted(common)) or '(none)'}. Pick one with --metric, or "
            "restrict the report to one sweep with --parent-run."
        )
    return group_runs([record for record in records if metric in record.metrics], keys)


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
    metric: str,
    mode: Mode,
    out_dir: Path,
) -> list[Path]:
    rows = summary.rows
    written = [plot_score_vs_params(rows, metric, mode, out_dir / "score_vs_params.png")]
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
    parents = _parent_ids(runs) & known
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
        "--metric", help="compared metric (default: the spec's tune.metric, else val/bleu|val/ppl|val/loss)"
    )
    parser.add_argument(
        "--mode", choices=("min", "max"), help="metric direction (default: tune.mode, else from the name)"
    )
    parser.add_argument("--reference", default="mha", help="PRR reference method: kind or full label")
    parser.add_argument(
        "--lower-reference",
        default="sha",
        help="PEoP reference method: kind or full label; 'none' skips PEoP",
    )
    parser.add_argument(
        "--group-by", help="comma-separated params defining a method (default: the attention knobs)"
    )
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
            args.tracking_uri,
            args.experiment,
            metric=args.metric,
            mode=args.mode,
            parent_run_id=args.parent_run,
            reference=args.reference,
            lower_reference=args.lower_reference,
            group_by=group_by,
            out_dir=args.out or Path("reports") / args.experiment,
            log_to_mlflow=not args.no_log,
            statuses=None if args.status.strip().lower() == "all" else
            [status.strip() for status in args.status.split(",") if status.strip()],
        )
    except ReportError as err:
        print(f"orchestrator report: error: {err}", file=sys.stderr)
        return 2
    print(rows_to_markdown(report.rows, report.metric, report.mode))
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
