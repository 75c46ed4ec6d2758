"""MLflow's system-metrics monitor for a run, with the last interval kept (tracking.system_metrics)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from orchestrator.tracking.write import TrackingWarning


def start_system_metrics(uri: str, run_id: str, interval_s: float, device: torch.device) -> Callable[[], None]:
    """MLflow's own system-metrics monitor for `run_id` on this node (a thread logging system/* metrics, resumed
    after the steps an earlier attempt logged), its GPU metrics those of `device` only; returns the call that
    stops it. Needs psutil (a dependency)."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True, tracking_uri=uri)
        own_gpu_only(monitor, device)
        monitor.start()
    except Exception as err:  # noqa: BLE001 - an unreachable server or a missing psutil: train without them
        warnings.warn(f"system metrics are not logged ({type(err).__name__}: {str(err)[:200]})", TrackingWarning,
                      stacklevel=2)
        return lambda: None

    def stop() -> None:
        monitor.finish()
        # MLflow's loop returns on the stop without publishing the samples of the interval the stop cut short, so a
        # run shorter than one interval logged no system metrics at all (a test's 4-step trial did so or not by the
        # machine's speed). Those samples go out as one last step.
        try:
            last = monitor.aggregate_metrics()
            if last:
                monitor.publish_metrics(last)
                monitor.mlflow_logger.flush()
        except Exception as err:  # noqa: BLE001 - the run goes on; its system metrics miss their last interval
            warnings.warn(f"the last system metrics were not logged ({type(err).__name__}: {str(err)[:200]})",
                          TrackingWarning, stacklevel=2)

    return stop


def own_gpu_only(monitor: Any, device: torch.device) -> None:
    """Keep the GPU metrics of `device` alone. MLflow's GPU monitor reads every GPU of the node through NVML
    (`gpu_0` ... `gpu_7` in the node's order), whatever GPUs Ray gave this process (CUDA_VISIBLE_DEVICES): rank 0
    of a run on one GPU of eight logged all eight, the other trials' included, under its own run. The run's GPU is
    found by its UUID (NVML's order and CUDA's may differ) and logged as `gpu_0`; a CPU run logs no GPU, and a GPU
    that cannot be matched is left out with a warning rather than logged as another's."""
    gpu = next((m for m in getattr(monitor, "monitors", []) if type(m).__name__ == "GPUMonitor"), None)
    if gpu is None:
        return
    monitor.monitors.remove(gpu)
    if device.type != "cuda":
        return
    try:
        import pynvml

        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception as err:  # noqa: BLE001 - NVML without this device (a MIG slice, an older driver)
        warnings.warn(f"GPU system metrics are not logged: {device} was not found in NVML ({type(err).__name__}: "
                      f"{str(err)[:200]})", TrackingWarning, stacklevel=2)
        return
    gpu.gpu_handles, gpu.num_gpus = [handle], 1
    monitor.monitors.append(gpu)
