"""The report's uncertainty columns: each method's interval, its test against the reference with Holm's correction
and a verdict, intervals of PRR and PEoP, power, and the quality-vs-cost Pareto front with and without uncertainty.

Works on the table rows of `report_metrics.summarize` (which carry each run's seed and score); the statistics
themselves are `report_stats`'. docs/report.md explains every column this fills.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from orchestrator.report.costs import geometric_interval
from orchestrator.report.metrics import MethodRow, Mode, Summary, peop, prr
from orchestrator.report.pareto import Objective, non_dominated
from orchestrator.report.stats import (
    WELCH,
    Comparison,
    Interval,
    bootstrap_interval,
    compare,
    holm,
    holm_level,
    mean_interval,
    mean_of,
    ratio_interval,
    sign_flip_disagrees,
    with_power_at,
)

BETTER, WORSE, SAME, UNTESTED = "better", "worse", "indistinguishable", "n/a"


@dataclass(frozen=True)
class RowStats:
    """The uncertainty columns of one table row."""

    ci: Interval
    bootstrap: Interval | None
    comparison: Comparison | None
    """None for the reference itself."""
    p_holm: float
    verdict: str
    diff_ci: Interval
    """The difference's interval at the Holm-adjusted level (`holm_level`): it excludes 0 exactly when the verdict
    is better or worse, so the two never contradict each other on a row."""
    prr: float
    """PRR on the seeds its interval uses: those both ran when paired (a method on seeds 0-2 against a reference on
    0-4 is compared on 0-2), else every run of each; the same as the table's seed-mean PRR when the seeds match."""
    prr_ci: Interval
    peop: float
    """PEoP on the seeds its interval uses, as `prr`."""
    peop_ci: Interval
    tokens_ci: Interval
    """The interval of the geometric mean of tokens/s over seeds (log scale: costs.py); memory_ci likewise."""
    memory_ci: Interval
    on_front: bool
    """On the Pareto front of the means over quality and every cost the runs logged."""
    on_front_uncertain: bool
    """Not surely dominated: no other method is better or equal on every axis by its whole interval."""


@dataclass(frozen=True)
class Statistics:
    rows: Mapping[str, RowStats]
    alpha: float
    bootstrap: bool
    comparisons: int
    """m of Holm's correction: the methods tested against the reference."""
    front_axes: tuple[str, ...]
    notes: tuple[str, ...]
    reference: str | None
    """The label every row was tested against; None: no reference, so the tables have no PRR, PEoP or test columns
    (tables.py reads this, so a table never shows columns the statistics did not fill)."""


def _by_seed(row: MethodRow) -> tuple[dict[str, float], str]:
    """seed -> score, or run id -> score (never paired) when seeds are missing or repeat, with the reason."""
    seeds = list(row.seeds)
    if seeds and None not in seeds and len(set(seeds)) == len(seeds):
        return dict(zip(seeds, row.scores)), ""  # type: ignore[arg-type]
    why = "no seed param logged" if None in seeds else "several runs share a seed"
    return dict(zip(row.run_ids, row.scores)), why


def _welch_reason(row: MethodRow, ref: MethodRow, why: str) -> str:
    if why:
        return why
    return f"seeds {sorted(set(row.seeds), key=str)} vs {sorted(set(ref.seeds), key=str)}"


def verdict_of(comparison: Comparison | None, p_holm: float, alpha: float, mode: Mode) -> str:
    """better / worse (by the metric's direction) when Holm's p < alpha, else indistinguishable; n/a untested."""
    if comparison is None or math.isnan(p_holm):
        return UNTESTED
    if p_holm >= alpha:
        return SAME
    higher = comparison.diff > 0
    return BETTER if higher == (mode == "max") else WORSE


def _ratio_interval(row: MethodRow, other: MethodRow, of_ratio: Callable[[float], float], level: float,
                    seeds: Sequence[object] | None) -> tuple[float, Interval]:
    """(value, interval) of of_ratio(R), R = the ratio of row's seed mean to other's: on the `seeds` both ran when
    given (paired, the pairs of the test), else on every run of each. `of_ratio` is affine in R (PRR and PEoP
    are), so Fieller's interval of R maps onto it end to end; (-inf, inf) where that interval is unbounded."""
    if seeds is not None:
        mine, theirs = dict(zip(row.seeds, row.scores)), dict(zip(other.seeds, other.scores))
        x, y = [mine[s] for s in seeds], [theirs[s] for s in seeds]
    else:
        x, y = list(row.scores), list(other.scores)
    if not (x and y) or float(np.mean(y)) == 0.0:
        return math.nan, Interval.none()
    value = of_ratio(float(np.mean(x)) / float(np.mean(y)))
    interval = ratio_interval(x, y, level, paired=seeds is not None)
    if math.isinf(interval.low) or math.isinf(interval.high):  # the reference's mean may be 0: no bound
        return value, Interval(-math.inf, math.inf)
    ends = sorted((of_ratio(interval.low), of_ratio(interval.high)))
    return value, Interval(*ends) if all(math.isfinite(end) for end in ends) else Interval.none()


def _shared_seeds(row: MethodRow, other: MethodRow) -> list[object] | None:
    """The seeds both ran, in the order `compare` pairs them, when there are two or more (else unpaired)."""
    mine, theirs = _by_seed(row), _by_seed(other)
    if mine[1] or theirs[1]:
        return None
    shared = sorted(mine[0].keys() & theirs[0].keys(), key=str)
    return shared if len(shared) >= 2 else None


