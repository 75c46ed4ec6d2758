"""What the connected Ray cluster can run: the nodes and resources up now, and what its autoscaler may add.

Ray reports only the nodes that are up (`ray.cluster_resources()`), so a cluster started with few workers
would refuse runs and limit sweeps to the nodes of the moment, and the autoscaler (cluster.yaml: up to 8 GPU
workers) would never be asked for more. The autoscaler's limits come from Ray's own record of them (what Ray
Train V2 checks a worker group against; written by autoscaler v2 and KubeRay) or, for the cluster launcher's
v1 autoscaler, from the config its monitor process on the head reads (`ray start --autoscaling-config`;
`ray up` writes ~/ray_bootstrap_config.yaml). `ray job submit` runs the launcher on the head, next to it.
A Ray Train worker's bundle is placed on one node, so the view also keeps each kind of node (`node_kinds`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import ray
import yaml

HEAD_RESOURCE = "node:__internal_head__"
"""Ray's resource of the head node (1.0 there, absent elsewhere): how trial drivers ask for the head."""
_MONITOR_SCRIPT = "autoscaler/_private/monitor.py"
WORKER_RESOURCES = ("CPU", "GPU")
"""What a Train worker's bundle asks of its node (launch/run.py build_trainer)."""
_SAME_MACHINE_PROVIDER = "fake_multinode"
"""Ray's autoscaler provider whose nodes are raylets on the head's machine (the slow tier's autoscaling cluster)."""


@dataclass(frozen=True)
class ClusterView:
    nodes: int
    """Nodes alive now."""
    resources: dict[str, float]
    """Total resources of the nodes alive now."""
    capacity: dict[str, float] = field(default_factory=dict)
    """Resources when the autoscaler has added every node it may (= resources without an autoscaler)."""
    autoscaling: bool = False
    """An autoscaler may add nodes."""
    node_kinds: tuple[dict[str, float], ...] = ()
    """CPUs and GPUs of each kind of node: those alive now and the node types the autoscaler may add (those whose
    config declares their resources); () when not known."""
    alive_nodes: tuple[dict[str, float], ...] = ()
    """CPUs and GPUs of each node alive now, one entry per node; () when not known."""
    one_machine: bool = False
    """Every node, alive or to be added, runs on one machine (Ray's test clusters; the fake_multinode autoscaler):
    a loopback address there reaches the same server from every node."""

    def most(self, resource: str) -> float:
        return max(self.capacity.get(resource, 0.0), self.resources.get(resource, 0.0))


def view_cluster() -> ClusterView:
    """The connected cluster (after `ray.init`)."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    resources = dict(ray.cluster_resources())
    head = next((dict(n.get("Resources", {})) for n in nodes if HEAD_RESOURCE in n.get("Resources", {})), {})
    kinds = [_kind(n.get("Resources", {})) for n in nodes]
    # Nodes of one machine share its IP (Ray's test clusters start every raylet with the machine's address).
    one_machine = len({n.get("NodeManagerAddress") for n in nodes}) <= 1
    scaler = _autoscaler(head)
    if scaler is None:
        return ClusterView(nodes=len(nodes), resources=resources, capacity=dict(resources),
                           node_kinds=_distinct(kinds), alive_nodes=tuple(kinds), one_machine=one_machine)
    limits = scaler.limits
    capacity = {k: max(resources.get(k, 0.0), limits.get(k, 0.0)) for k in {*resources, *limits}}
    return ClusterView(nodes=len(nodes), resources=resources, capacity=capacity, autoscaling=True,
                       node_kinds=_distinct([*kinds, *scaler.node_kinds]), alive_nodes=tuple(kinds),
                       one_machine=one_machine and not scaler.other_machines)


class Autoscaler(NamedTuple):
    limits: dict[str, float]
    """Resources of the largest cluster the autoscaler may build."""
    node_kinds: list[dict[str, float]]
    """CPUs and GPUs of each node type it may add."""
    other_machines: bool
    """Its nodes are other machines (a cloud's instances, KubeRay's pods), where loopback is not the head."""


def _autoscaler(head: Mapping[str, float]) -> Autoscaler | None:
    """What the cluster's autoscaler may add; None without an autoscaler."""
    # Ray Train V2's own source (worker_group.py) for the same check.
    from ray._private.state import state

    try:
        recorded = state.get_max_resources_from_cluster_config()
        groups = list(state.get_cluster_config().node_group_configs) if recorded else []
    except Exception:  # noqa: BLE001 - an older GCS without the record: fall back to the monitor's config
        recorded = None
    if recorded:  # autoscaler v2 and KubeRay record it; a group of max_count -1 has no limit
        kinds = [_kind(dict(group.resources)) for group in groups if group.max_count != 0]
        return Autoscaler({k: float(v) for k, v in recorded.items()}, kinds, other_machines=True)
    config = _monitor_config(ray.get_runtime_context().gcs_address)
    limits = None if config is None else max_resources(config, head)
    if limits is None:
        return None
    provider = (config.get("provider") or {}).get("type")
    return Autoscaler(limits, node_types(config), other_machines=provider != _SAME_MACHINE_PROVIDER)


