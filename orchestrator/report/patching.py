"""The report of a patching experiment (`task.kind: pretrained_lm`): a pretrained causal LM whose last l layers'
attention is replaced by a weight-free mechanism (HyperAttention, LSH) and scored without training, as in
HyperAttention's Figure 3 (Han, Jayaram, Karbasi, Mirrokni, Woodruff and Zandieh, 2023, "HyperAttention:
Long-context Attention in Near-Linear Time", arXiv 2310.05869, Sec. 4.1).

Runs are grouped by the mechanism's configuration (the `task.patch.attention.*` params but its seed, plus how the
layers were chosen when runs differ in it) and by l, the number of patched layers (`<split>/patched_layers`); the
seeds (`optim.seed`, which draw the hashes) are the replicates. The unpatched model (l = 0) is the one reference:
every (configuration, l) row gets PRR against it and its paired test through the method table's own `summarize`
and `analyse`, so the formulas, intervals, Holm's correction and verdicts are the report's (docs/report.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from orchestrator.report.compare import RowStats, Statistics, analyse
from orchestrator.report.costs import cost_warnings, geometric_interval, geometric_mean
from orchestrator.report.importance import importance, importance_markdown
from orchestrator.report.metrics import (
    SEED_KEYS,
    MethodGroup,
    MethodRow,
    Mode,
    ReportError,
    RunRecord,
    Summary,
    _natural_key,
    param_value,
    seed_of,
    summarize,
)
from orchestrator.report.plots import PatchPoint, plot_patching
from orchestrator.report.stats import Interval
from orchestrator.report.tables import (
    _fmt,
    _interval,
    _score_decimals,
    comparison_count,
    comparison_markdown,
    rows_to_frame,
)

TASK_KIND_KEY = "task.kind"
PATCHING_TASK = "pretrained_lm"
LAYERS_KEY = "task.patch.layers"
MECHANISM_PREFIX = "task.patch.attention."
REFERENCE = "unpatched (l=0)"
PLOT_FILE = "patching.png"
# Task params that do not change what the unpatched model scores; every other task.* param (the model, the data,
# the document length) and the fine-tuning steps must be equal across the runs, or l = 0 is no common reference.
_NOT_SETUP = ("task.patch.", "task.time_unpatched", "task.trust_remote_code")
_SETUP_EXTRA = ("optim.max_steps",)
# Columns of the method table's CSV that mean nothing here: a patched model has the unpatched model's parameters,
# and its cost is the speed-up columns added below.
_DROPPED = ("params_", "peop", "tokens_per_s", "peak_memory_gb", "on_front")


@dataclass(frozen=True)
class PatchRow:
    """One row of the patching table: a mechanism configuration at l patched layers, or the unpatched model."""

    mechanism: str
    """The line of the plot: the configuration's label ("hyper block_size=64"), or REFERENCE."""
    layers: float
    n_runs: int
    """MLflow runs behind the row (the reference's merged per seed, `row.n_runs` counts those)."""
    row: MethodRow
    stats: RowStats
    speedup: float
    speedup_ci: Interval
    attention_speedup: float
    attention_speedup_ci: Interval


@dataclass(frozen=True)
class PatchingReport:
    rows: list[PatchRow]
    summary: Summary
    stats: Statistics
    table: pd.DataFrame
    markdown: str
    files: list[Path]
    reference_note: str
    importance: dict[str, float] = field(default_factory=dict)


def is_patching(records: Sequence[RunRecord]) -> bool:
    """Whether the runs are a patching experiment; runs of pretrained_lm mixed with other tasks are refused."""
    kinds = {param_value(record.params, TASK_KIND_KEY) for record in records}
    if PATCHING_TASK not in kinds:
        return False
    if len(kinds) > 1:
        raise ReportError(f"the runs mix task.kind {PATCHING_TASK} with {sorted(map(str, kinds - {PATCHING_TASK}))}; "
                          "a patching study is reported on its own: pass --parent-run with its sweep, or put it in "
                          "its own experiment")
    return True


def _split(metric: str) -> str:
    return metric.split("/", 1)[0] if "/" in metric else "val"


