"""MLflow's system-metrics monitor for a run, with the last interval kept (tracking.system_metrics)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

from orchestrator.tracking.write import TrackingWarning


def start_system_metrics(uri: str, run_id: str, interval_s: float) -> Callable[[], None]:
    """MLflow's own system-metrics monitor for `run_id` on this node (a thread logging system/* metrics, resumed
    after the steps an earlier attempt logged); returns the call that stops it. Needs psutil (a dependency)."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True, tracking_uri=uri)
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
