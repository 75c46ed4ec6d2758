"""What a spec asks of the machine or cluster it is launched on, checked before launching: every Train run it makes
(a `pretrain:` stage's, then its own) against the GPUs and CPUs there, in all, on a single node, and spread over the
nodes of a cluster that cannot grow."""

from __future__ import annotations

import math
from collections import Counter
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


def check_workers_placed(spec: ExperimentSpec, nodes: Sequence[Mapping[str, float]], where: str) -> None:
    """All workers of every stage are placed at once on `nodes`: the GPUs and CPUs of each node of a cluster that
    cannot add any (none known: not checked). A run whose workers fit the totals and a node each may still not
    all be placed: 3 workers of 2 CPUs on 2 nodes of 3 CPUs fit one per node. Ray Train places the whole group
    or nothing, and waits for it without end (`check_worker_fits`)."""
    if not nodes:
        return
    for field, run in stage_runs(spec):
        gpus, cpus, workers = run.gpus_per_worker, run.cpus_per_worker, run.workers
        placed = workers_placed(nodes, cpus=cpus, gpus=gpus, most=workers)
        if placed >= workers:
            continue
        fixes = [f"lower {field}.workers to {placed}"]
        fewer_cpus = most_cpus_placing_all(nodes, workers, cpus=cpus, gpus=gpus)
        if fewer_cpus is not None:  # (not fewer GPUs: several workers need a whole GPU each, models.py)
            fixes.append(f"{field}.cpus_per_worker to {fewer_cpus:g}")
        each = f"{cpus:g} CPUs" + (f" and {gpus:g} GPUs" if gpus else "")
        kinds = Counter(_describe(node) for node in nodes)
        held = ", ".join(f"{n} node{'s' * (n > 1)} of {kind}" for kind, n in kinds.items())
        raise SpecError(
            f"{field}.workers={workers} workers of {each} each: only {placed} can be placed at once on {where} "
            f"({held}; a worker's GPUs and CPUs are on a single node, and Ray Train waits for every worker of the "
            f"run); {', or '.join(fixes)}, or add nodes"
        )


def workers_placed(nodes: Sequence[Mapping[str, float]], *, cpus: float, gpus: float, most: int) -> int:
    """Workers of `cpus` CPUs and `gpus` GPUs that `nodes` hold at once (up to `most`): the workers are alike, so
    each node holds as many as its scarcer resource allows."""
    def on(node: Mapping[str, float]) -> int:
        fits = [math.floor(node.get(name, 0.0) / need + 1e-9) for name, need in (("CPU", cpus), ("GPU", gpus))
                if need > 0]
        return min([most, *fits])

    return min(most, sum(on(node) for node in nodes))


def most_cpus_placing_all(nodes: Sequence[Mapping[str, float]], workers: int, *, cpus: float,
                          gpus: float) -> float | None:
    """The most CPUs per worker, below `cpus`, at which all `workers` are placed on `nodes` with `gpus` each; None
    when no amount does. A node holds k workers of at most its CPUs / k each, so those quotients are the
    candidates; the one found is rounded down to hundredths (8 CPUs / 3: 2.66), which still fits."""
    candidates = sorted({node.get("CPU", 0.0) / k for node in nodes for k in range(1, workers + 1)}, reverse=True)
    for amount in (math.floor(c * 100) / 100 for c in candidates):
        if 0 < amount < cpus and workers_placed(nodes, cpus=amount, gpus=gpus, most=workers) >= workers:
            return amount
    return None


def _describe(node: Mapping[str, float]) -> str:
    return f"{node.get('GPU', 0.0):g} GPUs and {node.get('CPU', 0.0):g} CPUs"


def local_gpu_count() -> int:
    """GPUs visible to this process (the check used when no Ray cluster is connected yet)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
