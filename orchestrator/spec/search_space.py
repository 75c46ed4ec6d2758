"""The YAML search-space syntax of a sweep spec, and its compilation to Ray Tune domains.

Any value in a spec may be replaced by a one-key mapping that names a search domain:

    {grid: [a, b, c]}        every value, in every combination with the other grids
    {choice: [a, b, c]}      one value drawn per sample
    {uniform: [lo, hi]}      a float in [lo, hi]
    {loguniform: [lo, hi]}   a float in [lo, hi], log-uniform (lo > 0)
    {randint: [lo, hi]}      an int in [lo, hi) (Ray Tune's convention: hi is excluded)

Domains may sit at any depth of the mapping tree (`model.attention.k`, `optim.lr`, ...). Parsing and
validation here are pure Python so that a bad spec fails before Ray is imported; `to_param_space`
imports `ray.tune` only when a sweep is really launched.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

DomainKind = Literal["grid", "choice", "uniform", "loguniform", "randint"]
DOMAIN_KINDS: tuple[str, ...] = ("grid", "choice", "uniform", "loguniform", "randint")
_RANGE_KINDS = ("uniform", "loguniform", "randint")

# Grid validation enumerates the product of every domain's test points; past this many combinations
# a seeded random subset is checked instead (every grid value still appears at least once).
MAX_VALIDATED_POINTS = 256
RANDOM_VALIDATION_SAMPLES = 4


class SearchSpaceError(ValueError):
    """A search domain is malformed; the message names its dotted path and the fix."""


@dataclass(frozen=True)
class Domain:
    """One search domain found in a spec, at a dotted path such as `model.attention.k`."""

    path: str
    kind: DomainKind
    values: tuple[Any, ...]
    """grid/choice: the candidates; uniform/loguniform/randint: (lo, hi)."""

    @property
    def is_grid(self) -> bool:
        return self.kind == "grid"

    def test_points(self) -> list[Any]:
        """Values that validation must try: every candidate, or both ends of a range."""
        if self.kind in ("grid", "choice"):
            return list(self.values)
        lo, hi = self.values
        return [lo, hi - 1] if self.kind == "randint" else [lo, hi]

    def sample(self, rng: random.Random) -> Any:
        """A random value with the same law as the Tune domain (used only to validate specs)."""
        if self.kind in ("grid", "choice"):
            return rng.choice(self.values)
        lo, hi = self.values
        if self.kind == "uniform":
            return rng.uniform(lo, hi)
        if self.kind == "loguniform":
            return math.exp(rng.uniform(math.log(lo), math.log(hi)))
        return rng.randrange(lo, hi)

    def to_tune(self, grid_as_choice: bool = False) -> Any:
        """The `ray.tune` object for this domain."""
        from ray import (
            tune,  # imported here: validation must not pay for (or depend on) Ray
        )

        if self.kind == "grid" and not grid_as_choice:
            return tune.grid_search(list(self.values))
        if self.kind in ("grid", "choice"):
            return tune.choice(list(self.values))
        lo, hi = self.values
        return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[self.kind](lo, hi)


def _number(value: Any) -> Any:
    """PyYAML reads `1e-4` (no dot) as a string; take it as the float it was meant to be."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _parse_domain(path: str, node: Mapping[str, Any]) -> Domain:
    (kind, args), = node.items()
    if not isinstance(args, list) or not args:
        raise SearchSpaceError(f"{path}: {{{kind}: ...}} needs a non-empty list, got {args!r}; e.g. {{{kind}: [1, 2]}}")
    if kind in ("grid", "choice"):
        return Domain(path, kind, tuple(args))
    args = [_number(a) for a in args]
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise SearchSpaceError(f"{path}: {{{kind}: [lo, hi]}} needs exactly two numbers, got {args!r}")
    lo, hi = args
    if not lo < hi:
        raise SearchSpaceError(f"{path}: {{{kind}: [{lo}, {hi}]}} needs lo < hi; swap or widen the range")
    if kind == "loguniform" and lo <= 0:
        raise SearchSpaceError(f"{path}: {{loguniform: [{lo}, {hi}]}} needs lo > 0; use uniform for ranges touching 0")
    if kind == "randint" and not (isinstance(lo, int) and isinstance(hi, int)):
        raise SearchSpaceError(f"{path}: {{randint: [{lo}, {hi}]}} needs integers; use uniform for floats")
    return Domain(path, kind, (lo, hi))


