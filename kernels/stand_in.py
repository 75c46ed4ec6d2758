"""Launching the Triton kernels, or standing in for them on fake tensors (the CPU proxies of a GPU run).

Every Triton launch of this package goes through `launch(name, run)`. Normally it runs the launch. Inside
`kernels.dispatch.stand_in_kernels()` (which selects the stand-in backend and installs a `KernelLog`) it only
counts it: the rest of the wrapper (the checks, the mask conversions before the autograd.Function, and inside it
the `torch.empty` outputs the kernels would fill: out, lse, delta, dq, dk, dv) runs as it does on a GPU, so a
model run on fake tensors (`FakeTensorMode`: shapes, no storage) allocates exactly what a GPU run allocates and
its kernel launches are counted by name. What the kernels compute is not reproduced: the values are fake.

`kernel_region` marks the body of a kernel's autograd.Function (forward and backward), so that a counter of aten
ops (benchmarks/methods/attention_glue.py) can tell the kernels' own output buffers from the glue around them. The
backward re-enters the log its forward saw (`ctx.kernel_log`): autograd may run it in another context.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kernels.block_setting import BlockSetting


@dataclass
class KernelLog:
    """Kernel launches counted while standing in, and whether the current op runs inside a kernel's Function."""

    launches: Counter[str] = field(default_factory=Counter)
    run_kernels: bool = False
    """True: launch the kernels and count them (a real run, e.g. a test's reference for the stand-in's counts)."""
    counting: bool = True
    """False: stand in without counting or marking kernel regions, so that nothing but the kernels' absence sets
    the path apart from a GPU's, where no log is installed: torch.compile can then trace the kernels' path on a CPU
    (a count is a side effect dynamo refuses inside an autograd.Function; tests/test_compile_families.py)."""
    depth: int = 0
    """> 0 while inside the body of a kernel's autograd.Function (`kernel_region`)."""

    @property
    def inside_kernel(self) -> bool:
        return self.depth > 0


_LOG: BlockSetting[KernelLog | None] = BlockSetting(None)
"""The enclosing `installed` block's log, read by `kernels.dispatch.select_backend` on every attention call
(a BlockSetting: torch.compile traces its read). Counting runs one model on one thread; a kernel's backward gets
its log passed explicitly (`kernel_region`)."""


def active() -> KernelLog | None:
    """The log of the enclosing `installed` block, or None."""
    return _LOG.value


def standing_in() -> bool:
    """Launches are counted and not run (kernels.dispatch.stand_in_kernels)."""
    log = _LOG.value
    return log is not None and not log.run_kernels


@contextmanager
def installed(log: KernelLog) -> Iterator[KernelLog]:
    """Count every launch inside the block in `log`; stand in for it unless `log.run_kernels`."""
    with _LOG.set_to(log):
        yield log


@contextmanager
def kernel_region(log: KernelLog | None) -> Iterator[None]:
    """The body of a kernel's autograd.Function; `log` is the forward's `active()` (None: nothing to mark)."""
    if log is None or not log.counting:
        yield
        return
    with _LOG.set_to(log):
        log.depth += 1
        try:
            yield
        finally:
            log.depth -= 1


@contextmanager
def glue_inside_kernel() -> Iterator[None]:
    """Inside a kernel's Function, a step that is glue, not the kernel's (the chunked backward's sum of the rounds
    into a buffer it allocates): a counter then charges the buffer's bytes to the glue, as it charged the bytes of
    a sum that allocated its own output."""
    log = _LOG.value
    if log is None or not log.counting:
        yield
        return
    depth, log.depth = log.depth, 0
    try:
        yield
    finally:
        log.depth = depth


def launch(name: str, run: Callable[[], object]) -> None:
    """Run one kernel launch unless standing in; count it under `name` inside `installed`."""
    log = _LOG.value
    if log is None or log.run_kernels:
        run()
    if log is not None and log.counting:
        log.launches[name] += 1
