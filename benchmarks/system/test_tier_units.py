"""Where a test tier's time went, per pytest-xdist scheduling unit, from the log of a run with `--durations=0`.

Under `--dist loadgroup` a test of an xdist group (its nodeid ends in `@<group>`: tests/conftest.py,
`_worker_group`) runs on its group's one worker, and any other test goes to whichever worker is free. So the
tier's wall time is at least the largest unit and about the sum over units divided by the workers when the workers
stay busy; the ratio of the two says whether ordering the units could save anything (it cannot when the workers
were busy all along) or only less work per unit can.

    RUN_SLOW=1 python -m pytest -q -m slow --durations=0 > slow.log
    python -m benchmarks.system.test_tier_units slow.log --workers 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.harness import Row, results_dir, write_csv
from tests.schedule import bare_id

DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*)$")
WALL = re.compile(r" in (\d+(?:\.\d+)?)s(?: \(|$)")


def unit_of(nodeid: str) -> str:
    """The scheduling unit: `@group` for a grouped test, the nodeid (parameters included) otherwise. The suffix is
    told from an `@` in a test's own parameters as tests/schedule.py tells it."""
    bare = bare_id(nodeid)
    return nodeid[len(bare):] if bare != nodeid else nodeid


def read_log(text: str) -> tuple[Counter[str], float | None]:
    """Seconds per unit (setup, call and teardown summed) and the run's wall time from pytest's last line."""
    units: Counter[str] = Counter()
    for line in text.splitlines():
        found = DURATION.match(line.strip())
        if found:
            units[unit_of(found.group(3).strip())] += float(found.group(1))
    walls = [float(w) for line in text.splitlines() if " passed" in line or " failed" in line
             for w in WALL.findall(line)]  # pytest's summary line: "117 passed, 2 errors in 2659.29s (0:44:19)"
    return units, (walls[-1] if walls else None)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="pytest's output of a run with --durations=0")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers of that run")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default=None, help="results root; the CSV goes to <out>/<machine>/test_tier_units.csv")
    args = parser.parse_args(argv)
    units, wall = read_log(args.log.read_text())
    if not units:
        raise SystemExit(f"{args.log}: no duration lines; run pytest with --durations=0")
    total = sum(units.values())
    busy = f", workers busy {total / (args.workers * wall):.0%} of the wall time" if wall else ""
    print(f"{len(units)} units, {total:.0f} test-seconds; largest {max(units.values()):.0f} s; "
          f"wall {wall or float('nan'):.0f} s on {args.workers} workers{busy}")
    rows: list[Row] = []
    for unit, seconds in units.most_common():
        rows.append({"unit": unit, "seconds": round(seconds, 2), "share": round(seconds / total, 4)})
    for row in rows[: args.top]:
        print(f"  {row['seconds']:7.1f} s  {row['share']:5.1%}  {row['unit'][:110]}")
    if args.out:
        print(f"wrote {write_csv(rows, results_dir(args.out, torch.device('cpu')) / 'test_tier_units.csv')}")
    return rows


if __name__ == "__main__":
    main()