def is_domain(node: Any) -> bool:
    """A search domain (`{grid: [...]}`): a mapping with one key, a domain kind."""
    return isinstance(node, Mapping) and len(node) == 1 and next(iter(node)) in DOMAIN_KINDS


def find_domains(raw: Mapping[str, Any], prefix: str = "") -> list[Domain]:
    """Every search domain in a raw spec, in document order."""
    found: list[Domain] = []
    for key, node in raw.items():
        path = f"{prefix}{key}"
        if is_domain(node):
            found.append(_parse_domain(path, node))
        elif isinstance(node, Mapping):
            found.extend(find_domains(node, prefix=f"{path}."))
        elif isinstance(node, list) and any(is_domain(item) or isinstance(item, Mapping) for item in node):
            nested = [item for item in node if is_domain(item) or (isinstance(item, Mapping) and find_domains(item))]
            if nested:
                raise SearchSpaceError(
                    f"{path}: search domains inside a list are not supported; make the whole list the domain, "
                    f"e.g. {{grid: [[64, 64], [32, 64]]}}"
                )
    return found


def set_path(raw: Mapping[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of `raw` with the dotted `path` set to `value` (intermediate mappings created)."""
    out = copy.deepcopy(dict(raw))
    node = out
    keys = path.split(".")
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise SearchSpaceError(f"{'.'.join(keys[: i + 1])} is a value ({child!r}), so {path} cannot be set")
        node = child
    node[keys[-1]] = value
    return out


def resolve(raw: Mapping[str, Any], assignment: Mapping[str, Any]) -> dict[str, Any]:
    """The raw spec with each domain path replaced by its assigned value."""
    out = copy.deepcopy(dict(raw))
    for path, value in assignment.items():
        out = set_path(out, path, value)
    return out


def grid_points(domains: list[Domain]) -> list[dict[str, Any]]:
    """The grid combinations Tune will run (one sample each): the product over `grid` domains only."""
    grids = [d for d in domains if d.is_grid]
    return [dict(zip((d.path for d in grids), combo)) for combo in itertools.product(*(d.values for d in grids))]


def validation_points(domains: list[Domain], seed: int = 0) -> Iterator[dict[str, Any]]:
    """Assignments that, once validated as full specs, cover every grid combination and the edges and
    a few random samples of every other domain, so a bad combination fails before any trial runs."""
    if not domains:
        return
    rng = random.Random(seed)
    axes = [d.test_points() for d in domains]
    total = math.prod(len(a) for a in axes)
    if total <= MAX_VALIDATED_POINTS:
        combos: Iterator[tuple[Any, ...]] = itertools.product(*axes)
    else:
        # Too many to check all: cover each value of each axis once, then fill with random combinations.
        width = max(len(a) for a in axes)
        covering = [tuple(a[i % len(a)] for a in axes) for i in range(width)]
        extra = [tuple(rng.choice(a) for a in axes) for _ in range(MAX_VALIDATED_POINTS - width)]
        combos = iter(covering + extra)
    paths = [d.path for d in domains]
    for combo in combos:
        yield dict(zip(paths, combo))
    if any(d.kind in _RANGE_KINDS for d in domains):
        for _ in range(RANDOM_VALIDATION_SAMPLES):
            yield {d.path: d.sample(rng) for d in domains}


def to_param_space(domains: list[Domain], search: str) -> dict[str, Any]:
    """Tune's `param_space`: a flat mapping from dotted path to Tune domain.

    With `search: grid` Tune's variant generator runs every grid combination (num_samples times);
    `random` and `optuna` draw from the grid values like a `choice` instead, because a searcher
    proposes points one at a time and Optuna rejects grid domains outright.
    """
    grid_as_choice = search != "grid"
    return {d.path: d.to_tune(grid_as_choice=grid_as_choice) for d in domains}
