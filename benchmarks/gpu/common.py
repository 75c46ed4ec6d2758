"""What the parts of benchmarks.gpu.suite share: the run's context, a part's result, its CSV written as it goes,
timing and out-of-memory.

Nothing lost to a time limit: a part hands each finished case's rows to `ctx.record`, which appends them to the
part's CSV at once (`PartLog`; the file is closed after each append, so a process killed the next moment keeps
them), and names the case it starts with `ctx.case_started`, so that a stop (a signal, the suite's own budget)
can say which case it interrupted. The suite rewrites the CSV at the end of the part with the part's final rows
(ratio columns that need every case are added then).

Timing: on CUDA `triton.testing.do_bench` (CUDA events, its own warm-up, the L2 cache flushed between calls,
the median here); on the CPU of a dry run one `harness.timed_call` (do_bench needs a GPU, and under the Triton
interpreter one call of a toy case takes about a second). The callers make an untimed first call themselves.
Dry-run times are there to exercise the code, never to be read as results.
"""

from __future__ import annotations

import csv
import gc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from benchmarks.harness import Row, describe_error, timed_call, write_csv

T = TypeVar("T")

DRY_RUN = "dry-run"
"""A part's status when it ran to the end at the dry run's toy sizes (on a GPU run: "ok")."""


@dataclass(frozen=True)
class SuiteContext:
    """One run of the suite: where it runs, at which sizes, and where its files go."""

    device: torch.device
    dry_run: bool
    folder: Path
    """`<out>/<machine label>/`: every part writes its CSV here."""
    log: PartLog | None = None
    """The running part's CSV; None when a part is called on its own (its rows are then only returned)."""
    cases: tuple[int, int] | None = None
    """The slice [start, stop) of the part's cases (in the part's own order) that this run takes: the `--budget`
    planner shrinks a part by it; None: all."""
    long_lengths: tuple[int, ...] | None = None
    """long_attention's lengths (`--long-lengths`); None: the part's own."""
    parity_workers: int = 1
    """Processes that run kernel parity's cases side by side (`--parity-workers`): its time is Triton's compilation,
    which is CPU-bound, so a GPU node's cores compile the cases' kernel variants in parallel (parity.py)."""

    @property
    def passed(self) -> str:
        """The status of a part that ran to the end without a failure."""
        return DRY_RUN if self.dry_run else "ok"

    def select(self, all_cases: Sequence[T]) -> list[T]:
        """The cases of this run: all of them, or the planner's slice."""
        start, stop = self.cases if self.cases is not None else (0, len(all_cases))
        return list(all_cases[start:stop])

    def case_started(self, label: str) -> None:
        if self.log is not None:
            self.log.current = label

    def record(self, rows: Sequence[Row]) -> None:
        """Rows of the running case, appended to the CSV now."""
        if self.log is not None:
            self.log.add(rows)

    def case_finished(self) -> None:
        if self.log is not None:
            self.log.cases_done += 1
            self.log.current = ""


class PartLog:
    """A part's CSV, appended to row by row (see the module docstring). It keeps the rows, so that a row with a new
    column rewrites the file with the wider header (atomically: a temporary file renamed over it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[Row] = []
        self.columns: list[str] = []
        self.current = ""
        """The case running now ("" between cases)."""
        self.cases_done = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a previous run's file in the same folder

    def add(self, rows: Sequence[Row]) -> None:
        new = [column for row in rows for column in row if column not in self.columns]
        self.rows.extend(rows)
        if new or not self.path.exists():
            self.rewrite()
            return
        with self.path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.columns)
            writer.writerows({c: (f"{v:.6g}" if isinstance(v, float) else v) for c, v in row.items()} for row in rows)

    def replace(self, start: int, rows: Sequence[Row]) -> None:
        """The rows from index `start` on (one run of the part) replaced by the part's final rows."""
        self.rows[start:] = rows
        self.rewrite()

    def rewrite(self) -> None:
        self.columns = list(dict.fromkeys(column for row in self.rows for column in row))
        if not self.rows:
            self.path.unlink(missing_ok=True)
            return
        tmp = write_csv(self.rows, self.path.with_name(self.path.name + ".partial"))
        os.replace(tmp, self.path)


@dataclass
class PartResult:
    """What one part found: its CSV rows, a status for the summary and a note on what ran."""

    rows: list[Row]
    status: str
    """"ok" / "dry-run", or "fail: ..." (a measured check missed its bound), or "error: ..." (a case raised)."""
    note: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    """What the part ran with (sizes, dtype, backend), for the summary."""


def time_ms(fn: Callable[[], Any], ctx: SuiteContext) -> float:
    """Milliseconds of one call of `fn`, the median of do_bench's on CUDA (`fn` must not synchronise itself)."""
    if ctx.device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    return 1e3 * timed_call(fn, ctx.device)


def is_oom(err: BaseException) -> bool:
    """A CUDA (or host) out-of-memory error: a size too large for this device, recorded, not a failure."""
    return isinstance(err, torch.OutOfMemoryError | MemoryError) or "out of memory" in str(err).lower()


def row_status(err: BaseException) -> str:
    """A failed case's status: "oom" (skipped sizes are expected on smaller cards) or "error: ..."."""
    return "oom" if is_oom(err) else describe_error(err)


def release_memory(device: torch.device) -> None:
    """Give cached blocks back after a case, so the next (larger) one starts from an empty allocator. A collection
    first: a CUDA-graphed layer (speed.GRAPHED) and its memory pool are held in a reference cycle
    (`make_graphed_callables` gives the module a forward that refers to the module), which only the collector ends."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def status_of_rows(rows: list[Row], ctx: SuiteContext, column: str = "status") -> str:
    """The part's status from its rows: the first error when a case raised (out of memory is not an error),
    else the passing status."""
    errors = [row[column] for row in rows if str(row.get(column, "")).startswith("error")]
    if errors:
        return f"error: {len(errors)} of {len(rows)} cases raised; first: {errors[0].removeprefix('error: ')}"
    return ctx.passed
