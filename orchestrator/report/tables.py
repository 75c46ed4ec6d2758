"""The report's table as data (CSV) and as Markdown, in the paper's units.

Kept apart from the formulas so that changing how numbers are printed never touches how they are
computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from orchestrator.report.compare import RowStats, Statistics
from orchestrator.report.metrics import MethodRow, Mode, Summary
from orchestrator.report.stats import POWER, Interval


def rows_to_frame(rows: Sequence[MethodRow], stats: Statistics | None = None) -> pd.DataFrame:
    """The table as data (CSV): raw numbers, PRR as a fraction, NaN where undefined; with `stats`, the intervals,
    the test against the reference, its verdict, power and the Pareto fronts. Statistics without a reference
    (`stats.reference` None) give no PRR, PEoP or test columns: all of them measure against it."""
    against = stats is None or stats.reference is not None
    frame = pd.DataFrame(
        {
            "method": [row.label for row in rows],
            "kind": [row.kind for row in rows],
            "n_runs": [row.n_runs for row in rows],
            "params_attention": [row.params_attention for row in rows],
            "params_total": [row.params_total for row in rows],
            "score_mean": [row.score_mean for row in rows],
            "score_std": [row.score_std for row in rows],
            # PRR and PEoP on the seeds their intervals use (the shared seeds of a paired comparison)
            **({"prr": [stats.rows[row.label].prr if stats else row.prr for row in rows],
                "peop": [stats.rows[row.label].peop if stats else row.peop for row in rows]} if against else {}),
            "tokens_per_s": [row.tokens_per_s for row in rows],
            "peak_memory_gb": [row.peak_memory_gb for row in rows],
        }
    )
    if stats is None:
        return frame
    columns: dict[str, list[object]] = {}
    for row in rows:
        row_stats = stats.rows[row.label]
        intervals = [("score", row_stats.ci), ("score_boot", row_stats.bootstrap)]
        intervals += [("prr", row_stats.prr_ci), ("peop", row_stats.peop_ci)] if against else []
        intervals += [("tokens_per_s", row_stats.tokens_ci), ("peak_memory_gb", row_stats.memory_ci)]
        cells: dict[str, object] = {}
        for name, interval in intervals:
            if name == "score_boot" and not stats.bootstrap:
                continue
            interval = interval or Interval.none()
            cells |= {f"{name}_ci_low": interval.low, f"{name}_ci_high": interval.high}
        cells |= _test_cells(row_stats) if against else {}
        cells |= {"on_front": row_stats.on_front, "on_front_uncertain": row_stats.on_front_uncertain}
        for name, value in cells.items():
            columns.setdefault(name, []).append(value)
    return pd.concat([frame, pd.DataFrame(columns)], axis=1)


def _test_cells(row_stats: RowStats) -> dict[str, object]:
    """The CSV's columns of a row's test against the reference (NaN and "" for the reference itself)."""
    comparison = row_stats.comparison

    def of(attribute: str, missing: object = math.nan) -> object:
        return getattr(comparison, attribute) if comparison is not None else missing

    return {"test": of("test", ""), "n_compared": of("n"), "diff": of("diff"),
            "diff_ci_low": comparison.ci.low if comparison is not None else math.nan,
            "diff_ci_high": comparison.ci.high if comparison is not None else math.nan,
            "diff_ci_holm_low": row_stats.diff_ci.low, "diff_ci_holm_high": row_stats.diff_ci.high,
            "p_value": of("p_value"), "p_holm": row_stats.p_holm, "sign_flip_p": of("check_p"),
            "sign_flip_min_p": of("check_min_p"), "verdict": row_stats.verdict, "mdd": of("mdd"),
            "seeds_needed": of("seeds_needed"), "test_note": of("note", "")}


def comparison_count(m: int) -> str:
    """Holm's m in words: "1 comparison", "4 comparisons", or why there is none."""
    return "no comparison (no method could be tested)" if m == 0 else f"{m} comparison{'s' if m != 1 else ''}"


def _fmt(value: float, spec: str) -> str:
    return "-" if not math.isfinite(value) else format(value, spec)


def _score_decimals(rows: Sequence[MethodRow]) -> int:
    """One precision for the whole score column: 4 significant digits of its largest value.

    BLEU 27.31 and perplexity 43.02 get 2 decimals, a loss of 3.214 gets 3; equal decimals keep
    the column comparable by eye.
    """
    largest = max((abs(row.score_mean) for row in rows if math.isfinite(row.score_mean)), default=0.0)
    if largest == 0.0:
        return 2
    return min(4, max(1, 3 - math.floor(math.log10(largest))))


