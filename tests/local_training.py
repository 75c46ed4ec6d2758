"""Hooks for tests that drive the training core in this process (orchestrator.launch.local_run)."""

from __future__ import annotations

from orchestrator.launch.local_run import LocalHooks


class FailAtStep3(LocalHooks):
    """Raises after step 3, so a resume test has the checkpoint of step 2 to go on from."""

    def after_step(self, step: int) -> None:
        if step == 3:
            raise RuntimeError("injected")
