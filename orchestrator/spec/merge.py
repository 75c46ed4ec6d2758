"""`base:` inheritance: how a spec file's mapping is deep-merged over its base's (and a pretraining stage's
fields over its spec's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orchestrator.spec.search_space import is_domain

# What makes a study itself: never taken from a base (the child's name also renames its scales, and
# tracking.experiment then defaults to the child's name).
_IDENTITY_KEYS = ("name", "tracking.experiment")


def _without_identity(base: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in base.items() if k != "name"}
    if isinstance(out.get("tracking"), Mapping):
        out["tracking"] = {k: v for k, v in out["tracking"].items() if k != "experiment"}
    if isinstance(out.get("scales"), Mapping):
        out["scales"] = {
            scale: ({k: v for k, v in entries.items() if k not in _IDENTITY_KEYS}
                    if isinstance(entries, Mapping) else entries)
            for scale, entries in out["scales"].items()
        }
    return out


def merge_mappings(base: Any, child: Any) -> Any:
    """`child` over `base`, recursively (the rules are `merge_base`'s, without its identity and scales)."""
    if not (isinstance(base, Mapping) and isinstance(child, Mapping)) or is_domain(base) or is_domain(child):
        return child  # scalars, lists, null and search domains replace whole, in either direction
    if "kind" in child and child["kind"] != base.get("kind"):
        return child  # another kind: the base's knobs belong to its own kind
    out = dict(base)
    for key, value in child.items():
        out[key] = merge_mappings(base[key], value) if key in base else value
    return out


def merge_base(base: Mapping[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """The child spec's mapping deep-merged over its base's (both as read, their own `base:` resolved).

    - Mappings merge key by key, recursively; keys the child adds come after the base's.
    - Scalars, lists and null replace whole, and so do search domains (`{grid: [...]}`) in either direction: a
      child domain replaces the base's value, and a child value replaces the base's domain.
    - A child mapping whose `kind` differs from the base mapping's (or where the base's names none) replaces it
      whole, so `model.attention: {kind: mha, heads: 8}` over a Linformer block keeps no stale `k`.
    - `scales:` merge per scale name, then per dotted key: the child's value for a key replaces the base's, and
      the base's other keys still apply.
    - `name` and `tracking.experiment` (also as scale entries) are never inherited: the child names itself.
    """
    base = _without_identity(base)
    child = dict(child)
    base_scales, child_scales = base.pop("scales", None), child.pop("scales", None)
    out = merge_mappings(base, child)
    if "name" in child:  # first, where a spec file has it
        out = {"name": child["name"], **out}
    if isinstance(base_scales, Mapping) and isinstance(child_scales, Mapping):
        scales = dict(base_scales)
        for scale, entries in child_scales.items():
            inherited = scales.get(scale)
            both = isinstance(inherited, Mapping) and isinstance(entries, Mapping)
            scales[scale] = {**inherited, **entries} if both else entries
        out["scales"] = scales
    elif base_scales is not None or child_scales is not None:
        out["scales"] = child_scales if child_scales is not None else base_scales
    return out
