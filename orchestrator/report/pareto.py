"""Pareto fronts: which points no other point beats on every objective, from point values or from intervals.

Used for the report's quality-vs-cost front (orchestrator/report/compare.py) and for the trials of a sweep with
several objectives (orchestrator/report/objectives.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrator.report.stats import Interval

Mode = Literal["min", "max"]


@dataclass(frozen=True)
class Objective:
    """One axis of a Pareto front: a name, which way is better, and per point its value and interval."""

    name: str
    mode: Mode
    values: Sequence[float]
    intervals: Sequence[Interval] | None = None


def non_dominated(objectives: Sequence[Objective], *, uncertain: bool = False) -> list[bool]:
    """Which points no other point dominates: at least as good on every objective and better on one. With
    `uncertain`, a point is only dominated when the other's worst end (of its interval) is at least as good as
    its best end on every objective, and better on one; a point without an interval counts as exact. A point
    with a NaN value is never on the front, nor dominates."""
    n = len(objectives[0].values) if objectives else 0

    def ends(o: Objective, i: int) -> tuple[float, float]:
        """(worst, best) of point i on objective o, both as 'higher is better' numbers."""
        s = 1.0 if o.mode == "max" else -1.0
        value = o.values[i]
        interval = o.intervals[i] if (uncertain and o.intervals is not None) else None
        if interval is None or math.isnan(interval.low):
            return s * value, s * value
        a, b = s * interval.low, s * interval.high
        return min(a, b), max(a, b)

    valid = [all(math.isfinite(o.values[i]) for o in objectives) for i in range(n)]
    front = []
    for i in range(n):
        if not valid[i]:
            front.append(False)
            continue
        dominated = False
        for j in range(n):
            if j == i or not valid[j]:
                continue
            worst_j = [ends(o, j)[0] for o in objectives]
            best_i = [ends(o, i)[1] for o in objectives]
            if all(a >= b for a, b in zip(worst_j, best_i)) and any(a > b for a, b in zip(worst_j, best_i)):
                dominated = True
                break
        front.append(not dominated)
    return front


def pareto_front(params: Sequence[float], scores: Sequence[float], mode: Mode) -> list[bool]:
    """Which (params, score) points no other point beats: as small and as good, better in one.

    NaN points are never on the front.
    """
    return non_dominated([Objective("params", "min", params), Objective("score", mode, scores)])
