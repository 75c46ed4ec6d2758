"""The metrics fan-out of a training run: `log(metrics, step)` / `close()` to the console and to MLflow, through
`MetricsLogger` (torchtitan's components/metrics.py). Only rank 0 logs."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Protocol

from orchestrator.console.progress import VERBOSE_ENV
from orchestrator.tracking.write import MlflowTracker


class BaseLogger(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...


class ConsoleLogger:
    """One concise line per logging step: `[name] step 200/1000 | train/loss 3.1200 | val/ppl 25.1 ...`.

    Only with `orchestrator ... --verbose` (ORCHESTRATOR_VERBOSE=1 in the worker's environment; unset, as
    outside the launcher, counts as verbose): by default the launcher prints one line per report itself
    (orchestrator/launch/ray_console.py), without Ray's `(RayTrainWorker pid=...)` prefix on every line."""

    def __init__(self, label: str, max_steps: int, *, enabled: bool | None = None):
        self.label = label
        self.max_steps = max_steps
        self.enabled = os.environ.get(VERBOSE_ENV, "1") == "1" if enabled is None else enabled

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        parts = [f"{k} {v:.4g}" for k, v in metrics.items()]
        self._write(f"[{self.label}] step {step}/{self.max_steps} | " + " | ".join(parts))

    def close(self, status: str = "FINISHED") -> None:
        self._write(f"[{self.label}] {status.lower()}")

    def _write(self, line: str) -> None:
        if not self.enabled:
            return
        # Not print(): Ray Train patches print on workers to tee into its logger, which shows every line twice.
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class MlflowLogger:
    """Metrics of one MLflow run, through a guarded tracker.

    The run is opened through `open_run` (`MlflowTracker.ensure_run` of the launcher's handle, which also logs
    params when it creates the run); when the server is down at the start, metrics wait in the tracker's spool
    as points of a run not open yet, and the run is opened as soon as the server answers (here, or by the
    launcher or `orchestrator resume` if it never answers while this process lives), so a run that started
    during an outage still ends up complete in MLflow.
    """

    def __init__(self, tracker: MlflowTracker, open_run: Callable[[], str | None]):
        self.tracker = tracker
        self._open_run = open_run
        self._last: dict[str, int] | None = None
        """Per metric, the last step the run already holds; None until MLflow was asked."""
        self.run_id: str | None = open_run()
        self._ensure_run()

    def _ensure_run(self) -> bool:
        """The run is open and its logged steps known (what an earlier attempt logged or spooled)."""
        if self.run_id is None and self.tracker.available:
            self.run_id = self._open_run()
        if self.run_id is not None and self._last is None and self.tracker.available:
            self.tracker.flush(self.run_id)  # an earlier attempt's spool first, so its steps count as logged
            self._last = self.tracker.last_steps(self.run_id)
        return self._last is not None

    def _send(self, metrics: Mapping[str, float], step: int) -> None:
        # A resumed run recomputes the steps after its checkpoint: the first attempt's points stay, once.
        fresh = {k: v for k, v in metrics.items() if step > self._last.get(k, -1)}
        self._last.update({k: step for k in fresh})
        if fresh:
            self.tracker.log_metrics(self.run_id, fresh, step, once=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._ensure_run():
            self._send(metrics, step)
        else:
            # MLflow cannot say which steps the run holds (an outage at a resume), or there is no run to log to
            # yet (the server was away since launch: run id None): spooled all the same, so a driver killed
            # meanwhile loses nothing; the tracker sends each (metric, step) once, to the run once it is open.
            self.tracker.log_metrics(self.run_id, metrics, step, once=True)

    def close(self, status: str = "FINISHED") -> None:
        """Send what is buffered (what cannot be sent stays in the spool); the launcher ends the run."""
        if self._ensure_run():
            self.tracker.flush(self.run_id)


class MetricsLogger:
    """The container every metric goes through (console + MLflow on rank 0, nothing elsewhere)."""

    def __init__(self, loggers: list[BaseLogger] | None = None):
        self.loggers = list(loggers or [])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def close(self, status: str = "FINISHED") -> None:
        for logger in self.loggers:
            logger.close(status)