def _interval(value: float, interval: Interval | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """`value [low, high]` in `spec` (times `scale`), the interval left out where it is undefined."""
    if not math.isfinite(value):
        return "-"
    text = format(scale * value, spec) + suffix
    if interval is not None and math.isinf(interval.low) and math.isinf(interval.high):
        return text + " [unbounded]"  # a ratio to a mean not distinguishable from 0 (stats.ratio_interval)
    if interval is not None and math.isfinite(interval.low) and math.isfinite(interval.high):
        text += f" [{format(scale * interval.low, spec)}, {format(scale * interval.high, spec)}]"
    return text


def _front(row_stats: RowStats | None) -> str:
    if row_stats is None:
        return "-"
    return "yes" if row_stats.on_front else "within CI" if row_stats.on_front_uncertain else "no"


def rows_to_markdown(rows: Sequence[MethodRow], metric: str, mode: Mode, stats: Statistics | None = None) -> str:
    """The table for people: the score's seed mean with its interval, PRR in percent and PEoP with two decimals
    as the paper prints them (with bootstrap intervals), costs, and whether the method is on the Pareto front.
    Statistics without a reference (`stats.reference` None) give no PRR or PEoP column."""
    arrow = "↓" if mode == "min" else "↑"
    score_spec = f".{_score_decimals(rows)}f"
    level = f"{100 * (1 - stats.alpha):g}%" if stats else ""
    score_head = f"{metric} {arrow} mean [{level} CI]" if stats else f"{metric} {arrow} (mean ± std)"
    ratios = stats is None or stats.reference is not None
    heads = ["Method", "Attn params", "Total params", "Runs", score_head]
    if stats is not None and stats.bootstrap:
        heads.append("bootstrap CI")
    heads += (["PRR", "PEoP"] if ratios else []) + ["tokens/s", "Peak mem (GB)"] + (["Pareto front"] if stats else [])
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in rows:
        row_stats = stats.rows[row.label] if stats else None
        if row_stats is None:
            score = _fmt(row.score_mean, score_spec)
            score += f" ± {format(row.score_std, score_spec)}" if math.isfinite(row.score_std) else ""
        else:
            score = _interval(row.score_mean, row_stats.ci, score_spec)
        cells = [row.label, _fmt(row.params_attention, ",.0f"), _fmt(row.params_total, ",.0f"), str(row.n_runs),
                 score]
        if row_stats is not None and stats is not None and stats.bootstrap:
            boot = row_stats.bootstrap
            cells.append(f"[{format(boot.low, score_spec)}, {format(boot.high, score_spec)}]"
                         if boot is not None and math.isfinite(boot.low) else "-")
        if ratios:
            cells += [_interval(row_stats.prr, row_stats.prr_ci, ".1f", 100.0, "%") if row_stats else
                      _interval(row.prr, None, ".1f", 100.0, "%"),
                      _interval(row_stats.peop, row_stats.peop_ci, ".2f") if row_stats else
                      _interval(row.peop, None, ".2f")]
        cells += [_fmt(row.tokens_per_s, ",.0f"), _fmt(row.peak_memory_gb, ".2f")]
        if stats is not None:
            cells.append(_front(row_stats))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _detectable(mdd: float, spec: str) -> str:
    return "none with these seeds" if math.isinf(mdd) else _fmt(mdd, spec)


def comparison_markdown(rows: Sequence[MethodRow], stats: Statistics, reference: str, metric: str) -> str:
    """Each method against the reference: difference of seed means with its Holm-adjusted interval (the one the
    verdict's test inverts), the test and its p-value, Holm's adjusted p-value and the verdict, the sign-flip
    check's p, and for an indistinguishable pair what the study could detect."""
    spec = f".{_score_decimals(rows) + 1}f"
    level = f"{100 * (1 - stats.alpha):g}%"
    heads = ["Method", f"Δ {metric} vs {reference} [{level} CI, Holm-adjusted]", "test", "n", "p", "p (Holm)",
             "verdict", "sign-flip p", "detectable Δ", "seeds for Δ"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in rows:
        row_stats = stats.rows[row.label]
        comparison = row_stats.comparison
        if comparison is None:
            continue
        seeds = "-" if math.isnan(comparison.seeds_needed) else \
            "never (Δ = 0)" if math.isinf(comparison.seeds_needed) and comparison.diff == 0 else \
            "> 10,000" if math.isinf(comparison.seeds_needed) else f"{comparison.seeds_needed:.0f}"
        indistinct = row_stats.verdict != "better" and row_stats.verdict != "worse"
        test = comparison.test + (f" ({comparison.note})" if comparison.note else "") if comparison.test else \
            comparison.note or "-"
        cells = [row.label, _interval(comparison.diff, row_stats.diff_ci, "+" + spec), test, str(comparison.n),
                 _fmt(comparison.p_value, ".3g"), _fmt(row_stats.p_holm, ".3g"), row_stats.verdict,
                 _fmt(comparison.check_p, ".3g"),
                 _detectable(comparison.mdd, spec) if indistinct else "", seeds if indistinct else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_document(
    experiment: str,
    metric: str,
    mode: Mode,
    summary: Summary,
    scope: str,
    n_runs: int,
    warnings: Sequence[str],
    files: Sequence[Path],
    stats: Statistics,
    extra: Sequence[str] = (),
    without_reference: str = "",
) -> str:
    """The report.md page: what was compared against what, the tables, warnings, the plots; `extra`: further
    sections (objectives of a multi-objective sweep, hyperparameter importance). Without a reference
    (`summary.reference` None) the page says why (`without_reference`) and has no PRR, PEoP or tests."""
    direction = "lower is better" if mode == "min" else "higher is better"
    level = f"{100 * (1 - stats.alpha):g}%"
    axes = ", ".join(stats.front_axes)
    lines = [
        f"# Report: {experiment}",
        "",
        f"- Metric: `{metric}` ({direction}); score = last logged value of each run; mean over seeds with a "
        f"{level} Student-t interval" + (" and a percentile bootstrap interval." if stats.bootstrap else "."),
        *(_against_reference(summary, stats, level) if summary.reference is not None else
          [f"- No PRR, PEoP or tests against a reference: {without_reference or 'none was given'}."]),
        f"- Pareto front over {axes}: 'yes' on the front of the means, 'within CI' dominated only within the "
        "intervals, 'no' dominated by another method's whole interval.",
        "- Attention params = `params.attention` (Q/K/V/O projections and method extras, no biases); tokens/s and "
        "peak memory are geometric means over seeds, their intervals (report.csv, the front) on the log scale.",
        f"- Runs: {n_runs} ({scope}).",
        "",
        rows_to_markdown(summary.rows, metric, mode, stats),
    ]
    if summary.reference is not None:
        lines.append(comparison_markdown(summary.rows, stats, summary.reference, metric))
    lines += list(stats.notes and [f"Note: {note}." for note in stats.notes] + [""])
    for section in extra:
        lines += [section, ""]
    if warnings:
        lines += ["Warnings:", ""] + [f"- {warning}" for warning in warnings] + [""]
    lines += [f"![{path.stem}]({path.name})" for path in files if path.suffix == ".png"]
    return "\n".join(lines) + "\n"


def _against_reference(summary: Summary, stats: Statistics, level: str) -> list[str]:
    """report.md's bullets on PRR, PEoP and the tests against the reference."""
    lower = f"**{summary.lower_reference}**" if summary.lower_reference else "nothing (PEoP blank)"
    return [
        f"- PRR against **{summary.reference}**, PEoP against {lower}, both from the ratio of seed means, on the "
        f"seeds both methods ran where they share two or more (paired; else every run of each); their {level} "
        "intervals are Fieller's intervals of that ratio, on the same seeds ('unbounded' where the reference's mean "
        "is not distinguishable from 0).",
        f"- Each method against **{summary.reference}**: paired t-test over the seeds both ran (Welch's t-test "
        f"where they share fewer than two), verdicts at alpha = {stats.alpha:g} after Holm's correction for "
        f"{comparison_count(stats.comparisons)}; the difference's interval is at the Holm-adjusted level, so it "
        "excludes 0 exactly when the verdict is better or worse. The exact sign-flip test of the same "
        "differences is shown as a distribution-free check (its smallest possible p is 2 / 2^seeds), and a row "
        "says when the two disagree.",
        f"- Detectable Δ and seeds for Δ: two-sided t-test at the row's Holm-adjusted level (the verdict's) with "
        f"{100 * POWER:g}% power, taking the observed spread of the differences as the true one.",
    ]
