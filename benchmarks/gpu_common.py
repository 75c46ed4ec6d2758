"""What the parts of benchmarks.gpu_suite share: the run's context, a part's result, timing and out-of-memory.

Timing: on CUDA `triton.testing.do_bench` (CUDA events, its own warm-up, the L2 cache flushed between calls,
the median here); on the CPU of a dry run one `harness.timed_call` (do_bench needs a GPU, and under the Triton
interpreter one call of a toy case takes about a second). The callers make an untimed first call themselves.
Dry-run times are there to exercise the code, never to be read as results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Row, describe_error, timed_call

DRY_RUN = "dry-run"
"""A part's status when it ran to the end at the dry run's toy sizes (on a GPU run: "ok")."""


@dataclass(frozen=True)
class SuiteContext:
    """One run of the suite: where it runs, at which sizes, and where its files go."""

    device: torch.device
    dry_run: bool
    folder: Path
    """`<out>/<machine label>/`: every part writes its CSV here."""

    @property
    def passed(self) -> str:
        """The status of a part that ran to the end without a failure."""
        return DRY_RUN if self.dry_run else "ok"


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
    """Give cached blocks back after a case, so the next (larger) one starts from an empty allocator."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def status_of_rows(rows: list[Row], ctx: SuiteContext, column: str = "status") -> str:
    """The part's status from its rows: the first error when a case raised (out of memory is not an error),
    else the passing status."""
    errors = [row[column] for row in rows if str(row.get(column, "")).startswith("error")]
    if errors:
        return f"error: {len(errors)} of {len(rows)} cases raised; first: {errors[0].removeprefix('error: ')}"
    return ctx.passed
