"""The launcher's terminal under Ray: Ray's own output turned down with Ray's own knobs, our lines instead.

Without --verbose:
- `ray.init(logging_level=ERROR, logging_config=LoggingConfig(log_level=ERROR))`: the launcher's Ray logs
  and the root logger of every task and actor of the job (Ray Train's placement-group monitor warns every
  few seconds that the state API cannot be asked when Ray runs without its dashboard);
- Ray Train's `RunConfig(logging_config=LoggingConfig(log_level=ERROR))`: its `ray.train` logs in the
  controller and workers (worker group start, checkpoint uploads);
- `worker.quiet_train_reports`, first thing in every Train worker's loop: the one Ray Train logger outside
  `ray.train`, which logs the repr of every TrainingReport at INFO, and the one that logs a failing training
  function's traceback at ERROR (the launcher prints its one line; the whole error is in the run's error.txt);
- Tune's `RunConfig(verbose=0)` with its legacy reporter (`RAY_AIR_NEW_OUTPUT=0`: the new one prints its
  experiment header at every verbosity), and its `ray.tune` logger off: a failed trial's traceback is in its
  error.txt and the launcher prints the one-line reason.
Worker output still reaches the terminal (`log_to_driver` stays on): a worker's own messages, such as
the checkpoint it resumed from, matter. The report lines come from the launcher: a sweep's from a Tune
`Callback` on its driver (`SweepConsole`), a run's from `RunReports`, whose Ray Train callback
(orchestrator/launch/controller_parts.py) queues rank 0's reports from the run's controller to a thread of the
launcher.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import ray
from ray import cloudpickle
from ray.train import LoggingConfig as TrainLoggingConfig
from ray.train import UserCallback
from ray.tune import Callback
from ray.util.queue import Empty, Queue

from orchestrator.console.progress import (
    SweepProgress,
    emit,
    failure_reason,
    report_line,
    trial_label,
    verbose,
)
from orchestrator.launch.preflight import LaunchError
from orchestrator.launch.controller_parts import ReportRelay

QUIET_LEVEL = "ERROR"
"""Ray's and Ray Train's own loggers without --verbose: errors still show, progress chatter does not."""


def ray_init_kwargs() -> dict[str, Any]:
    """`ray.init` arguments for the launcher's verbosity (none with --verbose: Ray's defaults)."""
    if verbose():
        return {}
    return {"logging_level": logging.ERROR, "logging_config": ray.LoggingConfig(encoding="TEXT", log_level=QUIET_LEVEL)}


def train_logging_config() -> TrainLoggingConfig:
    return TrainLoggingConfig(log_level="INFO" if verbose() else QUIET_LEVEL)


def quiet_tune() -> int:
    """Tune's `verbose` for this launcher; when quiet, also Tune's legacy reporter (silent at 0, unlike the
    new one) and its logger off, in this process (Tune runs in the launcher)."""
    if verbose():
        return 1
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    return 0


def _trial_error(trial: Any) -> str:
    """The one-line reason a trial failed, from the error Tune just wrote in the trial's local folder."""
    try:
        with open(trial.pickled_error_file, "rb") as f:
            error = cloudpickle.load(f)
        cause = getattr(error, "cause", None)  # RayTaskError wraps what the trial driver raised
        if isinstance(cause, LaunchError):  # already one line that says what failed
            return str(cause).splitlines()[0]
        return failure_reason(error)
    except Exception:  # noqa: BLE001 - not picklable, or not written: the text file, else where to look
        pass
    try:
        with open(trial.error_file) as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1][:400] if lines else f"see {trial.error_file}"
    except Exception:  # noqa: BLE001
        return "see the trial's error.txt"


_TUNE_STATES = {"RUNNING": "running", "PAUSED": "running", "TERMINATED": "done", "ERROR": "error"}


class SweepConsole(Callback):
    """On the sweep's driver: a report line per Tune result, a line per trial end, and the progress line at
    every trial start and end and at most every `interval_s` in between. Tune stores it with the sweep
    (tuner.pkl), so a resumed sweep gets it back; `SweepProgress` drops its clock when pickled."""

    def __init__(self, progress: SweepProgress, interval_s: float = 30.0, write: Callable[[str], None] = emit):
        self.progress = progress
        self.interval_s = interval_s
        self.write = write
        self._last_line: float | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last_line": None, "write": emit}

    def _sync(self, trials: list[Any]) -> None:
        states = {t.trial_id: _TUNE_STATES.get(t.status, "pending") for t in trials}
        finished = {t.trial_id: (trial_label(t.trial_id, t.config), t.last_result or {})
                    for t in trials if t.status in ("TERMINATED", "ERROR")}
        self.progress.sync(states, finished)

    def _progress(self, force: bool) -> None:
        import time

        now = time.monotonic()
        if force or self._last_line is None or now - self._last_line >= self.interval_s:
            self._last_line = now
            self.write(self.progress.line(now))

    def on_trial_start(self, iteration, trials, trial, **info):
        self._sync(trials)
        self.progress.states[trial.trial_id] = "running"  # Tune marks it RUNNING after its callbacks
        self._progress(force=True)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        label = trial_label(trial.trial_id, trial.config)
        self.progress.result(trial.trial_id, label, result)
        if not verbose():  # with --verbose the worker prints every logging step itself
            self.write(report_line(label, result, max_steps=self.progress.max_steps, metric=self.progress.metric))
        self._progress(force=False)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._sync(trials)
        self.progress.states[trial.trial_id] = "done"
        self.write(f"[{trial_label(trial.trial_id, trial.config)}] done")
        self._progress(force=True)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._sync(trials)
        self.progress.states[trial.trial_id] = "error"
        self.write(f"[{trial_label(trial.trial_id, trial.config)}] error: {_trial_error(trial)}")
        self._progress(force=True)


class RunReports:
    """The report lines of one `orchestrator train` run, printed by the launcher as they come. Use as a
    context manager around `trainer.fit()`, with `relay()` among the trainer's callbacks."""

    def __init__(self, label: str, *, max_steps: int, metric: str, write: Callable[[str], None] = emit):
        # num_cpus=0: the queue must not take a CPU that the run's workers need.
        self._queue = Queue(actor_options={"num_cpus": 0})
        self._label, self._max_steps, self._metric, self._write = label, max_steps, metric, write
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="run-reports", daemon=True)

    def relay(self) -> UserCallback:
        return ReportRelay(self._queue)

    def _drain(self) -> None:
        while True:
            try:
                metrics = self._queue.get(timeout=0.5)
            except Empty:
                if self._stop.is_set():
                    return
                continue
            except Exception:  # noqa: BLE001 - Ray went down under us: the run is over, nothing left to print
                return
            self._write(report_line(self._label, metrics, max_steps=self._max_steps, metric=self._metric))

    def __enter__(self) -> RunReports:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()  # the thread empties the queue first, then stops
        self._thread.join(timeout=10)
        try:
            ray.kill(self._queue.actor)
        except Exception:  # noqa: BLE001 - already gone with Ray
            pass