def layer_count(run: RunRecord, split: str) -> float | None:
    """l: the `patched_layers` the evaluation counted, else what `task.patch.layers` says without the model's
    layer count (an int, "none", "last:l" or "first:l"); None when neither tells."""
    for name in (f"{split}/patched_layers", "val/patched_layers", "test/patched_layers"):
        value = run.metrics.get(name)
        if value is not None and math.isfinite(value):
            return float(value)
    raw = (param_value(run.params, LAYERS_KEY) or "").lower()
    raw = "0" if raw == "none" else raw.split(":", 1)[1] if raw.startswith(("last:", "first:")) else raw
    return float(raw) if raw.isdigit() else None


def _selector_form(run: RunRecord) -> str:
    """How the layers were chosen: the last l (the paper's), the first l, every k-th, or an explicit list."""
    raw = (param_value(run.params, LAYERS_KEY) or "").lower()
    if raw.startswith(("first:", "every:")):
        return raw.split(":", 1)[0]
    return f"layers={raw}" if "," in raw else "last"


def _check_setup(records: Sequence[RunRecord]) -> None:
    names = sorted({name for record in records for name in record.params})
    setup = [name for name in names if (name.startswith("task.") and not name.startswith(_NOT_SETUP))
             or name in _SETUP_EXTRA]
    differ = {name: sorted({str(param_value(r.params, name)) for r in records}) for name in setup
              if len({param_value(r.params, name) for r in records}) > 1}
    if differ:
        listed = "; ".join(f"{name}: {', '.join(values)}" for name, values in differ.items())
        raise ReportError(f"the patching runs differ in what the unpatched model scores ({listed}), so l = 0 is no "
                          "common reference; report each setting on its own (--parent-run, or one experiment each)")


def _lines(patched: Sequence[RunRecord]) -> dict[str, tuple[str, dict[str, str], list[RunRecord]]]:
    """label -> (mechanism kind, knobs shown in the label, runs): one line per configuration of the patched runs.
    A label names the knobs that differ between configurations of its kind, and the layer choice when it varies."""
    keys = sorted({name for run in patched for name in run.params
                   if name.startswith(MECHANISM_PREFIX) and "seed" not in name[len(MECHANISM_PREFIX):]})
    kind_key = MECHANISM_PREFIX + "kind"
    by_config: dict[tuple[str | None, ...], list[RunRecord]] = {}
    for run in patched:
        by_config.setdefault((*(param_value(run.params, key) for key in keys), _selector_form(run)), []).append(run)
    kind_at = keys.index(kind_key) if kind_key in keys else None
    forms = {config[-1] for config in by_config}
    lines = {}
    for config, runs in by_config.items():
        kind = config[kind_at] if kind_at is not None else None
        same_kind = [other for other in by_config if kind_at is None or other[kind_at] == kind]
        knobs = {key[len(MECHANISM_PREFIX):]: value for i, (key, value) in enumerate(zip(keys, config))
                 if key != kind_key and value is not None and len({other[i] for other in same_kind}) > 1}
        parts = [kind or "patched", *(f"{name}={value}" for name, value in knobs.items())]
        lines[" ".join(parts + ([config[-1]] if len(forms) > 1 else []))] = (kind or "patched", knobs, runs)
    return dict(sorted(lines.items(), key=lambda item: _natural_key(item[0])))


