"""The one benchmark harness: cases, timing, peak memory, machine labels, CSV and log-log plots.

Modelled on xFormers' `benchmarks/utils.py`: a benchmark builds its cases as the product of a few axes,
runs each through `measure` (warmup, repeats, median, peak memory, a per-case time budget), and writes
rows to `<out>/<machine label>/<name>.csv` plus a PNG, so results from different machines sit side by
side and a CPU run never overwrites a GPU one.

Peak memory: on CUDA, `torch.cuda.max_memory_allocated`. On CPU, `tracemalloc` does not see torch's
allocator and process RSS is blurred by glibc keeping freed pages, so we read the allocator's own running
total from the profiler's allocation events (`profile_memory=True`): the peak of `total_allocated`
during the call, minus what was allocated before it. That is exact bytes held by tensors, CPU or CUDA.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Row = dict[str, Any]


def machine_label(device: torch.device) -> str:
    """Folder name for results: the GPU name ("nvidia-h100-80gb-hbm3") or "cpu-<cores>core"."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu-{cores}core"


def cases(**axes: Iterable[Any]) -> list[dict[str, Any]]:
    """Every combination of the axes, in order (the last axis varies fastest)."""
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*(list(v) for v in axes.values()))]


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock time covers the work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call takes, synchronised on both sides."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _cpu_allocation_peak(fn: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            allocations.append((event.start_time_ns, fields.total_allocated, fields.alloc_size))
        stack.extend(event.children)
    if not allocations:
        return 0
    allocations.sort()
    _, first_total, first_size = allocations[0]
    before = first_total - first_size  # the allocator's total just before the call's first allocation
    return max(0, max(total for _, total, _ in allocations) - before)


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Bytes the call allocated on top of what was already held, at its peak (one call of `fn`)."""
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    return _cpu_allocation_peak(fn)


@dataclass(frozen=True)
class Measurement:
    """What `measure` found for one case; `status` is "ok", "over_budget" or "error: <what>"."""

    status: str
    median_s: float = math.nan
    min_s: float = math.nan
    """Fastest timed call: on a machine shared with other jobs, the least disturbed one."""
    repeats: int = 0
    peak_bytes: float = math.nan
    first_call_s: float = math.nan

    def as_row(self, prefix: str) -> Row:
        return {
            f"{prefix}_status": self.status,
            f"{prefix}_median_s": self.median_s,
            f"{prefix}_min_s": self.min_s,
            f"{prefix}_repeats": self.repeats,
            f"{prefix}_peak_mb": self.peak_bytes / 2**20,
        }


def describe_error(err: BaseException) -> str:
    """A one-line, comma-free status for a CSV cell."""
    text = " ".join(str(err).split())[:160]
    return f"error: {type(err).__name__}: {text}".replace(",", ";")


def measure(
    fn: Callable[[], Any], device: torch.device, *, warmup: int = 1, repeats: int = 5,
    call_budget_s: float = 60.0, timing_budget_s: float | None = None,
) -> Measurement:
    """Peak memory, then the median time of up to `repeats` calls after `warmup` calls.

    The first call runs under the memory measurement and counts as the first warmup call. If it takes
    longer than `call_budget_s` the case ends as "over_budget"; otherwise repeats are cut so the timed
    calls take about `timing_budget_s` (default: `call_budget_s`) in all, which keeps the largest sizes
    affordable on a CPU, but at least one warm call is timed: the first call is cold and profiled, and its time
    divided by other cases' warm medians made ratios wrong by 2-3x (a CPU run's 134x that was 50x). Only
    `repeats=0` reports the first call (repeats = 0), which `add_ratios` then leaves out of warm ratios.
    Exceptions (out of memory, an unsupported size) are returned as an "error: ..." status, not raised.
    """
    try:
        start = time.perf_counter()
        peak = peak_memory_bytes(fn, device)
        first = time.perf_counter() - start
        if first > call_budget_s:
            return Measurement("over_budget", peak_bytes=peak, first_call_s=first)
        for _ in range(warmup - 1):
            fn()
        timing_budget_s = call_budget_s if timing_budget_s is None else timing_budget_s
        n_timed = min(repeats, max(1, int(timing_budget_s // max(first, 1e-9))))
        times = [timed_call(fn, device) for _ in range(n_timed)]
    except (RuntimeError, ValueError, MemoryError, NotImplementedError) as err:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return Measurement(describe_error(err))
    times = times or [first]  # repeats=0 asked for no timed call
    return Measurement("ok", statistics.median(times), min(times), n_timed, peak, first)


def alternating(fns: Mapping[str, Callable[[int], Any]], rounds: int) -> dict[str, list[Any]]:
    """Each function's results over `rounds` rounds (each is called with the round's index), called in turn
    within every round, the order swapped every round so that neither side always runs right after the other.

    Alternating A, B, B, A, A, B... means a burst of load from other processes on a shared machine hits every
    side alike, so their comparison is fairer than back-to-back loops.
    """
    results: dict[str, list[Any]] = {name: [] for name in fns}
    for round_index in range(rounds):
        order = list(fns.items()) if round_index % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            results[name].append(fn(round_index))
    return results


def interleaved_medians(
    fns: Mapping[str, Callable[[], Any]], device: torch.device, *, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Times of each function over `repeats` rounds, calling them in turn within every round (`alternating`)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    return alternating({name: lambda _, fn=fn: timed_call(fn, device) for name, fn in fns.items()}, repeats)


def add_ratios(rows: list[Row], *, key: str, baseline: Callable[[Row], bool], columns: Mapping[str, str]) -> None:
    """For each row, `baseline value / row value` of every column, against the baseline row with the same `key`.

    `columns` maps a measured column to the ratio column to add ("fwd_median_s" -> "fwd_speedup_vs_mha"). A
    ratio > 1 means the row is that many times faster (or smaller) than the baseline, as in the Linformer
    paper's "time saved" and "memory saved" tables. Missing or failed values give NaN, and so does a time
    (`<prefix>_median_s`) that `measure` took from no timed call (`<prefix>_repeats` = 0: the first, cold call
    under the memory measurement) on one side only: a cold call divided by warm medians, or warm by cold. Two
    cold calls compare like with like (one call each).
    """
    bases = {row[key]: row for row in rows if baseline(row)}

    def untimed(row: Row | None, column: str) -> bool:
        repeats = None if row is None or not column.endswith("_median_s") else \
            row.get(column.removesuffix("_median_s") + "_repeats")
        return isinstance(repeats, int) and repeats < 1

    for row in rows:
        base = bases.get(row[key])
        for column, ratio_column in columns.items():
            value = row.get(column, math.nan)
            base_value = math.nan if base is None else base.get(column, math.nan)
            ok = isinstance(value, float | int) and isinstance(base_value, float | int) and value > 0
            ok = ok and untimed(row, column) == untimed(base, column)
            row[ratio_column] = base_value / value if ok and math.isfinite(base_value / value) else math.nan


def write_csv(rows: Sequence[Row], path: Path) -> Path:
    """Rows to CSV, columns in first-seen order; floats rounded to 6 significant digits to keep diffs small."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: (f"{v:.6g}" if isinstance(v, float) else v) for c, v in row.items()})
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as handle:
        return list(csv.DictReader(handle))


