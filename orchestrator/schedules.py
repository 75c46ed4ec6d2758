"""Learning-rate schedules of `optim.schedule`, shared by the Ray worker loop and the Ray-free recipe runner."""

from __future__ import annotations

import math
from collections.abc import Callable

from orchestrator.spec import OptimConfig


def lr_lambda(optim: OptimConfig) -> Callable[[int], float]:
    """Multiplier of optim.lr after `step` optimizer steps: linear warmup, then the chosen decay."""
    warmup, total = optim.warmup_steps, optim.max_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup  # never 0: the first step already learns
        if optim.schedule == "constant":
            return 1.0
        if optim.schedule == "inverse_sqrt":
            # Vaswani et al. (2017), eq. 3, normalised to 1 at the end of warmup.
            return math.sqrt(max(warmup, 1)) / math.sqrt(step + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if optim.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
