"""What a user sees while runs train: one line per report of each run or trial, one progress line per sweep.

The lines and the sweep's bookkeeping live here, free of Ray; `ray_console` turns Ray's own output down
with Ray's own knobs and feeds these lines from the reports Ray hands the launcher. `--verbose` sets
`ORCHESTRATOR_VERBOSE=1`: Ray's output as Ray makes it, and every logging step from the worker.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.storage.layout import RunLayout, diverged

VERBOSE_ENV = "ORCHESTRATOR_VERBOSE"
"""Set to 1 in the launcher and in every Train worker's environment by `--verbose`; `tracking.ConsoleLogger`
prints every logging step only then (the launcher prints the reports)."""

QUIET_LOG_LEVEL = "ERROR"
"""Level of Ray's and Ray Train's own loggers without --verbose: errors still show, progress chatter does not."""


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def set_verbose(on: bool) -> None:
    """Before Ray starts: the launcher's choice, read again by `verbose()` here and in workers."""
    os.environ[VERBOSE_ENV] = "1" if on else "0"


def quiet_exit_in_finalizers() -> None:
    """Ray ends a worker with SIGTERM, which its handler turns into SystemExit wherever the process happens to be:
    inside a finalizer or weakref callback, Python prints "Exception ignored in ... SystemExit: 1" with a
    traceback, which Ray then forwards to the launcher's terminal. The process is ending as asked, so that
    SystemExit is dropped here (in our Ray processes: trial drivers, Train workers); every other unraisable
    exception is printed as Python would, and --verbose prints all."""
    if verbose() or getattr(sys.unraisablehook, "drops_system_exit", False):
        return  # a reused trial driver comes here once per trial: one hook, not a chain as deep as its trials
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, SystemExit):
            default(unraisable)

    hook.drops_system_exit = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def emit(line: str) -> None:
    """One line on the launcher's terminal, flushed at once (runs last minutes; a pipe would hold it)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --- lines ---------------------------------------------------------------------------------------------


def failure_reason(err: BaseException) -> str:
    """One line: the exception a Ray worker (or trial) raised, without Ray's wrapping and tracebacks."""
    causes = list(getattr(err, "worker_failures", {}).values()) or [getattr(err, "controller_failure", None) or err]
    lines = [line.strip() for line in str(causes[0]).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Loss|Failure|Interrupt)\b.*:", line)]
    text = (named or lines or [type(causes[0]).__name__])[-1]
    return text if len(text) <= 400 else text[:400] + "..."


def next_step(layout: RunLayout) -> str:
    """What to do after a failure: resume only when there is a checkpoint to resume from and resuming can end
    otherwise (a run that diverged diverges again from its checkpoints); a storage that does not answer, as in
    an object store's outage, is named, with the resume to run once it answers."""
    try:
        started = layout.has_checkpoint()
    except OSError as err:
        return (f"the storage {layout.storage} did not answer ({str(err).splitlines()[0][:200]}); once it does, "
                f"continue from the last checkpoint it holds with `orchestrator resume {layout.name} "
                f"--storage-path {layout.storage}`")
    if started and diverged(layout.folder) is not None:
        return ("a resume would diverge again from its checkpoints: change the spec as the error says and start it "
                "under another name (name=...)")
    if started:
        return (f"continue it from its last checkpoint with `orchestrator resume {layout.name} "
                f"--storage-path {layout.storage}`")
    return "it stopped before its first checkpoint, so its name is free: fix the cause and start it again"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def describe_config(config: Mapping[str, Any]) -> str:
    """A trial's swept values, short: `mha heads=4` for a whole attention block, `k=64` for a knob."""
    parts = []
    for path, value in config.items():
        if isinstance(value, Mapping):
            kind = value.get("kind")
            knobs = " ".join(f"{k}={_number(v)}" for k, v in value.items() if k != "kind" and not isinstance(v, Mapping))
            parts.append(" ".join(filter(None, (str(kind) if kind is not None else "", knobs))))
        else:
            parts.append(f"{path.rsplit('.', 1)[-1]}={_number(value)}")
    return ", ".join(p for p in parts if p)


def trial_label(trial_id: str, config: Mapping[str, Any]) -> str:
    """`00000 mha heads=4`: the trial's number within the sweep (what its folder and MLflow run carry) and
    what it tries."""
    number = trial_id.rsplit("_", 1)[-1]
    described = describe_config(config)
    return f"{number} {described}" if described else number


