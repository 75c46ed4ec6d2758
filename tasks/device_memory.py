"""Peak memory on a device, in GB of 1e9 bytes: the one home of the trainer's `memory/peak_gb` and of a scored
pass's own peak (tasks/pretrained_lm.py's `val/peak_gb`).

CUDA keeps one peak counter per device, and measuring a scope means resetting it; `memory/peak_gb` is the
process's peak since it started, so a scope first folds the running peak into a maximum carried here, which
`peak_memory_gb` includes: a measured scope never lowers the process's peak. On the CPU the peak is the
process's peak resident set, and a scope measures nothing (the CPU allocator keeps no peak to reset).
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from dataclasses import dataclass

import torch

GB = 1e9

_carried: dict[int, int] = {}
"""CUDA device index -> the highest peak in bytes that a scope's reset took off the device's counter."""


@dataclass
class ScopePeak:
    """What `measured_peak` yields: the scope's peak in bytes so far, set into `gb` when the scope ends (None on
    the CPU)."""

    device_index: int | None = None
    bytes_seen: int = 0
    gb: float | None = None


_open: list[ScopePeak] = []
"""The scopes not yet ended: an inner scope's reset must not hide an outer scope's earlier peak."""


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _fold(index: int) -> None:
    """Keep the counter's running peak before it is reset."""
    running = torch.cuda.max_memory_allocated(index)
    _carried[index] = max(_carried.get(index, 0), running)
    for scope in _open:
        if scope.device_index == index:
            scope.bytes_seen = max(scope.bytes_seen, running)


def peak_memory_gb(device: torch.device) -> float:
    """The process's peak on `device` since it started: allocated CUDA memory, or on the CPU the peak resident set."""
    if device.type == "cuda":
        index = _index(device)
        return max(_carried.get(index, 0), torch.cuda.max_memory_allocated(index)) / GB
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


@contextlib.contextmanager
def measured_peak(device: torch.device) -> Iterator[ScopePeak]:
    """The peak allocated memory on a CUDA device inside the block (`.gb` once it ends; None on the CPU)."""
    if device.type != "cuda":
        yield ScopePeak()
        return
    scope = ScopePeak(_index(device))
    _fold(scope.device_index)
    torch.cuda.reset_peak_memory_stats(scope.device_index)
    _open.append(scope)
    try:
        yield scope
    finally:
        _open.remove(scope)
        scope.bytes_seen = max(scope.bytes_seen, torch.cuda.max_memory_allocated(scope.device_index))
        scope.gb = scope.bytes_seen / GB
