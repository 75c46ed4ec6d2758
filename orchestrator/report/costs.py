"""Costs over seeds (training tokens/s, peak memory, a patched model's speed-up): geometric means with intervals on
the log scale.

A cost is positive and compared as a ratio (twice the throughput, half the memory), and its noise scales it: a
busier machine slows every step of a run by a factor. So a method's cost is the geometric mean of its seeds, and
its interval is the Student-t interval of the mean of the log costs mapped back with exp, an interval of the
geometric mean: never below 0, and as wide in ratio above the estimate as below it. The t interval of the raw
values, which the report printed until 2026-12-01, reached below 0 for costs that vary much over 2-3 seeds (MQAR's
hyper at -179 answers/s in benchmarks/RESULTS.md). A speed-up is already a per-seed ratio measured in one process
(the unpatched forward's time over the patched one's), so the interval of its geometric mean is that of the
paired ratio. A logged cost that is not a positive finite number has no logarithm: that method's cost then has no
mean or interval, and `cost_warnings` says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from orchestrator.report.stats import Interval, mean_interval


def _usable(values: Sequence[float]) -> bool:
    return all(math.isfinite(value) and value > 0.0 for value in values)


def geometric_mean(values: Sequence[float]) -> float:
    """exp(mean(log x)) over the seeds; NaN with none, or where one is not a positive finite number."""
    if not values or not _usable(values):
        return math.nan
    if min(values) == max(values):  # exp(log x) can be x off by a rounding, which would make equal costs differ
        return float(values[0])
    return float(np.exp(np.mean(np.log(values))))


def geometric_interval(values: Sequence[float], level: float) -> Interval:
    """The geometric mean's interval at `level`: exp of the Student-t interval of mean(log x) over the seeds. NaN
    with fewer than two values or one not a positive finite number; (g, g) when every seed logged the same."""
    if len(values) < 2 or not _usable(values):
        return Interval.none()
    if min(values) == max(values):  # no spread: the value itself, not exp(log x) a rounding away from it
        return Interval(float(values[0]), float(values[0]))
    logs = mean_interval(np.log(values), level)
    with np.errstate(over="ignore"):  # a spread past float range is an unbounded interval, not an OverflowError
        return Interval(float(np.exp(logs.low)), float(np.exp(logs.high)))


def cost_warnings(label: str, costs: Mapping[str, Sequence[float]]) -> list[str]:
    """One warning per cost (name -> the values the runs of `label` logged) with a value that is not a positive
    finite number: that cost of the method is then blank ("-"), and no axis of the Pareto front (which takes the
    costs every method has)."""
    return [f"{label}: a logged {name} of {bad[0]:g} is not a positive number (a failed measurement?), so its "
            f"{name} has no geometric mean or interval" for name, values in costs.items()
            if (bad := [value for value in values if not (math.isfinite(value) and value > 0.0)])]