def report_line(label: str, metrics: Mapping[str, Any], *, max_steps: int, metric: str) -> str:
    """`[00000 mha heads=4] step 100/300 | train/loss 4.112 | val/ppl 61.2`: one report, the numbers that
    say whether it learns (the loss) and how it compares (the sweep's metric)."""
    parts = [f"[{label}] step {metrics.get('step', '?')}/{max_steps}"]
    for key in ("train/loss", metric):
        if key in metrics:
            parts.append(f"{key} {_number(metrics[key])}")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


# --- sweep progress -----------------------------------------------------------------------------------


@dataclass
class SweepProgress:
    """Counts, best so far and ETA of a sweep, from what its trials reported (no Ray objects: testable).

    States come from Tune's own trial list at every event (`sync`), so a resumed sweep counts the trials that
    had finished before it. The ETA divides the steps left (every running trial to `max_steps`, pending
    trials whole) by the steps per second this launcher has seen so far, all trials together since its first
    trial started; ASHA stopping trials early makes the real end sooner, so it is an upper bound there. A
    resumed trial counts from its first report on (the steps before were made by an earlier launcher)."""

    name: str
    total: int
    max_steps: int
    metric: str
    mode: str
    started: float | None = None
    """time.monotonic() of the first trial start seen by this process (None until then, and after pickling:
    Tune stores its callbacks with the sweep and a resume brings this object back in another process)."""
    states: dict[str, str] = field(default_factory=dict)
    """trial id -> running | done | error | pending."""
    steps: dict[str, int] = field(default_factory=dict)
    first_steps: dict[str, int] = field(default_factory=dict)
    best: tuple[float, str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "started": None, "steps": {}, "first_steps": {}}

    def sync(self, states: Mapping[str, str], last_results: Mapping[str, tuple[str, Mapping[str, Any]]] = {}) -> None:
        """Tune's view: each trial's state and (label, last result), e.g. a trial that finished before a resume."""
        if self.started is None:
            self.started = time.monotonic()
        self.states = dict(states)
        for label, result in last_results.values():
            self._consider(label, result)

    def result(self, trial_id: str, label: str, metrics: Mapping[str, Any]) -> None:
        if self.started is None:
            self.started = time.monotonic()
        if self.states.get(trial_id, "pending") == "pending":
            self.states[trial_id] = "running"
        step = metrics.get("step")
        if isinstance(step, int):
            # `evaluations` counts from step 0, Tune's training_iteration from this process's first report:
            # more evaluations than iterations means the trial resumed from a checkpoint.
            resumed = metrics.get("evaluations", 0) > metrics.get("training_iteration", 0) > 0
            self.first_steps.setdefault(trial_id, step if resumed else 0)
            self.steps[trial_id] = step
        self._consider(label, metrics)

    def _consider(self, label: str, metrics: Mapping[str, Any]) -> None:
        value = metrics.get(self.metric)
        if isinstance(value, (int, float)) and value == value:  # NaN is never best
            if self.best is None or (value < self.best[0] if self.mode == "min" else value > self.best[0]):
                self.best = (float(value), label)

    def counts(self) -> dict[str, int]:
        done = sum(s == "done" for s in self.states.values())
        errored = sum(s == "error" for s in self.states.values())
        running = sum(s == "running" for s in self.states.values())
        return {"done": done, "running": running, "pending": max(0, self.total - done - errored - running),
                "errored": errored}

    def steps_per_s(self, now: float | None = None) -> float | None:
        made = sum(self.steps[t] - self.first_steps.get(t, 0) for t in self.steps)
        if self.started is None or made <= 0:
            return None
        elapsed = (now if now is not None else time.monotonic()) - self.started
        return made / elapsed if elapsed > 0 else None

    def eta_s(self, now: float | None = None) -> float | None:
        rate = self.steps_per_s(now)
        if rate is None:
            return None
        left = sum(self.max_steps - self.steps.get(t, 0) for t, s in self.states.items() if s == "running")
        left += self.counts()["pending"] * self.max_steps
        return left / rate

    def line(self, now: float | None = None) -> str:
        """`sweep smoke: 1/3 done, 1 running, 1 pending, 0 errored | best val/ppl 89.67 (00000 mha heads=4) |
        2.31 steps/s | ETA 0:01:05`."""
        c = self.counts()
        parts = [f"sweep {self.name}: {c['done']}/{self.total} done, {c['running']} running, {c['pending']} pending, "
                 f"{c['errored']} errored"]
        if self.best is not None:
            parts.append(f"best {self.metric} {self.best[0]:.4g} ({self.best[1]})")
        rate = self.steps_per_s(now)
        if rate is not None:
            parts.append(f"{rate:.2f} steps/s")
            if c["running"] or c["pending"]:
                eta = self.eta_s(now)
                parts.append(f"ETA {_duration(eta)}" if eta is not None else "ETA ?")
        return " | ".join(parts)