def _reference_runs(unpatched: Sequence[RunRecord], seeds: set[str], metric: str,
                    warnings: list[str]) -> tuple[tuple[RunRecord, ...], str]:
    """The l = 0 reference, one record per seed, and the note that says how it is compared.

    A sweep over configurations runs l = 0 once per configuration: the same unpatched model, so the runs of one
    seed are merged (their mean; a warning if they differ). When l = 0 ran a single seed, its score is set beside
    every seed the patched runs ran: a constant reference, against which the paired t-test is the one-sample t-test
    of a row's seeds."""
    by_seed: dict[str | None, list[RunRecord]] = {}
    for run in unpatched:
        by_seed.setdefault(seed_of(run), []).append(run)
    if None in by_seed:
        return tuple(unpatched), "the l = 0 runs logged no seed: each row is compared with them unpaired (Welch)"
    merged = []
    for seed, runs in sorted(by_seed.items(), key=lambda item: _natural_key(str(item[0]))):
        scores = [run.metrics[metric] for run in runs]
        if max(scores) - min(scores) > 1e-9 * max(abs(score) for score in scores):
            warnings.append(f"the {len(runs)} unpatched (l = 0) runs of seed {seed} scored different {metric} "
                            f"{[float(score) for score in scores]}; their mean is the reference for that seed")
        merged.append(RunRecord("+".join(run.run_id for run in runs), {SEED_KEYS[0]: seed},  # type: ignore[dict-item]
                                {metric: float(np.mean(scores))}))
    if len(merged) == 1:
        only, seed = merged[0], next(iter(by_seed))
        every = sorted(seeds | {seed}, key=lambda s: _natural_key(str(s)))  # type: ignore[operator]
        return (tuple(RunRecord(f"{only.run_id}@{s}", {SEED_KEYS[0]: s}, dict(only.metrics)) for s in every),
                f"l = 0 ran one seed ({seed}): its score is a constant reference set beside every seed, so each "
                "row's paired t-test is the one-sample t-test of its seeds against it")
    seed_list = ", ".join(str(seed_of(record)) for record in merged)
    return tuple(merged), (f"l = 0 ran seeds {seed_list}: each row is paired with it on "
                           "the seeds both ran (l = 0 runs of one seed, one per configuration, are one model and "
                           "are merged)")


def _check_in_process(reference: Sequence[RunRecord], in_process: Sequence[RunRecord], metric: str,
                      warnings: list[str]) -> None:
    """The unpatched score a patched run measured in its own process should be l = 0's: else the runs did not
    score the same model on the same documents (or the unpatched path is not the model's own)."""
    by_seed = {seed_of(run): run.metrics[metric] for run in reference}
    off = [run.run_id.removesuffix(":unpatched") for run in in_process if (value := by_seed.get(seed_of(run))) is not None
           and abs(run.metrics[metric] - value) > 1e-4 * abs(value)]
    if off:
        warnings.append(f"{len(off)} patched run(s) measured an unpatched {metric} (`{metric}_unpatched`) more than "
                        f"1e-4 away from l = 0's (e.g. {off[0]}): were they scored on the same model and documents?")


def _speed(runs: Sequence[RunRecord], name: str, level: float, label: str,
           warnings: list[str]) -> tuple[float, Interval]:
    """A row's speed-up: the geometric mean of its seeds' ratios and its log-scale interval (costs.py)."""
    values = [run.metrics[name] for run in runs if name in run.metrics]
    warnings += cost_warnings(label, {name: values})
    return geometric_mean(values), geometric_interval(values, level)


