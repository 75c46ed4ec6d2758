"""What the connected Ray cluster can run: the nodes and resources up now, and what its autoscaler may add.

Ray reports only the nodes that are up (`ray.cluster_resources()`), so a cluster started with few workers
would refuse runs and limit sweeps to the nodes of the moment, and the autoscaler (cluster.yaml: up to 8 GPU
workers) would never be asked for more. The autoscaler's limits come from Ray's own record of them (what Ray
Train V2 checks a worker group against; written by autoscaler v2 and KubeRay) or, for the cluster launcher's
v1 autoscaler, from the config its monitor process on the head reads (`ray start --autoscaling-config`;
`ray up` writes ~/ray_bootstrap_config.yaml). `ray job submit` runs the launcher on the head, next to it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import yaml

HEAD_RESOURCE = "node:__internal_head__"
"""Ray's resource of the head node (1.0 there, absent elsewhere): how trial drivers ask for the head."""
_MONITOR_SCRIPT = "autoscaler/_private/monitor.py"


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

    def most(self, resource: str) -> float:
        return max(self.capacity.get(resource, 0.0), self.resources.get(resource, 0.0))


def view_cluster() -> ClusterView:
    """The connected cluster (after `ray.init`)."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    resources = dict(ray.cluster_resources())
    head = next((dict(n.get("Resources", {})) for n in nodes if HEAD_RESOURCE in n.get("Resources", {})), {})
    limits = _autoscaler_limits(head)
    if limits is None:
        return ClusterView(nodes=len(nodes), resources=resources, capacity=dict(resources))
    capacity = {k: max(resources.get(k, 0.0), limits.get(k, 0.0)) for k in {*resources, *limits}}
    return ClusterView(nodes=len(nodes), resources=resources, capacity=capacity, autoscaling=True)


def _autoscaler_limits(head: Mapping[str, float]) -> dict[str, float] | None:
    """Resources of the largest cluster the autoscaler may build; None without an autoscaler."""
    # Ray Train V2's own source (worker_group.py) for the same check.
    from ray._private.state import state

    try:
        recorded = state.get_max_resources_from_cluster_config()
    except Exception:  # noqa: BLE001 - an older GCS without the record: fall back to the monitor's config
        recorded = None
    if recorded:
        return {k: float(v) for k, v in recorded.items()}
    config = _monitor_config(ray.get_runtime_context().gcs_address)
    return None if config is None else max_resources(config, head)


def max_resources(config: Mapping[str, Any], head: Mapping[str, float]) -> dict[str, float] | None:
    """Head + every worker node type at its max_workers (all of them capped by the top-level max_workers)
    from a cluster launcher / autoscaler config; None when no worker type may be added. A node type whose
    `resources` are left for Ray to detect ({}: a cloud instance type) adds nothing here, so a check against
    it errs towards what is up now."""
    types = {name: t for name, t in (config.get("available_node_types") or {}).items()
             if name != config.get("head_node_type") and (t.get("max_workers") or 0) > 0}
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
