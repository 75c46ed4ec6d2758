"""What a spec asks of the machine or cluster it is launched on, checked before launching."""

from __future__ import annotations

from orchestrator.spec.models import ExperimentSpec, SpecError


def check_gpus(spec: ExperimentSpec, available: float, where: str) -> None:
    """Fail before launching when one run asks for more GPUs than `where` has."""
    need = spec.run.gpus_per_run
    if need > available:
        raise SpecError(
            f"run.workers={spec.run.workers} x run.gpus_per_worker={spec.run.gpus_per_worker} asks for {need:g} "
            f"GPUs per run but {where} has {available:g}; lower run.workers or run.gpus_per_worker "
            "(0 trains on CPU), or add GPU nodes to the cluster"
        )


def local_gpu_count() -> int:
    """GPUs visible to this process (the check used when no Ray cluster is connected yet)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