def patching_report(records: Sequence[RunRecord], metric: str, mode: Mode, out_dir: Path, *, alpha: float,
                    bootstrap: bool, warnings: list[str], experiment: str, scope: str) -> PatchingReport:
    """Group, compare with l = 0 and write report.csv, patching.png (and the importance files) into `out_dir`;
    the report.md text is returned, not written (the caller lists it first among the files)."""
    _check_setup(records)
    split, level = _split(metric), 1.0 - alpha
    scored = [record for record in records if metric in record.metrics]
    counted = [(run, layer_count(run, split)) for run in scored]
    if unknown := [run.run_id for run, layers in counted if layers is None]:
        warnings.append(f"{len(unknown)} run(s) without {split}/patched_layers or a numeric {LAYERS_KEY} skipped "
                        f"({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''})")
    unpatched = [run for run, layers in counted if layers == 0]
    patched = [run for run, layers in counted if layers]
    if not patched:
        raise ReportError(f"no patched run (l > 0) with {metric}: sweep {LAYERS_KEY} over 0 and some l > 0")
    in_process = [RunRecord(f"{run.run_id}:unpatched", run.params, {metric: run.metrics[f"{metric}_unpatched"],
                                                                    f"{split}/speedup": 1.0,
                                                                    f"{split}/attention_speedup": 1.0})
                  for run in patched if f"{metric}_unpatched" in run.metrics]
    if not unpatched and not in_process:
        raise ReportError(f"no unpatched run (l = 0) with {metric}, and no run logged {metric}_unpatched: PRR and the "
                          f"tests are against the unpatched model; add 0 to the sweep of {LAYERS_KEY}")
    layers_of = {run.run_id: layers for run, layers in counted}
    ref_runs, note = _reference_runs(unpatched or in_process, {s for run in patched if (s := seed_of(run)) is not None},
                                     metric, warnings)
    if not unpatched:
        note = (f"no l = 0 run, so the reference is `{metric}_unpatched`, the unpatched model each patched run scored "
                f"in its own process (speed-up 1 by definition); {note}")
    else:
        _check_in_process(ref_runs, in_process, metric, warnings)
    groups = [MethodGroup(REFERENCE, None, {"l": "0"}, ref_runs)]
    members = {REFERENCE: ("", 0.0, unpatched or in_process)}
    for line, (kind, knobs, runs) in _lines(patched).items():
        for layers in sorted({layers_of[run.run_id] for run in runs}):
            at = tuple(run for run in runs if layers_of[run.run_id] == layers)
            label = f"{line} l={layers:g}"
            groups.append(MethodGroup(label, kind, {**knobs, "l": f"{layers:g}"}, at))
            members[label] = (line, layers, at)
    summary = summarize(groups, metric, mode, REFERENCE, None)
    warnings += summary.warnings
    stats = analyse(summary, mode, alpha=alpha, bootstrap=bootstrap)
    rows = []
    for row in summary.rows:
        line, layers, runs = members[row.label]
        speedup, speedup_ci = _speed(runs, f"{split}/speedup", level, row.label, warnings)
        attention, attention_ci = _speed(runs, f"{split}/attention_speedup", level, row.label, warnings)
        rows.append(PatchRow(line or REFERENCE, layers, len(runs), row, stats.rows[row.label], speedup, speedup_ci,
                             attention, attention_ci))
    out_dir.mkdir(parents=True, exist_ok=True)
    table = patching_frame(rows, stats)
    files = [out_dir / "report.csv"]
    table.to_csv(files[0], index=False)
    files.append(plot_patching(_plot_lines(rows), metric, mode, out_dir / PLOT_FILE))
    scores, importance_files = importance(scored, metric, mode, out_dir, warnings)
    files += importance_files
    markdown = patching_document(experiment, metric, mode, rows, summary, stats, note, scope, len(scored), warnings,
                                 files, [importance_markdown(scores, metric)])
    return PatchingReport(rows, summary, stats, table, markdown, files, note, dict(scores))


def _plot_lines(rows: Sequence[PatchRow]) -> dict[str, list[PatchPoint]]:
    """One line per configuration, each starting at the unpatched model."""
    def point(row: PatchRow) -> PatchPoint:
        return PatchPoint(row.layers, row.row.score_mean, row.stats.ci, row.speedup, row.attention_speedup)

    start = point(rows[0])
    lines: dict[str, list[PatchPoint]] = {}
    for row in rows[1:]:
        lines.setdefault(row.mechanism, [start]).append(point(row))
    return lines


def patching_frame(rows: Sequence[PatchRow], stats: Statistics) -> pd.DataFrame:
    """The CSV: the method table's columns that apply (score, PRR, test against l = 0, verdict, power), with the
    configuration, l, the MLflow runs and seeds, and the speed-ups' geometric means over seeds with their
    log-scale intervals (costs.py)."""
    frame = rows_to_frame([row.row for row in rows], stats)
    frame = frame[[column for column in frame.columns if not column.startswith(_DROPPED)]]
    frame.insert(1, "mechanism", [row.mechanism for row in rows])
    frame.insert(2, "layers", [row.layers for row in rows])
    frame["n_runs"] = [row.n_runs for row in rows]
    frame.insert(4, "seeds", [" ".join(sorted({str(s) for s in row.row.seeds}, key=_natural_key)) for row in rows])
    for name in ("speedup", "attention_speedup"):
        frame[f"{name}_mean"] = [getattr(row, name) for row in rows]
        frame[f"{name}_ci_low"] = [getattr(row, f"{name}_ci").low for row in rows]
        frame[f"{name}_ci_high"] = [getattr(row, f"{name}_ci").high for row in rows]
    return frame


