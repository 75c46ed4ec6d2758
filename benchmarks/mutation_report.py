"""Kill rate per file of a mutation-testing run (mutmut, configured in pyproject.toml's [tool.mutmut]).

    pip install -e ".[mutation]"
    mutmut run                                   # every mutant of models/attention, embeddings, reversible
    python -m benchmarks.mutation_report --out benchmarks/results

Reads `mutmut results --all true` (one `module.function__mutmut_N: status` line per mutant), counts the
statuses per source file and writes `<out>/<machine>/mutation.csv` plus a Markdown table on stdout.
Kill rate = (killed + timeout) / (killed + timeout + survived + no tests): a mutant that no selected test
executes counts as a survivor. Mutants not yet checked are reported and left out of the rate.
docs/mutation_testing.md explains the survivors.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from benchmarks.harness import Row, results_dir, write_csv

LINE = re.compile(r"^\s*(?P<name>[\w.ǁ]+)__mutmut_\d+: (?P<status>.+?)\s*$")
KILLED = ("killed", "timeout")
COUNTED = ("killed", "timeout", "survived", "no tests")


def source_file(mutant_function: str) -> str:
    """`models.attention.lsh.xǁLSHMechanismǁforward` -> `models/attention/lsh.py`."""
    module = mutant_function.rsplit(".", 1)[0]
    return module.replace(".", "/") + ".py"


def tally(lines: Iterable[str]) -> dict[str, Counter]:
    per_file: dict[str, Counter] = defaultdict(Counter)
    for line in lines:
        match = LINE.match(line)
        if match:
            per_file[source_file(match["name"])][match["status"]] += 1
    return dict(per_file)


def rows(per_file: dict[str, Counter]) -> list[Row]:
    out: list[Row] = []
    for path in sorted(per_file):
        counts = per_file[path]
        counted = sum(counts[s] for s in COUNTED)
        out.append({
            "file": path, "mutants": sum(counts.values()),
            **{s.replace(" ", "_"): counts[s] for s in COUNTED},
            "not_checked": sum(n for s, n in counts.items() if s not in COUNTED),
            "kill_rate": round(sum(counts[s] for s in KILLED) / counted, 4) if counted else float("nan"),
        })
    return out


def markdown(table: Sequence[Row]) -> str:
    head = "| file | mutants | killed | timeout | survived | no tests | not checked | kill rate |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['file']} | {r['mutants']} | {r['killed']} | {r['timeout']} | {r['survived']} | "
                     f"{r['no_tests']} | {r['not_checked']} | {r['kill_rate']:.1%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results", help="results root; files go to <out>/<machine>/")
    parser.add_argument("--results-file", default=None,
                        help="read a saved `mutmut results --all true` output instead of calling mutmut")
    args = parser.parse_args(argv)
    if args.results_file:
        text = Path(args.results_file).read_text()
    else:
        done = subprocess.run(["mutmut", "results", "--all", "true"], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"`mutmut results` failed (run `mutmut run` first):\n{done.stderr}")
        text = done.stdout
    table = rows(tally(text.splitlines()))
    if not table:
        raise SystemExit("no mutant results found: run `mutmut run` first")
    path = write_csv(table, results_dir(args.out, torch.device("cpu")) / "mutation.csv")
    print(markdown(table))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
