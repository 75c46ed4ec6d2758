"""PNG plots of a report: score vs attention parameters, validation curves, knob sweeps, and the patching
experiment's score and speed-up against the number of patched layers.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so plotting needs no display,
touches no global backend state and is safe inside Ray workers or a headless CI box.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from orchestrator.report.compare import Statistics
from orchestrator.report.metrics import MethodRow, Mode
from orchestrator.report.pareto import pareto_front
from orchestrator.report.stats import Interval

_DPI = 120
_FRONT, _DOMINATED = "tab:red", "tab:gray"


def _new_figure(width: float = 7.0, height: float = 4.5) -> tuple[Figure, object]:
    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _metric_axis_label(metric: str, mode: Mode) -> str:
    return f"{metric} ({'lower' if mode == 'min' else 'higher'} is better)"


def _score_error(row: MethodRow, stats: Statistics | None) -> object:
    """Error bar of a score: its confidence interval with `stats`, else the seed std; None without either."""
    if stats is not None:
        ci = stats.rows[row.label].ci
        if math.isnan(ci.low):
            return None
        return [[row.score_mean - ci.low], [ci.high - row.score_mean]]
    return None if math.isnan(row.score_std) else row.score_std


def front_line(params: Sequence[float], scores: Sequence[float],
               front: Sequence[bool]) -> tuple[list[float], list[float]]:
    """The Pareto front as the staircase the score plot draws: its points by size, each score held up to the next
    point (the best score reachable with no more parameters), and the last one held to the largest model
    plotted, since a larger model off the front does no better. A front of one point that is also the largest
    model is that point alone: no line (the legend then shows the front as a marker only)."""
    on_front = sorted((p, s) for p, s, f in zip(params, scores, front) if f)
    if not on_front:
        return [], []
    xs, ys = [p for p, _ in on_front], [s for _, s in on_front]
    largest = max(p for p, s in zip(params, scores) if math.isfinite(p) and math.isfinite(s))
    if largest > xs[-1]:
        xs.append(largest)
        ys.append(ys[-1])
    return xs, ys


def score_vs_params_figure(rows: Sequence[MethodRow], metric: str, mode: Mode,
                           stats: Statistics | None = None) -> Figure | None:
    """The figure of `plot_score_vs_params`; None when no method logged its attention parameter count."""
    points = [row for row in rows if not math.isnan(row.params_attention) and row.params_attention > 0]
    if not points:
        return None
    fig, ax = _new_figure()
    params = [row.params_attention for row in points]
    scores = [row.score_mean for row in points]
    front = pareto_front(params, scores, mode)
    for row, on_front in zip(points, front):
        ax.errorbar(
            row.params_attention,
            row.score_mean,
            yerr=_score_error(row, stats),
            fmt="o",
            color=_FRONT if on_front else _DOMINATED,
            capsize=3,
        )
        ax.annotate(row.label, (row.params_attention, row.score_mean), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    xs, ys = front_line(params, scores, front)
    # Step "post": between two front points the best reachable score is the smaller model's.
    ax.step(xs, ys, where="post", color=_FRONT, linestyle="--")
    # The legend describes what is drawn: a dashed line only where the front has one, markers always.
    handles = [Line2D([], [], color=_FRONT, marker="o", linestyle="--" if len(xs) > 1 else "None",
                      label="Pareto front")]
    if not all(front):
        handles.append(Line2D([], [], color=_DOMINATED, marker="o", linestyle="None", label="dominated"))
    ax.legend(handles=handles, loc="best", fontsize=8)
    ax.set_xscale("log")
    # Room for the labels of the outermost points, which would otherwise run past the figure's edge.
    ax.margins(x=0.12, y=0.08)
    ax.set_xlabel("attention parameters (incl. output projection, no biases)")
    ax.set_ylabel(_metric_axis_label(metric, mode))
    ax.set_title(f"{metric} vs attention parameters")
    ax.grid(True, which="both", alpha=0.3)
    return fig


def plot_score_vs_params(rows: Sequence[MethodRow], metric: str, mode: Mode, path: Path,
                         stats: Statistics | None = None) -> Path | None:
    """Score against attention parameters on a log axis, with the Pareto front drawn as a step line
    (`front_line`); error bars are the score's confidence interval (`stats`), else the seed std.

    Returns None (no file) when no method logged its attention parameter count.
    """
    fig = score_vs_params_figure(rows, metric, mode, stats)
    return None if fig is None else _save(fig, path)


_COSTS = (("params", "attention parameters", "params_attention", None),
          ("tokens/s", "training tokens/s (higher is better)", "tokens_per_s", "tokens_ci"),
          ("peak memory", "peak memory, GB", "peak_memory_gb", "memory_ci"))


def plot_cost_front(rows: Sequence[MethodRow], stats: Statistics, metric: str, mode: Mode,
                    path: Path) -> Path | None:
    """Quality against each cost on the report's Pareto front (params, tokens/s, peak memory), one panel each,
    with interval bars on both axes: red on the front of the means, orange dominated only within the intervals,
    grey surely dominated. None (no file) when no cost was logged by every method."""
    panels = [cost for cost in _COSTS if cost[0] in stats.front_axes]
    if not panels:
        return None
    fig = Figure(figsize=(4.2 * len(panels), 4.2), dpi=_DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (_, xlabel, attribute, interval_name) in zip(axes, panels):
        for row in rows:
            row_stats = stats.rows[row.label]
            x = getattr(row, attribute)
            xerr = None
            if interval_name is not None:
                interval = getattr(row_stats, interval_name)
                if not math.isnan(interval.low):
                    xerr = [[x - interval.low], [interval.high - x]]
            color = _FRONT if row_stats.on_front else "tab:orange" if row_stats.on_front_uncertain else _DOMINATED
            ax.errorbar(x, row.score_mean, xerr=xerr, yerr=_score_error(row, stats), fmt="o", color=color, capsize=3)
            ax.annotate(row.label, (x, row.score_mean), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if attribute == "params_attention":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(_metric_axis_label(metric, mode))
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{metric} against cost: red on the front, orange within the intervals, grey dominated",
                 fontsize=9)
    return _save(fig, path)


def plot_curves(curves: Mapping[str, pd.Series], metric: str, mode: Mode, path: Path) -> Path | None:
    """One seed-mean curve per method (`curves`: label -> values indexed by step)."""
    drawable = {label: curve for label, curve in curves.items() if len(curve) > 0}
    if not drawable:
        return None
    fig, ax = _new_figure()
    for label, curve in drawable.items():
        ax.plot(curve.index, curve.values, marker="." if len(curve) < 30 else None, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(_metric_axis_label(metric, mode))
    ax.set_title(f"{metric} during training (mean over seeds)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


@dataclass(frozen=True)
class KnobSweep:
    """Methods of one kind that differ in a numeric knob: x = that knob, one line per other setting."""

    kind: str
    knob: str
    # Line label (the other knobs, e.g. "sharing=layerwise") -> [(knob value, row)], sorted by value.
    lines: Mapping[str, list[tuple[float, MethodRow]]]


def _as_float(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def find_knob_sweeps(rows: Sequence[MethodRow]) -> list[KnobSweep]:
    """Numeric knobs with at least two values within one kind, e.g. Linformer `k` in {64, 128, 256}."""
    sweeps = []
    kinds = sorted({row.kind for row in rows if row.kind is not None})
    for kind in kinds:
        of_kind = [row for row in rows if row.kind == kind]
        knob_names = sorted({name for row in of_kind for name in row.knobs})
        for knob in knob_names:
            having = [row for row in of_kind if knob in row.knobs]
            values = [_as_float(row.knobs[knob]) for row in having]
            if any(value is None for value in values) or len(set(values)) < 2:
                continue
            lines: dict[str, list[tuple[float, MethodRow]]] = {}
            for row, value in zip(having, values):
                others = " ".join(f"{name}={v}" for name, v in row.knobs.items() if name != knob) or kind
                lines.setdefault(others, []).append((value, row))
            sorted_lines = {name: sorted(points, key=lambda p: p[0]) for name, points in lines.items()}
            sweeps.append(KnobSweep(kind=kind, knob=knob, lines=sorted_lines))
    return sweeps


def plot_knob_sweep(
    sweep: KnobSweep,
    metric: str,
    mode: Mode,
    references: Sequence[MethodRow],
    path: Path,
) -> Path:
    """Score against a knob value, with the reference methods as dashed horizontal lines."""
    fig, ax = _new_figure()
    for name, points in sweep.lines.items():
        xs = [value for value, _ in points]
        ys = [row.score_mean for _, row in points]
        errs = [0.0 if math.isnan(row.score_std) else row.score_std for _, row in points]
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=name)
    for row, style in zip(references, ("--", ":")):
        ax.axhline(row.score_mean, linestyle=style, color="black", linewidth=1, label=row.label)
    values = sorted({value for points in sweep.lines.values() for value, _ in points})
    # Knobs like Linformer k or bucket sizes are usually swept in powers of two.
    if values[0] > 0 and values[-1] / values[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{sweep.kind}: {sweep.knob}")
    ax.set_ylabel(_metric_axis_label(metric, mode))
    ax.set_title(f"{sweep.kind}: {metric} vs {sweep.knob}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


def knob_plot_name(sweep: KnobSweep) -> str:
    """File name for a sweep plot, safe on every filesystem and in artifact paths."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{sweep.kind}_{sweep.knob}")
    return f"knob_{safe}.png"