def patching_markdown(rows: Sequence[PatchRow], stats: Statistics, metric: str, mode: Mode) -> str:
    """The table for people: per configuration and l, the score with its interval, PRR, the difference from l = 0
    with its Holm-adjusted interval, Holm's p, the verdict, and the speed-ups."""
    spec, delta = f".{_score_decimals([row.row for row in rows])}f", f"+.{_score_decimals([r.row for r in rows]) + 1}f"
    level = f"{100 * (1 - stats.alpha):g}%"
    heads = ["Mechanism", "l", "Runs", f"{metric} {'↓' if mode == 'min' else '↑'} mean [{level} CI]",
             f"PRR [{level} CI]", f"Δ vs l=0 [{level} CI, Holm]", "p (Holm)", "verdict",
             f"speed-up [{level} CI]", f"attention speed-up [{level} CI]"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in rows:
        comparison = row.stats.comparison
        diff = _interval(comparison.diff, row.stats.diff_ci, delta) if comparison is not None else "-"
        cells = [row.mechanism, f"{row.layers:g}", str(row.n_runs), _interval(row.row.score_mean, row.stats.ci, spec),
                 _interval(row.stats.prr, row.stats.prr_ci, ".1f", 100.0, "%"), diff, _fmt(row.stats.p_holm, ".3g"),
                 row.stats.verdict if comparison is not None else "reference",
                 _interval(row.speedup, row.speedup_ci, ".2f"), _interval(row.attention_speedup,
                                                                          row.attention_speedup_ci, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def patching_document(experiment: str, metric: str, mode: Mode, rows: Sequence[PatchRow], summary: Summary,
                      stats: Statistics, note: str, scope: str, n_runs: int, warnings: Sequence[str],
                      files: Sequence[Path], extra: Sequence[str] = ()) -> str:
    """report.md of a patching experiment: how it was compared, the table, the tests in full, the plot."""
    level = f"{100 * (1 - stats.alpha):g}%"
    split = _split(metric)
    lines = [
        f"# Report: {experiment} (patched pretrained model)",
        "",
        f"- Metric: `{metric}` ({'lower' if mode == 'min' else 'higher'} is better), the last logged value of each "
        f"run; rows are mechanism configurations (`{MECHANISM_PREFIX}*` but the seed) at l patched layers "
        f"(`{split}/patched_layers`), the seeds (`optim.seed`, which draw the hashes) the replicates; mean over "
        f"seeds with a {level} Student-t interval.",
        f"- Reference: the unpatched model; {note}.",
        f"- PRR against l = 0 from the ratio of seed means on the seeds both ran (the method table's formula; its "
        f"{level} interval Fieller's interval of that ratio). Each row against l = 0: paired t-test, verdicts at "
        f"alpha = {stats.alpha:g} after Holm's correction for {comparison_count(stats.comparisons)}; Δ's interval "
        "is at the Holm-adjusted level.",
        f"- Speed-up: `{split}/speedup` (the unpatched forward's time over the patched one's, both in the run's "
        f"process) and `{split}/attention_speedup` (the attention layers' time: the paper's Figure 3 measure), "
        f"geometric means over seeds with {level} intervals on the log scale (a ratio's interval: never below 0).",
        f"- Runs: {n_runs} ({scope}).",
        "",
        patching_markdown(rows, stats, metric, mode),
        "Tests against l = 0 in full (sign-flip check, detectable Δ):",
        "",
        comparison_markdown(summary.rows, stats, REFERENCE, metric),
    ]
    lines += [f"Note: {item}." for item in stats.notes] + ([""] if stats.notes else [])
    lines += [section + "\n" for section in extra if section]
    if warnings:
        lines += ["Warnings:", ""] + [f"- {warning}" for warning in warnings] + [""]
    lines += [f"![{path.stem}]({path.name})" for path in files if path.suffix == ".png"]
    return "\n".join(lines) + "\n"
