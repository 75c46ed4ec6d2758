"""`--budget SECONDS` of benchmarks.gpu.suite: which parts, and how many of each part's cases, fit the time left.

The suite runs its steps in order of value (`STEPS`): correctness first (kernel parity on its covering subset,
every axis value once), then the training step, the sweep, flash vs SDPA, long attention, its profile, and last
the rest of kernel parity. Before each step the planner (`decide`) takes the seconds left and the step's estimate: the step
runs whole if it fits, shrinks to the most leading cases that fit (each part orders its cases so the leading ones
are the ones to keep: parity's covering subset, the shortest lengths), or is skipped with the estimate and the
time left as its reason; then the next step is weighed, so a cheap part after a skipped one still runs. `plan`
applies `decide` to every remaining step at once, which the suite prints before it starts.

Estimates (`Estimates`): a part costs `setup + cases x per_case` seconds. Before a part has run, its cost comes
from `GPU_COSTS`, the latest GPU run's (`H200_COSTS`: benchmarks/results/nvidia-h200/, commit 4c388e2, torch
2.11.0+cu130, triton 3.6.0, with the parts as they are now; `H100_COSTS` were the first run's, at commit cce97ac), times the ratio of measured to estimated seconds over the steps that ran so
far in this run (a slower card, or a dry run's toy sizes on a CPU, scale every estimate alike). Once a part has
run, its own measured seconds per case replace its row. A dry run starts from `DRY_COSTS` instead (its toy sizes
have nothing to do with an H100's seconds).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Cost:
    """Seconds of a part: a one-off `setup` (imports, first compiles) plus `per_case` for each case it runs, its
    cases run `parallel` at a time (kernel parity's processes: parity.py)."""

    setup: float
    per_case: float
    parallel: int = 1

    def seconds(self, cases: int) -> float:
        return self.setup + math.ceil(cases / self.parallel) * self.per_case if cases else 0.0


PARITY_POOL_START_S = 10.0
"""Seconds for kernel parity's processes to start (spawned, each imports torch and the kernels and makes a CUDA
context). On the H200 (4 processes, 16 cores) the covering subset took 35.6 s and its longest case 31.8 s: about
4 s of start; the allowance keeps a margin for more processes on fewer cores. The part's own measured seconds
replace it once it ran."""


def positive_count(text: str) -> int:
    """`--parity-workers`' value: a whole number of processes, at least 1."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes of at least 1 (e.g. --parity-workers 8)")
    return count


def parity_workers(requested: int | None, dry_run: bool) -> int:
    """Kernel parity's processes: as requested, else on a GPU one per core up to 8 (a GPU node's cores compile; more
    processes would each hold a CUDA context for little gain over 36 cases), in a dry run 1."""
    if requested is not None:
        return requested
    return 1 if dry_run else max(1, min(8, os.cpu_count() or 1))


def with_parity_workers(costs: Mapping[str, Cost], workers: int) -> dict[str, Cost]:
    """`costs` with kernel parity's cases run `workers` at a time (the table's per-case seconds are one process's)."""
    costs = dict(costs)
    if workers > 1 and "kernel_parity" in costs:
        one = costs["kernel_parity"]
        costs["kernel_parity"] = Cost(one.setup + PARITY_POOL_START_S, one.per_case, workers)
    return costs


H100_COSTS = {
    # 6 cases (of 36) in 220.8 s: 31.1, 12.2, 35.0, 27.3, 76.9, 38.3 s (console.txt), mostly compilation.
    "kernel_parity": Cost(0.0, 36.8),
    # 68.3 s for 10 cases: the first two 21.2 and 24.3 s (compiles and autotuning), the other eight 2.4-3.6 s
    # (mean 2.8): setup 68.3 - 10 x 2.8 = 40.3 s.
    "flash_vs_sdpa": Cost(40.3, 2.8),
    # Stopped in its 12th case: the call's limit of 170 s minus flash_vs_sdpa's 68.3 s leaves at most 101.7 s
    # for 11 cases, 9.25 s a case (an upper bound: the call's start-up is in it, and larger n cost more).
    "long_attention": Cost(0.0, 9.25),
    "train_step": Cost(0.0, 26.7),  # one case, 26.7 s (the second call)
    "sweep": Cost(0.0, 111.6),  # one case (2 trials), 111.6 s (the second call)
}
"""Seconds on one H100 80GB HBM3 (results/nvidia-h100-80gb-hbm3/README.md and console.txt)."""