@dataclass(frozen=True)
class PatchPoint:
    """One point of the patching plot: l patched layers, the score's seed mean and interval, the speed-ups'
    geometric means over seeds (NaN where not logged)."""

    layers: float
    score: float
    ci: Interval
    speedup: float
    attention_speedup: float


def patching_figure(lines: Mapping[str, Sequence[PatchPoint]], metric: str, mode: Mode) -> Figure:
    """HyperAttention's Figure 3 (Han et al., 2023): the score against the number of patched layers l with its
    interval bars (left) and the speed-up over the unpatched model against l (right; solid: the attention layers'
    time, the paper's measure; dashed: the whole forward), one colour per mechanism configuration. Every line
    starts at the unpatched model (l = 0), which `lines` repeats at the start of each."""
    fig = Figure(figsize=(11.0, 4.5), dpi=_DPI)
    FigureCanvasAgg(fig)
    score_ax, speed_ax = fig.subplots(1, 2)
    colours = [f"C{i % 10}" for i in range(len(lines))]
    for colour, (label, points) in zip(colours, lines.items()):
        xs = [point.layers for point in points]
        errors = [[0.0 if math.isnan(p.ci.low) else p.score - p.ci.low for p in points],
                  [0.0 if math.isnan(p.ci.high) else p.ci.high - p.score for p in points]]
        score_ax.errorbar(xs, [p.score for p in points], yerr=errors, marker="o", capsize=3, color=colour,
                          label=label)
        speed_ax.plot(xs, [p.attention_speedup for p in points], marker="o", color=colour,
                      label=f"{label}: attention")
        speed_ax.plot(xs, [p.speedup for p in points], marker=".", linestyle="--", color=colour,
                      label=f"{label}: forward")
    speed_ax.axhline(1.0, color="black", linewidth=1, linestyle=":")
    score_ax.set_ylabel(_metric_axis_label(metric, mode))
    speed_ax.set_ylabel("speed-up over the unpatched model (x)")
    titles = (f"{metric} vs patched layers", "speed-up vs patched layers (solid: attention, dashed: forward)")
    for ax, title in zip((score_ax, speed_ax), titles):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("patched layers l (0 = unpatched)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if lines:
            ax.legend(loc="best", fontsize=7)
    return fig


def plot_patching(lines: Mapping[str, Sequence[PatchPoint]], metric: str, mode: Mode, path: Path) -> Path:
    """`patching_figure` written to `path`."""
    return _save(patching_figure(lines, metric, mode), path)
