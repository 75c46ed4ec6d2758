"""The Ray Train callback that hands a run's reports to its launcher: it lives on the run's controller.

Ray unpickles a run's callbacks in the controller's own process, which imports the module that defines each one
(and everything that module imports) before the run can start. So this module imports Ray's alone: defined next
to the launcher's console (orchestrator/launch/ray_console.py), the callback had each controller import the
spec, its FLOP counting, the models and the tasks: 0.65 CPU-s of each `orchestrator train` (the controller
imports torch for Ray Train's TorchConfig anyway; docs/testing.md, "Where the slow tier's time goes").
"""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback


class ReportRelay(UserCallback):
    """On a run's Ray Train controller: rank 0's metrics of every report into the launcher's queue (a
    `ray.util.queue.Queue` that orchestrator/launch/ray_console.py `RunReports` drains)."""

    def __init__(self, queue: Any):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint):
        if metrics:
            self.queue.put(dict(metrics[0]))  # rank 0 evaluates and logs; the others report the same step
