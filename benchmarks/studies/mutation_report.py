"""Kill rate per file of a mutation-testing run (mutmut, configured in pyproject.toml's [tool.mutmut]).

    pip install -e ".[mutation]"
    mutmut run                                   # every mutant of models/attention, embeddings, reversible
    python -m benchmarks.studies.mutation_report --out benchmarks/results

Reads `mutmut results --all true` (one `module.function__mutmut_N: status` line per mutant), counts the
statuses per source file and writes `<out>/<machine>/mutation.csv` plus a Markdown table on stdout.
Kill rate = (killed + timeout) / (killed + timeout + survived + no tests): a mutant that no selected test
executes counts as a survivor. Mutants not yet checked are reported and left out of the rate; a file none of
whose mutants was checked (a run limited to other files, `mutmut run "models.embeddings*"`) gets no row.

One class of survivors is equivalent on a CPU-only machine and is counted separately: a mutant whose only
change is a `device=` argument or a `.to(<...>.device)` (dropped, or set to None) places a tensor on the CPU,
where everything already is. It is found by diffing the mutant's function against the original in mutmut's
`mutants/` copy (functions `<name>__mutmut_<N>` and `<name>__mutmut_orig`). `kill_rate_non_device` leaves
those out. docs/mutation_testing.md explains the other survivors.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from benchmarks.harness import Row, results_dir, write_csv

LINE = re.compile(r"^\s*(?P<name>[\w.ǁ]+)__mutmut_(?P<n>\d+): (?P<status>.+?)\s*$")
KILLED = ("killed", "timeout")
COUNTED = ("killed", "timeout", "survived", "no tests")


def _normalised(line: str) -> str:
    line = re.sub(r"\.to\((None|[\w.]*device)\)", ".to()", line)
    line = re.sub(r"device=[\w.\[\]]+", "", line)
    return re.sub(r",?\s*\)", ")", re.sub(r"\s+", " ", line)).strip()


def device_only_mutants(path: str, mutants_dir: Path = Path("mutants")) -> set[str]:
    """Mutant function names (`...__mutmut_N`) in `path` whose only change is a tensor's device."""
    copy = mutants_dir / path
    if not copy.exists():
        return set()
    source = copy.read_text()
    lines = source.splitlines()
    functions = {node.name: lines[node.lineno:node.end_lineno] for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef)}  # bodies only: the def lines differ by name
    found = set()
    for name, body in functions.items():
        base, sep, _ = name.rpartition("__mutmut_")
        original = functions.get(base + "__mutmut_orig")
        if sep and original is not None and body != original and len(body) == len(original) and all(
                _normalised(a) == _normalised(b) for a, b in zip(body, original)):
            found.add(name)
    return found


def source_file(mutant_function: str) -> str:
    """`models.attention.lsh.xǁLSHMechanismǁforward` -> `models/attention/lsh.py`."""
    module = mutant_function.rsplit(".", 1)[0]
    return module.replace(".", "/") + ".py"


def tally(lines: Iterable[str]) -> dict[str, Counter]:
    per_file: dict[str, Counter] = defaultdict(Counter)
    device_only: dict[str, set[str]] = {}
    for line in lines:
        match = LINE.match(line)
        if match:
            path = source_file(match["name"])
            per_file[path][match["status"]] += 1
            if match["status"] == "survived":
                if path not in device_only:
                    device_only[path] = device_only_mutants(path)
                function = match["name"].rsplit(".", 1)[1] + "__mutmut_" + match["n"]
                per_file[path]["survived, device only"] += function in device_only[path]
    return dict(per_file)


def rows(per_file: dict[str, Counter]) -> list[Row]:
    out: list[Row] = []
    for path in sorted(per_file):
        counts = per_file[path]
        counted = sum(counts[s] for s in COUNTED)
        if not counted:  # no mutant of the file checked in this run (`mutmut run` given other files' names)
            continue
        out.append({
            "file": path, "mutants": sum(n for s, n in counts.items() if s != "survived, device only"),
            **{s.replace(" ", "_"): counts[s] for s in COUNTED},
            "survived_device_only": counts["survived, device only"],
            "not_checked": sum(n for s, n in counts.items() if s not in COUNTED and s != "survived, device only"),
            "kill_rate": round(sum(counts[s] for s in KILLED) / counted, 4) if counted else float("nan"),
            "kill_rate_non_device": round(sum(counts[s] for s in KILLED) / (counted - counts["survived, device only"]), 4)
            if counted > counts["survived, device only"] else float("nan"),
        })
    return out


def markdown(table: Sequence[Row]) -> str:
    head = ("| file | mutants | killed | timeout | survived (device only) | no tests | not checked | kill rate | "
            "kill rate, device-only left out |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['file']} | {r['mutants']} | {r['killed']} | {r['timeout']} | {r['survived']} "
                     f"({r['survived_device_only']}) | {r['no_tests']} | {r['not_checked']} | {r['kill_rate']:.1%} | "
                     f"{r['kill_rate_non_device']:.1%} |")
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
        done = subprocess.run(["mutmut", "results", "--all", "true"], check=False, capture_output=True, text=True)
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
