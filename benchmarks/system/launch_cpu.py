"""CPU seconds of one launch, per process: where a 2-core machine's time goes when it runs `orchestrator train`.

The real-process test tier (docs/testing.md) is CPU-bound on 2 cores, and most of its cases are one to three
launches of a tiny run, so a launch's CPU seconds, not its wall time, say what a case costs. This runs a command
in a session of its own and samples /proc every `--interval` seconds: each process of the session (Ray's daemons
and actor processes included; they stay in the launcher's session) is kept with the last CPU time seen (user +
system), under a kind read from its command line: `ray::<Actor>` for Ray's actor processes, the script or
module for the rest. A process that lives less than one interval may be missed, and CPU spent after the last
sample of a process is not counted, so the totals are lower bounds (a few tenths of a second per process).

    python -m benchmarks.system.launch_cpu --repeats 2 --out benchmarks/results   # the tests' tiny 24-step run
    python -m benchmarks.system.launch_cpu --repeats 4 --label after --against /tmp/before --out benchmarks/results
    python -m benchmarks.system.launch_cpu --trials 3 --repeats 4 --label sweep3-after --against /tmp/before \
        --against-label sweep3-before --out benchmarks/results   # a 3-trial sweep, one trial at a time

The second line measures this checkout and another (a `git worktree` at /tmp/before, labelled `before`) in turn,
each repeat: each launch has its checkout first on PYTHONPATH, which orchestrator/cluster/ray_env.py hands on to
the processes of its local Ray.

Without `-- COMMAND`, the command is `python -m orchestrator train` of the real-process tier's spec
(tests/real_runs.py `write_spec`: a 1-layer d_model 16 causal LM, 24 steps, a checkpoint every 4, SQLite MLflow)
in a temporary folder; with `--trials N`, `python -m orchestrator sweep` of N such runs (a grid of learning
rates, FIFO, one trial at a time). The CSV gets one row per (label, repeat, process kind) and a total per repeat,
with the checkout's commit (`+dirty` when its tracked files differ from it); a run replaces its labels' rows and
keeps the others, so a sweep's rows want labels of their own (`--label sweep3-after`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.harness import Row, code_version, read_csv, results_dir, write_csv

TICKS = os.sysconf("SC_CLK_TCK")
SITE = re.compile(r"^.*?/site-packages/")


def process_kind(cmdline: str) -> str:
    """`ray::TrainController`, `raylet`, `ray/dashboard/agent.py`, `-m orchestrator train`: what a process is."""
    if cmdline.startswith("ray::"):
        return cmdline.split()[0].split(".")[0]  # ray::_QueueActor.get -> ray::_QueueActor
    words = cmdline.split()
    if not words:
        return "(exited)"
    if "-m" in words[:3]:
        at = words.index("-m")
        return " ".join(["-m", *words[at + 1:at + 3]])
    script = next((w for w in words[1:] if w.endswith(".py")), words[0])
    return SITE.sub("", script).rsplit("/src/ray/", 1)[-1]


def session_cpu(session: int) -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds so far) of every process in `session`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) != session:
                continue
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found[int(entry)] = (cmdline.strip(), (int(fields[11]) + int(fields[12])) / TICKS)
        except (OSError, ValueError, IndexError):
            continue  # gone between the listing and the read
    return found


def measure(command: Sequence[str], cwd: Path, interval: float,
            env: dict[str, str] | None = None) -> tuple[Counter[str], float, int]:
    """CPU seconds per process kind of `command` run to its end, its wall seconds and exit code."""
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    last: dict[int, tuple[str, float]] = {}
    while proc.poll() is None:
        for pid, (cmdline, cpu) in session_cpu(proc.pid).items():
            # A process that has exited keeps its last command line (a zombie's is empty).
            last[pid] = (cmdline or last.get(pid, ("", 0.0))[0], cpu)
        time.sleep(interval)
    by_kind: Counter[str] = Counter()
    for cmdline, cpu in last.values():
        by_kind[process_kind(cmdline)] += cpu
    return by_kind, time.monotonic() - start, proc.returncode


def tiny_launch(folder: Path, trials: int = 0) -> list[str]:
    """The real-process tier's tiny run (tests/real_runs.py), as a command in `folder`; with `trials`, a FIFO sweep
    of that many of them (learning rates apart), one at a time, as the tier's sweeps that are killed midway run."""
    from tests.real_runs import write_spec  # importable from the repository root, where benchmarks run

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    if not trials:
        return [sys.executable, "-m", "orchestrator", "train", str(write_spec(folder, "launch-cpu", uri))]
    rates = [round(3e-3 / (i + 1), 6) for i in range(trials)]
    spec = write_spec(folder, "launch-cpu", uri, optim={"lr": {"grid": rates}}, tune={"max_concurrent": 1})
    return [sys.executable, "-m", "orchestrator", "sweep", str(spec)]


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples of /proc")
    parser.add_argument("--out", default=None, help="results root; the CSV goes to <out>/<machine>/launch_cpu.csv")
    parser.add_argument("--label", default="latest", help="the rows' label (after, ...)")
    parser.add_argument("--against", default=None, metavar="CHECKOUT",
                        help="another checkout, measured in turn with this one each repeat, labelled --against-label")
    parser.add_argument("--against-label", default="before")
    parser.add_argument("--trials", type=int, default=0,
                        help="measure a FIFO sweep of this many tiny runs, one at a time, instead of one run")
    parser.add_argument("command", nargs="*", help="after --: the command to measure (default: the tiny run)")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[2]
    sides = [(args.label, here)] + ([(args.against_label, Path(args.against).resolve())] if args.against else [])
    rows: list[Row] = []
    for repeat in range(1, args.repeats + 1):
        for label, checkout in sides:
            version = code_version(checkout)
            with tempfile.TemporaryDirectory(prefix="launch-cpu-") as tmp:
                folder = Path(tmp)
                command = args.command or tiny_launch(folder, args.trials)
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(checkout),
                                                                                os.environ.get("PYTHONPATH"))))}
                by_kind, wall, code = measure(command, folder, args.interval, env)
            total = sum(by_kind.values())
            print(f"{label} ({version}) repeat {repeat}: {total:.1f} CPU-s over {wall:.1f} s wall, exit {code}")
            for kind, cpu in by_kind.most_common():
                print(f"  {cpu:6.2f}  {kind}")
                rows.append({"label": label, "version": version, "repeat": repeat, "process": kind,
                             "cpu_s": round(cpu, 2)})
            rows.append({"label": label, "version": version, "repeat": repeat, "process": "(all)",
                         "cpu_s": round(total, 2), "wall_s": round(wall, 1), "exit_code": code})
    if args.out:
        path = results_dir(args.out, torch.device("cpu")) / "launch_cpu.csv"
        labels = {label for label, _ in sides}
        kept = [row for row in (read_csv(path) if path.exists() else []) if row.get("label") not in labels]
        print(f"wrote {write_csv([*kept, *rows], path)}")
    return rows


if __name__ == "__main__":
    main()