def plot_loglog(
    rows: Sequence[Row], path: Path, *, x: str, panels: Mapping[str, str], series: str, title: str,
    group: str | None = None, columns: int = 2,
) -> Path:
    """One log-log panel per (column -> axis label), one line per value of `series`; failed points are gaps.

    Lines of the same `group` (e.g. the attention kind) share a colour and differ in dash and marker, so
    twenty variants stay tellable apart where a plain colour cycle would repeat itself.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(row[series] for row in rows))
    groups = list(dict.fromkeys(row[group] for row in rows)) if group else names
    palette = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    dashes, markers = ["-", "--", ":", "-."], ["o", "s", "^", "v", "D", "x", "+", "*"]
    styles: dict[str, dict[str, Any]] = {}
    seen_in_group: dict[str, int] = {}
    for name in names:
        owner = next(row[group] for row in rows if row[series] == name) if group else name
        index = seen_in_group[owner] = seen_in_group.get(owner, -1) + 1
        styles[name] = {"color": palette(groups.index(owner) % palette.N), "linestyle": dashes[index % len(dashes)],
                        "marker": markers[index % len(markers)]}
    n_rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(5.0 * columns + 2.6, 3.6 * n_rows), squeeze=False)
    for ax, (column, label) in zip(axes.flat, panels.items()):
        for name in names:
            points = [(row[x], row[column]) for row in rows if row[series] == name]
            points = [(a, b) for a, b in points if isinstance(b, float | int) and math.isfinite(b) and b > 0]
            if points:
                ax.plot(*zip(*points), markersize=3, linewidth=1.1, label=name, **styles[name])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The legend sits right of the panels: keep that strip out of the layout.
    return save_figure(fig, path, dpi=80, rect=(0, 0, 1 - 2.4 / (5.0 * columns + 2.6), 1))


def save_figure(fig: Any, path: Path, dpi: int = 120, rect: tuple[float, float, float, float] | None = None) -> Path:
    """Lay the figure out (within `rect` of it, when given), write it to `path` and free it (pyplot keeps every
    open figure otherwise)."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def results_dir(out: str | Path, device: torch.device) -> Path:
    """`<out>/<machine label>/`, created."""
    folder = Path(out) / machine_label(device)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def code_version(repo: Path) -> str:
    """The commit of the checkout, `+dirty` when tracked files other than results differ from it."""
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=repo, capture_output=True, text=True,
                            check=True).stdout.strip()
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results",
         ":(exclude)benchmarks/RESULTS.md"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    return commit + ("+dirty" if changed else "")
