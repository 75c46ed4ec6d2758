"""MLflow's system metrics of a run carry its own GPU only (orchestrator/tracking/system_metrics.py): MLflow's GPU
monitor reads every GPU of the node through NVML, so rank 0 of a run given one GPU of eight logged all eight. NVML is
simulated here (no GPU on the test machine): eight GPUs, each with its UUID and its own memory and utilisation."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from mlflow.system_metrics.metrics import gpu_monitor

from orchestrator.tracking.system_metrics import own_gpu_only
from orchestrator.tracking.write import TrackingWarning

GPUS = 8
UUIDS = [f"a1b2c3d4-0000-0000-0000-00000000000{i}" for i in range(GPUS)]


def fake_nvml() -> types.ModuleType:
    """NVML's calls that MLflow's GPU monitor and the filter make, over GPUS devices: handle i has i GB used, i x 10%
    utilisation."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: GPUS
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i

    def by_uuid(uuid: str) -> int:
        if uuid.removeprefix("GPU-") not in UUIDS:
            raise nvml.NVMLError(f"no device {uuid}")
        return UUIDS.index(uuid.removeprefix("GPU-"))

    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=h * 1e9, total=80e9)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=10 * h)
    nvml.nvmlDeviceGetPowerUsage = lambda h: 100_000
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    return nvml


@pytest.fixture
def monitor(monkeypatch):
    """A monitor as SystemMetricsMonitor builds it on a node of GPUS GPUs: MLflow's own GPU monitor over NVML."""
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(gpu_monitor, "pynvml", nvml, raising=False)
    return SimpleNamespace(monitors=[object(), gpu_monitor.GPUMonitor()])


def on_cuda(monkeypatch, uuid: str) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=uuid))
    return torch.device("cuda", 0)  # the process's first visible GPU, whichever of the node's it is


def test_a_run_logs_the_gpu_it_was_given_as_gpu_0(monitor, monkeypatch):
    own_gpu_only(monitor, on_cuda(monkeypatch, UUIDS[3]))
    (gpu,) = [m for m in monitor.monitors if isinstance(m, gpu_monitor.GPUMonitor)]
    gpu.collect_metrics()
    metrics = gpu.aggregate_metrics()
    assert {name.split("_")[1] for name in metrics} == {"0"}, sorted(metrics)  # one GPU, named gpu_0
    assert metrics["gpu_0_utilization_percentage"] == 30 and metrics["gpu_0_memory_usage_megabytes"] == 3000


def test_without_the_filter_every_gpu_of_the_node_is_logged(monitor):
    """The behaviour the filter exists for: MLflow's monitor alone logs all GPUS."""
    gpu = monitor.monitors[1]
    gpu.collect_metrics()
    assert {name.split("_")[1] for name in gpu.aggregate_metrics()} == {str(i) for i in range(GPUS)}


def test_a_cpu_run_or_an_unknown_gpu_logs_no_gpu(monitor, monkeypatch):
    cpu_monitor = monitor.monitors[0]
    own_gpu_only(monitor, torch.device("cpu"))
    assert monitor.monitors == [cpu_monitor]
    monitor.monitors.append(gpu_monitor.GPUMonitor())
    with pytest.warns(TrackingWarning, match="not found in NVML"):
        own_gpu_only(monitor, on_cuda(monkeypatch, "ffffffff-0000-0000-0000-000000000000"))
    assert monitor.monitors == [cpu_monitor]