def _kind(resources: Mapping[str, float]) -> dict[str, float]:
    return {name: float(resources.get(name, 0.0)) for name in WORKER_RESOURCES}


def _distinct(kinds: list[dict[str, float]]) -> tuple[dict[str, float], ...]:
    return tuple({tuple(kind.items()): kind for kind in kinds}.values())


def _addable_types(config: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The worker node types of an autoscaler config that it may add (max_workers > 0)."""
    return {name: t for name, t in (config.get("available_node_types") or {}).items()
            if name != config.get("head_node_type") and (t.get("max_workers") or 0) > 0}


def node_types(config: Mapping[str, Any]) -> list[dict[str, float]]:
    """CPUs and GPUs of each worker node type an autoscaler config may add; a type whose resources are left for
    Ray to detect ({}) is not known here, as in `max_resources`."""
    return [_kind(t["resources"]) for t in _addable_types(config).values() if t.get("resources")]


def max_resources(config: Mapping[str, Any], head: Mapping[str, float]) -> dict[str, float] | None:
    """Head + every worker node type at its max_workers (all of them capped by the top-level max_workers)
    from a cluster launcher / autoscaler config; None when no worker type may be added. A node type whose
    `resources` are left for Ray to detect ({}: a cloud instance type) adds nothing here, so a check against
    it errs towards what is up now."""
    types = _addable_types(config)
    if not types:
        return None
    cap = config.get("max_workers")
    totals: dict[str, float] = dict(head)
    for node_type in types.values():
        count = node_type["max_workers"] if cap is None else min(node_type["max_workers"], cap)
        for name, amount in (node_type.get("resources") or {}).items():
            totals[name] = totals.get(name, 0.0) + count * float(amount)
    if cap is not None:  # no more than `max_workers` worker nodes in all: at most cap x the richest type's amount
        for name in {k for t in types.values() for k in (t.get("resources") or {})}:
            richest = max(float((t.get("resources") or {}).get(name, 0)) for t in types.values())
            totals[name] = min(totals[name], head.get(name, 0.0) + cap * richest)
    return totals


def _monitor_config(gcs_address: str) -> dict[str, Any] | None:
    """The autoscaling config of the cluster at `gcs_address`, from its monitor process on this machine."""
    port = gcs_address.rsplit(":", 1)[-1]
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not any(a.endswith(_MONITOR_SCRIPT) for a in args):
            continue
        if not any(a.startswith("--gcs-address=") and a.rsplit(":", 1)[-1] == port for a in args):
            continue
        path = next((a.split("=", 1)[1] for a in args if a.startswith("--autoscaling-config=")), None)
        if path:
            try:
                text = Path(path).expanduser().read_text()
            except OSError:
                return None
            return json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    return None