def analyse(summary: Summary, mode: Mode, *, alpha: float = 0.05, bootstrap: bool = False) -> Statistics:
    """The uncertainty columns of every row of `summary` (its reference and lower reference as in the table). Without
    a reference (`summary.reference` None) only those that need none: each score's interval, the costs' and the
    fronts; no test, PRR or PEoP, which all measure against it."""
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha={alpha} must be in (0, 0.5), e.g. 0.05 for 95% intervals")
    level = 1.0 - alpha
    rows = {row.label: row for row in summary.rows}
    ref = rows[summary.reference] if summary.reference is not None else None
    # PEoP is read next to PRR (as in the paper), so a report without the upper reference has neither.
    low = rows.get(summary.lower_reference) if summary.lower_reference and ref is not None else None
    comparisons, adjusted = _tested(summary.rows, ref, alpha) if ref is not None else ({}, {})
    m = sum(not math.isnan(comparison.p_value) for comparison in comparisons.values())
    fronts = _fronts(summary.rows, mode, level)
    out = {}
    for row in summary.rows:
        comparison = comparisons.get(row.label)
        p_holm = adjusted.get(row.label, math.nan)
        # PRR and PEoP are affine in the ratio R of seed means: prr(R, 1) and peop(R, 1, ...) are them at R.
        prr_point, prr_ci = row.prr, Interval.none()
        if comparison is not None and ref is not None:
            prr_point, prr_ci = _ratio_interval(row, ref, lambda r: prr(r, 1.0, mode), level, _shared_seeds(row, ref))
        peop_point, peop_ci = row.peop, Interval.none()
        if low is not None and row.label != low.label and math.isfinite(row.peop):
            peop_point, peop_ci = _ratio_interval(
                row, low, lambda r: peop(r, 1.0, row.params_attention, low.params_attention, mode), level,
                _shared_seeds(row, low))
        diff_ci = (comparison.interval(holm_level(alpha, comparison.p_value, p_holm)) if comparison is not None
                   else Interval.none())
        out[row.label] = RowStats(
            ci=mean_interval(row.scores, level),
            bootstrap=bootstrap_interval([row.scores], mean_of, level, paired=False) if bootstrap else None,
            comparison=comparison, p_holm=p_holm, verdict=verdict_of(comparison, p_holm, alpha, mode), diff_ci=diff_ci,
            prr=prr_point, prr_ci=prr_ci, peop=peop_point, peop_ci=peop_ci,
            tokens_ci=geometric_interval(row.tokens, level), memory_ci=geometric_interval(row.memory, level),
            on_front=fronts.point[row.label], on_front_uncertain=fronts.uncertain[row.label])
    notes = (["some methods ran other seeds than the reference: Welch's unpaired t-test for those rows"]
             if any(c.test == WELCH for c in comparisons.values()) else [])
    return Statistics(out, alpha, bootstrap, m, fronts.axes, tuple(notes), summary.reference)


def _tested(rows: Sequence[MethodRow], ref: MethodRow, alpha: float) -> tuple[dict[str, Comparison], dict[str, float]]:
    """Each row but `ref` tested against it, with its power and sign-flip check at the level its verdict uses; and
    Holm's adjusted p of each (one family: every row shares the reference)."""
    level = 1.0 - alpha
    ref_scores, ref_why = _by_seed(ref)
    comparisons: dict[str, Comparison] = {}
    for row in rows:
        if row.label == ref.label:
            continue
        scores, why = _by_seed(row)
        comparison = compare(scores, ref_scores, level)
        if comparison.test == WELCH:
            comparison = replace(comparison, note=_welch_reason(row, ref, why or ref_why))
        comparisons[row.label] = comparison
    labels = list(comparisons)
    adjusted = dict(zip(labels, holm([comparisons[label].p_value for label in labels])))
    for label, comparison in comparisons.items():  # power and the check at the level the verdict uses
        row_alpha = 1.0 - holm_level(alpha, comparison.p_value, adjusted[label])
        comparison = with_power_at(comparison, row_alpha)
        if note := sign_flip_disagrees(comparison, row_alpha):
            comparison = replace(comparison, note="; ".join(filter(None, [comparison.note, note])))
        comparisons[label] = comparison
    return comparisons, adjusted


@dataclass(frozen=True)
class _Fronts:
    axes: tuple[str, ...]
    point: Mapping[str, bool]
    uncertain: Mapping[str, bool]


def _fronts(rows: Sequence[MethodRow], mode: Mode, level: float) -> _Fronts:
    """Quality against every cost logged by all methods: attention params, tokens/s, peak memory (geometric means
    with their log-scale intervals, costs.py)."""
    objectives = [Objective("score", mode, [row.score_mean for row in rows],
                            [mean_interval(row.scores, level) for row in rows])]
    costs = (("params", "min", [row.params_attention for row in rows], None),
             ("tokens/s", "max", [row.tokens_per_s for row in rows],
              [geometric_interval(row.tokens, level) for row in rows]),
             ("peak memory", "min", [row.peak_memory_gb for row in rows],
              [geometric_interval(row.memory, level) for row in rows]))
    for name, sense, values, intervals in costs:
        if all(math.isfinite(value) for value in values) and len(set(values)) > 1:
            objectives.append(Objective(name, sense, values, intervals))  # type: ignore[arg-type]
    labels = [row.label for row in rows]
    return _Fronts(tuple(o.name for o in objectives), dict(zip(labels, non_dominated(objectives))),
                   dict(zip(labels, non_dominated(objectives, uncertain=True))))