H200_COSTS = {
    # Seconds a round of cases side by side (one case per process): a round lasts about its longest case. The
    # first window: the 4 covering cases in 4 processes in 35.6 s (9.8-31.8 s each, console.txt). The second
    # (window2_console.txt): the covering 4 in 39.2 s; the other 44 in 14 processes (4 rounds) were unfinished at
    # 161 s, fp32 flash cases taking 44-112 s each and the rest 2-12 s: at least 40 s a round.
    "kernel_parity": Cost(0.0, 40.0),
    # 107.4 s for 10 cases with the cuDNN and FlexAttention baselines: the first two 23.7 and 33.4 s (compiles and
    # autotuning), the other eight 4.0-8.7 s (mean 6.3): setup 107.4 - 10 x 6.3 = 44.4 s. But from the third case
    # on FlexAttention ran uncompiled (dynamo's recompile limit, since raised: baselines.FLEX_RECOMPILE_LIMIT), so
    # each case now also compiles its graphs: about 8 s more a case, an estimate from the first cases' excess.
    "flash_vs_sdpa": Cost(44.4, 14.3),
    # 90.8 s for the 11 cases n = 4k ... 128k non-causal, and 136.6 s for 64k and 128k both ways plus 256k stopped
    # in its second row (a second call): about 200 s for all 13, 15.4 s a case (larger n cost more: the planner
    # keeps the shortest, so its estimate of a shrunk part errs long). Since then each case also times the three
    # `+graphs` layers (speed.GRAPHED_KINDS, each a capture after 3 warm-up calls) and lsh-r4f: 14 rows a case
    # instead of 10, not yet run on a GPU: 15.4 x 14 / 10, an estimate.
    "long_attention": Cost(0.0, 21.6),
    "train_step": Cost(0.0, 16.8),  # 3 variants in 50.3 s
    "sweep": Cost(0.0, 122.4),  # one case (2 trials)
    # The second window: 12 cases in 49.8 s (4.2 s a case). The 6 `+inductor` and 6 `+graphs` cases since then
    # are not yet run on a GPU; guessed at 30 s each (inductor compiles a layer's forward and backward) and at the
    # plain cases' 4.2 s plus 1 s of capture: (12 x 4.2 + 6 x 30 + 6 x 5.2) / 24.
    "attention_profile": Cost(0.0, 10.9),
}
"""Seconds on one NVIDIA H200 (results/nvidia-h200/README.md and console.txt)."""
GPU_COSTS = H200_COSTS
"""The table a GPU run starts from: the latest run's, whose parts are the suite's current ones."""

DRY_COSTS = {
    # The fast tier's dry run (tests/test_gpu_suite.py's fixture) on the shared 2-core CPU (cpu-2core), 2026-11-27,
    # beside other work: parity 23.1 s for its 3 cases, train_step 13.1 s, flash_vs_sdpa 7.0 s for 2 (with
    # FlexAttention's uncompiled forward), long_attention 6.8 s for 2.
    "kernel_parity": Cost(0.0, 7.7),
    "flash_vs_sdpa": Cost(0.0, 3.5),
    "long_attention": Cost(0.0, 3.4),
    "train_step": Cost(0.0, 13.1),
    "attention_profile": Cost(0.0, 1.0),  # an estimate: three toy layers a case
    # Not measured on the CPU (the slow tier's): the H100's 111.6 s, until this run's own measurements scale it.
    "sweep": H100_COSTS["sweep"],
}
"""Seconds of a dry run's toy cases on a 2-core CPU."""


@dataclass(frozen=True)
class Step:
    """Cases [start, stop) of one part (in the part's own order)."""

    part: str
    start: int
    stop: int
    label: str = ""
    """What the slice is, for the summary ("the covering subset")."""

    @property
    def cases(self) -> int:
        return self.stop - self.start


