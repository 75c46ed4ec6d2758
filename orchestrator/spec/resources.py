"""What a spec asks of the machine or cluster it is launched on, checked before launching: every Train run it makes
(a `pretrain:` stage's, then its own) against the GPUs and CPUs there, in all and on a single node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from orchestrator.spec.models import ExperimentSpec, RunSettings, SpecError


def stage_runs(spec: ExperimentSpec) -> list[tuple[str, RunSettings]]:
    """(field prefix, run settings) of each Train run of `spec`: a `pretrain:` stage runs with `pretrain.run` merged
    over `run:` (ExperimentSpec.pretraining_spec), the settings it will train with, named by where they are set."""
    stages = [("run", spec.run)]
    if spec.pretrain is not None:
        stages.insert(0, ("pretrain.run", spec.pretraining_spec().run))
    return stages


def check_gpus(spec: ExperimentSpec, available: float, where: str) -> None:
    """Fail before launching when one run, or its pretraining stage, asks for more GPUs than `where` has."""
    for field, run in stage_runs(spec):
        need = run.gpus_per_run
        if need > available:
            raise SpecError(
                f"{field}.workers={run.workers} x {field}.gpus_per_worker={run.gpus_per_worker:g} asks for {need:g} "
                f"GPUs per run but {where} has {available:g}; lower {field}.workers or {field}.gpus_per_worker "
                "(0 trains on CPU), or add GPU nodes to the cluster"
            )


def check_cpus(spec: ExperimentSpec, available: float, where: str) -> None:
    """Fail before launching when one run, or its pretraining stage, asks for more CPUs than `where` has."""
    for field, run in stage_runs(spec):
        need = run.workers * run.cpus_per_worker
        if need > available:
            raise SpecError(
                f"{field}.workers={run.workers} x {field}.cpus_per_worker={run.cpus_per_worker:g} asks for {need:g} "
                f"CPUs but {where} has {available:g}; lower one of them"
            )


def check_worker_fits(spec: ExperimentSpec, nodes: Sequence[Mapping[str, float]], where: str) -> None:
    """Each worker of every stage fits on one of `nodes` (the GPUs and CPUs of each kind of node `where` has or may
    add; none known: not checked). Ray Train places a worker's bundle on a single node, so a bundle larger than every
    node is never placed: Train's start timeout is a retryable error, and the run waits without end."""
    if not nodes:
        return
    for field, run in stage_runs(spec):
        gpus, cpus = run.gpus_per_worker, run.cpus_per_worker
        if any(node.get("GPU", 0.0) >= gpus and node.get("CPU", 0.0) >= cpus for node in nodes):
            continue
        placed = "a Ray Train worker's GPUs and CPUs are placed on a single node"
        with_gpus = [node for node in nodes if node.get("GPU", 0.0) >= gpus]
        if not with_gpus:
            largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)))
            raise SpecError(
                f"{field}.gpus_per_worker={gpus:g} asks for {gpus:g} GPUs on one node ({placed}), but the largest "
                f"node of {where} has {_describe(largest)}; lower {field}.gpus_per_worker to at most "
                f"{largest.get('GPU', 0.0):g} (0 trains on CPU), or add nodes with more GPUs"
            )
        largest = max(with_gpus, key=lambda n: (n.get("CPU", 0.0), n.get("GPU", 0.0)))
        most = largest.get("CPU", 0.0)
        lower = f"lower {field}.cpus_per_worker to at most {most:g}, or " if most > 0 else ""
        if gpus > 0 and any(node.get("CPU", 0.0) >= cpus for node in nodes):  # on nodes without the GPUs
            raise SpecError(
                f"{field}.cpus_per_worker={cpus:g} with {field}.gpus_per_worker={gpus:g} asks for both on one node "
                f"({placed}), but the nodes with {gpus:g} GPU(s) of {where} have at most {most:g} CPUs (the largest: "
                f"{_describe(largest)}); {lower}add GPU nodes with more CPUs"
            )
        raise SpecError(
            f"{field}.cpus_per_worker={cpus:g} asks for {cpus:g} CPUs on one node ({placed}), but the largest node of "
            f"{where} has {_describe(largest)}; {lower}add nodes with more CPUs"
        )


def _describe(node: Mapping[str, float]) -> str:
    return f"{node.get('GPU', 0.0):g} GPUs and {node.get('CPU', 0.0):g} CPUs"


def local_gpu_count() -> int:
    """GPUs visible to this process (the check used when no Ray cluster is connected yet)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
