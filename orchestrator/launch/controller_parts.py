"""What of ours a run's Ray Train controller holds: the report relay, and on a local Ray the scaling policy.

Ray unpickles these in the controller's own process, which imports the module that defines each (and everything
that module imports) before the run can start. So this module imports Ray's alone. The relay, defined next to the
launcher's console (orchestrator/launch/ray_console.py), had each controller import the spec, its FLOP counting,
the models and the tasks: 0.65 CPU-s of each `orchestrator train` (the controller imports torch for Ray Train's
TorchConfig anyway; docs/testing.md, "Where the slow tier's time goes").
"""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback

try:
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy
except ImportError:  # another Ray's layout: runs keep Ray's own policy (orchestrator/launch/train_actors.py)
    FixedScalingPolicy = None


class ReportRelay(UserCallback):
    """On a run's Ray Train controller: rank 0's metrics of every report into the launcher's queue (a
    `ray.util.queue.Queue` that orchestrator/launch/ray_console.py `RunReports` drains)."""

    def __init__(self, queue: Any):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint):
        if metrics:
            self.queue.put(dict(metrics[0]))  # rank 0 evaluates and logs; the others report the same step


if FixedScalingPolicy is not None:

    class FixedWorkersWithoutAutoscaler(FixedScalingPolicy):
        """Ray Train's fixed worker group, without its resource requests to Ray's autoscaling coordinator: the
        policy for a local Ray, which has no autoscaler to ask. Ray's own policy starts the coordinator (a detached
        actor, a Python process of its own, about 2.5 CPU-s) and tells it the group's demand every 20 s, for the
        autoscaler to add nodes; a local Ray never adds any."""

        def after_controller_start(self, train_run_context: Any) -> None:
            """No coordinator client: `_cancel_resource_request` at shutdown then does nothing, as Ray wrote it."""

        def _maybe_send_resource_request(self) -> None:
            pass

        def _send_resource_request(self) -> None:
            pass
else:
    FixedWorkersWithoutAutoscaler = None
