"""The order in which pytest-xdist hands work to its workers: the longest work units first.

pytest-xdist (`--dist loadgroup`) deals out work units (a group that must share a worker, or a single test) in the
order it is given them, and each worker asks for the next when it is done. In the slow tier the units take from
a second to 17 minutes, and in collection order two of the longest (the S3 sweeps, 4 and 2 minutes) came last: in
the run measured, one worker ran the second alone for its last two minutes while the other had nothing left
(docs/testing.md, "Ordering helps only at the end"). Dealing the longest first (the LPT rule) leaves the short
ones for the end, where they even the workers out.

A unit's length is the sum of its tests' times in the slow tier's last recorded run (SECONDS_FILE). A slow test
not in it yet (a new one) counts as the longest recorded test, so that it goes early: a short one there costs
nothing, a long one last would cost its whole length. Without recorded times (the fast tier), units go by their
number of tests, as pytest-xdist's own reorder does, which pyproject's `--no-loadscope-reorder` leaves to this.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

SECONDS_FILE = Path(__file__).with_name("slow_tier_seconds.json")
RECORD_ENV = "RECORD_TEST_SECONDS"
"""Set to a path, a session writes there each test's time (setup, call and teardown, in seconds) as SECONDS_FILE
holds them: `RUN_SLOW=1 RECORD_TEST_SECONDS=tests/slow_tier_seconds.json python -m pytest -q -m slow`."""

Item = TypeVar("Item")


def recorded_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def longest_first(items: Sequence[Item], unit_of: Callable[[Item], str], test_id: Callable[[Item], str],
                  is_slow: Callable[[Item], bool], seconds: dict[str, float]) -> list[Item]:
    """`items` reordered unit by unit, the longest unit first; a unit's items stay together and in their order.
    Ties (every unit, without recorded times) go by the unit's number of tests, then by collection order."""
    unknown_slow = max(seconds.values(), default=0.0)
    units: dict[str, list[Item]] = {}
    for item in items:
        units.setdefault(unit_of(item), []).append(item)

    def expected(item: Item) -> float:
        known = seconds.get(test_id(item))
        if known is not None:
            return known
        return unknown_slow if is_slow(item) else 0.0

    def length(unit: list[Item]) -> tuple[float, int]:
        return sum(expected(item) for item in unit), len(unit)

    ordered = sorted(units.values(), key=length, reverse=True)  # sorted() is stable: equal units keep their order
    return [item for unit in ordered for item in unit]


def bare_id(nodeid: str) -> str:
    """A test's id without the `@group` pytest-xdist appends to the tests of an xdist_group."""
    name, _, group = nodeid.rpartition("@")
    return name if name and "]" not in group and "::" not in group else nodeid


def write_seconds(path: str, durations: Iterable[tuple[str, float]]) -> None:
    """Sum each test's phases and write them, rounded to 0.1 s, sorted by id."""
    totals: dict[str, float] = {}
    for nodeid, duration in durations:
        key = bare_id(nodeid)
        totals[key] = totals.get(key, 0.0) + duration
    Path(path).write_text(json.dumps({k: round(v, 1) for k, v in sorted(totals.items())}, indent=1) + "\n")


def record_path() -> str | None:
    return os.environ.get(RECORD_ENV) or None