VALUE_ORDER = ("kernel_parity", "train_step", "sweep", "flash_vs_sdpa", "long_attention", "attention_profile")


def steps(case_counts: Mapping[str, int], parity_cover: int) -> list[Step]:
    """The suite's steps in order of value, for the parts in `case_counts` (part -> its number of cases):
    kernel parity's first `parity_cover` cases first and the rest of them last."""
    out = []
    for part in VALUE_ORDER:
        if part not in case_counts:
            continue
        if part == "kernel_parity" and parity_cover < case_counts[part]:
            out.append(Step(part, 0, parity_cover, "the covering subset"))
        else:
            out.append(Step(part, 0, case_counts[part]))
    if "kernel_parity" in case_counts and parity_cover < case_counts["kernel_parity"]:
        out.append(Step("kernel_parity", parity_cover, case_counts["kernel_parity"], "the rest"))
    return out


@dataclass
class Estimates:
    """Seconds a step will take: the table's, scaled, until the part's own measurements replace them."""

    table: Mapping[str, Cost]
    measured: dict[str, tuple[int, float]] = field(default_factory=dict)
    """part -> (cases run, seconds) in this run so far."""
    predicted: float = 0.0
    """The table's seconds for what has run so far, against `actual`."""
    actual: float = 0.0

    @property
    def scale(self) -> float:
        """Measured over estimated seconds of the steps run so far (1 before any)."""
        return self.actual / self.predicted if self.predicted > 0 and self.actual > 0 else 1.0

    def seconds(self, part: str, cases: int) -> float:
        if cases <= 0:
            return 0.0
        done, seconds = self.measured.get(part, (0, 0.0))
        if done:
            # By rounds of cases run side by side (parity's processes; one case a round elsewhere): 3 cases in 8
            # processes took one round, and 33 more take 5, not 11.
            parallel = self.table[part].parallel
            return math.ceil(cases / parallel) * seconds / math.ceil(done / parallel)
        return self.scale * self.table[part].seconds(cases)

    def update(self, part: str, cases: int, seconds: float) -> None:
        """A step of `part` finished `cases` cases in `seconds`."""
        if cases <= 0:
            return
        if part not in self.measured:
            self.predicted += self.table[part].seconds(cases)
            self.actual += seconds
        done, total = self.measured.get(part, (0, 0.0))
        self.measured[part] = (done + cases, total + seconds)


@dataclass(frozen=True)
class Decision:
    """What the planner does with a step: run `cases` of its cases (all, or fewer: shrunk), or none (skipped)."""

    step: Step
    cases: int
    estimate: float
    """Seconds the estimate gives for the cases it runs (for the whole step when skipped)."""
    reason: str = ""

    @property
    def action(self) -> str:
        return "skip" if self.cases == 0 else "shrink" if self.cases < self.step.cases else "run"


def decide(step: Step, seconds: Callable[[str, int], float], left: float | None) -> Decision:
    """Run, shrink or skip `step` with `left` seconds of the budget (None: no budget)."""
    whole = seconds(step.part, step.cases)
    if left is None or whole <= left:
        return Decision(step, step.cases, whole)
    fits = [k for k in range(step.cases - 1, 0, -1) if seconds(step.part, k) <= left]
    if fits:
        return Decision(step, fits[0], seconds(step.part, fits[0]),
                        f"~{whole:.0f} s for all {step.cases}, {left:.0f} s left")
    return Decision(step, 0, whole, f"needs ~{seconds(step.part, 1):.0f} s for one case"
                                    f"{'' if step.cases == 1 else f' (~{whole:.0f} s for all {step.cases})'}, "
                                    f"{max(left, 0):.0f} s left")


def plan(todo: Sequence[Step], seconds: Callable[[str, int], float], left: float | None) -> list[Decision]:
    """`decide` over every step, each taking its estimate off the time left."""
    decisions = []
    for step in todo:
        decision = decide(step, seconds, left)
        decisions.append(decision)
        if left is not None and decision.cases:
            left -= decision.estimate
    return decisions
