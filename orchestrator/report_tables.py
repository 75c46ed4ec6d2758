"""The report's table as data (CSV) and as Markdown, in the paper's units.

Kept apart from the formulas so that changing how numbers are printed never touches how they are
computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from orchestrator.report_metrics import MethodRow, Mode, Summary


def rows_to_frame(rows: Sequence[MethodRow]) -> pd.DataFrame:
    """The table as data (CSV): raw numbers, PRR as a fraction, NaN where undefined."""
    return pd.DataFrame(
        {
            "method": [row.label for row in rows],
            "kind": [row.kind for row in rows],
            "n_runs": [row.n_runs for row in rows],
            "params_attention": [row.params_attention for row in rows],
            "params_total": [row.params_total for row in rows],
            "score_mean": [row.score_mean for row in rows],
            "score_std": [row.score_std for row in rows],
            "prr": [row.prr for row in rows],
            "peop": [row.peop for row in rows],
            "tokens_per_s": [row.tokens_per_s for row in rows],
            "peak_memory_gb": [row.peak_memory_gb for row in rows],
        }
    )


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


def rows_to_markdown(rows: Sequence[MethodRow], metric: str, mode: Mode) -> str:
    """The table for people: PRR in percent and PEoP with two decimals, as the paper prints them."""
    arrow = "↓" if mode == "min" else "↑"
    score_spec = f".{_score_decimals(rows)}f"
    header = (
        f"| Method | Attn params | Total params | Runs | {metric} {arrow} (mean ± std) | PRR | PEoP "
        "| tokens/s | Peak mem (GB) |"
    )
    lines = [header, "|" + "---|" * 9]
    for row in rows:
        score = _fmt(row.score_mean, score_spec)
        if math.isfinite(row.score_std):
            score += " ± " + format(row.score_std, score_spec)
        cells = [
            row.label,
            _fmt(row.params_attention, ",.0f"),
            _fmt(row.params_total, ",.0f"),
            str(row.n_runs),
            score,
            "-" if not math.isfinite(row.prr) else f"{100 * row.prr:.1f}%",
            _fmt(row.peop, ".2f"),
            _fmt(row.tokens_per_s, ",.0f"),
            _fmt(row.peak_memory_gb, ".2f"),
        ]
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
) -> str:
    """The report.md page: what was compared against what, the table, warnings, the plots."""
    direction = "lower is better" if mode == "min" else "higher is better"
    lower = f"**{summary.lower_reference}**" if summary.lower_reference else "nothing (PEoP blank)"
    lines = [
        f"# Report: {experiment}",
        "",
        f"- Metric: `{metric}` ({direction}); score = last logged value of each run, mean ± std over seeds.",
        f"- PRR against **{summary.reference}**, PEoP against {lower}, both on the seed-mean score.",
        "- Attention params = `params.attention` (Q/K/V/O projections and method extras, no biases).",
        f"- Runs: {n_runs} ({scope}).",
        "",
        rows_to_markdown(summary.rows, metric, mode),
    ]
    if warnings:
        lines += ["Warnings:", ""] + [f"- {warning}" for warning in warnings] + [""]
    lines += [f"![{path.stem}]({path.name})" for path in files if path.suffix == ".png"]
    return "\n".join(lines) + "\n"
