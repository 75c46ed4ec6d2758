"""`orchestrator report` (docs/report.md): `build` (the command, its files and MLflow artifacts), `runs` (which runs are
compared), `metrics` (grouping, PRR / PEoP), `stats` (intervals, tests, Holm, power; scipy.stats), `compare` (those
per table row, fronts), `costs` (geometric means of costs, log-scale intervals), `pareto` (non-dominated points with
intervals), `importance` (fANOVA, parallel coordinates), `objectives` (several objectives), `tables` and `plots`.
Reads MLflow only through orchestrator.tracking; `python -m orchestrator.report` runs the command without the CLI
wrapper."""

from orchestrator import lazy_face

OFFERS = {
    **dict.fromkeys(["build_report", "report_cli", "Report"], "build"),
    **dict.fromkeys(["ReportError", "RunRecord", "MethodRow", "group_runs", "summarize", "infer_mode",
                     "default_group_keys", "prr", "peop"], "metrics"),
    **dict.fromkeys(["compared_runs", "find_experiment_id", "with_status"], "runs"),
    **dict.fromkeys(["analyse", "verdict_of"], "compare"),
    **dict.fromkeys(["Comparison", "Interval", "holm", "holm_level", "PAIRED_T", "SIGN_FLIP"], "stats"),
    **dict.fromkeys(["rows_to_markdown", "rows_to_frame", "comparison_markdown"], "tables"),
}
__all__ = sorted(OFFERS)
__getattr__, __dir__ = lazy_face(__name__, OFFERS)
