"""tasks/device_memory.py: the process's peak memory on a device, and a scope's own peak that never lowers it.

No GPU here: CUDA's per-device peak counter is a fake (`FakeAllocator`) put in place of torch.cuda's functions,
and `torch.device("cuda", 0)` is only ever passed to them, never given a tensor.
"""

from __future__ import annotations

import resource

import pytest
import torch

from tasks import device_memory
from tasks.device_memory import measured_peak, peak_memory_gb

CUDA = torch.device("cuda", 0)


class FakeAllocator:
    """CUDA's peak counter of one device: `allocate` raises the peak; a reset brings it down to what is held."""

    def __init__(self):
        self.held, self.peak, self.resets = 0, 0, 0

    def allocate(self, n_bytes: int) -> None:
        self.peak = max(self.peak, self.held + n_bytes)

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak, self.resets = self.held, self.resets + 1


def fake_allocator(monkeypatch) -> FakeAllocator:
    """A fake in place of torch.cuda's peak counter, and a fresh process-wide carried maximum (restored after)."""
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device_memory, "_carried", {})
    return fake


@pytest.fixture
def allocator(monkeypatch):
    return fake_allocator(monkeypatch)


def test_a_measured_scope_reports_its_own_peak_and_never_lowers_the_processs(allocator):
    allocator.held = int(1e9)
    allocator.allocate(int(7e9))  # training: 8 GB at its peak
    assert peak_memory_gb(CUDA) == pytest.approx(8.0)
    with measured_peak(CUDA) as scope:
        allocator.allocate(int(2e9))  # an evaluation's pass: 3 GB at its peak
    assert allocator.resets == 1
    assert scope.gb == pytest.approx(3.0)  # GB of 1e9 bytes, as memory/peak_gb, and only the scope's
    assert peak_memory_gb(CUDA) == pytest.approx(8.0)  # the training peak survives the scope's reset
    assert peak_memory_gb(torch.device("cuda")) == pytest.approx(8.0)  # the current device is the same counter
    with measured_peak(CUDA) as second:
        allocator.allocate(int(9e9))
    assert second.gb == pytest.approx(10.0) and peak_memory_gb(CUDA) == pytest.approx(10.0)


def test_an_inner_scope_does_not_hide_the_outer_scopes_earlier_peak(allocator):
    with measured_peak(CUDA) as outer:
        allocator.allocate(int(5e9))
        with measured_peak(CUDA) as inner:
            allocator.allocate(int(1e9))
        allocator.allocate(int(2e9))
    assert inner.gb == pytest.approx(1.0)
    assert outer.gb == pytest.approx(5.0)
    assert peak_memory_gb(CUDA) == pytest.approx(5.0)


def test_on_the_cpu_the_peak_is_the_resident_set_and_a_scope_measures_nothing(monkeypatch):
    def no_cuda(*_):
        raise AssertionError("a CPU scope touched CUDA's counters")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", no_cuda)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", no_cuda)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux -> GB
    with measured_peak(torch.device("cpu")) as scope:
        peak = peak_memory_gb(torch.device("cpu"))
    assert scope.gb is None
    assert before <= peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def test_the_trainers_memory_metric_is_this_modules_peak():
    """One home: a copy in the trainer would not see what the task's scopes carried."""
    from orchestrator.training import trainer

    assert trainer.peak_memory_gb is peak_memory_gb
