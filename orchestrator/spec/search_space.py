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
import json
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.spec.messages import did_you_mean

DomainKind = Literal["grid", "choice", "uniform", "loguniform", "randint"]
DOMAIN_KINDS: tuple[str, ...] = ("grid", "choice", "uniform", "loguniform", "randint")
_RANGE_KINDS = ("uniform", "loguniform", "randint")

MAX_TRIALS = 10_000
"""Trials one sweep may ask Tune for (grid combinations x num_samples, or num_samples draws). Tune holds every trial
of a grid in the launcher's memory before the first one starts (10^6 took minutes and 1.7 GB, deaf to Ctrl-C),
and validation checks every grid combination, about a millisecond each: 10,000 take seconds."""
MAX_VALIDATED_POINTS = MAX_TRIALS
"""Combinations of every domain's test points (grid and choice values, range ends) validated exhaustively. Past
this, a grid search still validates every grid combination (each with some test value of every sampled domain),
a random or optuna search every test value at least once; a few random draws are added either way."""
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
    if kind == "grid" and (twice := repeated_value(args)) is not None:
        raise SearchSpaceError(f"{path}: {{grid: [...]}} lists {twice!r} more than once, and every grid value is a "
                               "trial: the repeats would train the same run again; list each value once (to repeat "
                               "runs over seeds, set tune.seeds: [0, 1, 2])")
    if kind in ("grid", "choice"):
        _nested_domain(path, kind, args)
        return Domain(path, kind, tuple(args))
    args = [_number(a) for a in args]
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise SearchSpaceError(f"{path}: {{{kind}: [lo, hi]}} needs exactly two numbers, got {args!r}")
    lo, hi = args
    if not all(math.isfinite(a) for a in args):
        raise SearchSpaceError(f"{path}: {{{kind}: [{lo}, {hi}]}} needs finite bounds (NaN and infinity are "
                               "refused, as in every spec number)")
    if not lo < hi:
        raise SearchSpaceError(f"{path}: {{{kind}: [{lo}, {hi}]}} needs lo < hi; swap or widen the range")
    if kind == "loguniform" and lo <= 0:
        raise SearchSpaceError(f"{path}: {{loguniform: [{lo}, {hi}]}} needs lo > 0; use uniform for ranges touching 0")
    if kind == "randint" and not (isinstance(lo, int) and isinstance(hi, int)):
        raise SearchSpaceError(f"{path}: {{randint: [{lo}, {hi}]}} needs integers; use uniform for floats")
    return Domain(path, kind, (lo, hi))


def _nested_domain(path: str, kind: str, values: list[Any]) -> None:
    """Refuse a grid or choice value holding a domain of its own (`{grid: [{kind: linformer, k: {grid: [16, 32]}}]}`).
    Each value is substituted whole into a trial, so the inner domain reached the trial's check unresolved, which
    answered "run it with `orchestrator sweep`" to a sweep; the fix is one value per combination, said here."""
    for value in values:
        inner = find_domains(value) if isinstance(value, Mapping) else []
        if inner:
            first = inner[0]
            relative = first.path
            example = ""
            if first.kind in ("grid", "choice"):
                example = " (here " + " and ".join(_flow(set_path(value, relative, v)) for v in first.values[:2]) + ")"
            raise SearchSpaceError(
                f"{path}: a {{{kind}: [...]}} value holds a search domain of its own, at {path}.{relative}, and "
                f"domains do not nest; list one {kind} value per combination instead{example}")


def _flow(value: Any) -> str:
    """A value as the spec would write it inline: {kind: linformer, k: 16}."""
    import yaml  # only on this error path

    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=math.inf).strip()


def repeated_value(values: list[Any]) -> Any:
    """The first value of `values` that an earlier one equals (mappings and lists compared by content), or None."""
    seen = set()
    for value in values:
        key = json.dumps(value, sort_keys=True, default=repr)
        if key in seen:
            return value
        seen.add(key)
    return None


def is_domain(node: Any) -> bool:
    """A search domain (`{grid: [...]}`): a mapping with one key, a domain kind."""
    return isinstance(node, Mapping) and len(node) == 1 and next(iter(node)) in DOMAIN_KINDS


def _misspelt_domain(path: str, node: Any) -> None:
    """Refuse a one-key mapping of a list whose key is close to a domain kind ({gird: [2, 4]}), which would
    otherwise reach the field as a mapping and be refused for its type without a word about the domain."""
    if isinstance(node, Mapping) and len(node) == 1 and not is_domain(node):
        (key, args), = node.items()
        # 0.75: a typo of a kind (gird, choise, unifrom, randit) is that close, and no field of the spec is
        # (at 0.6 `train`, `compile` and `init_from` were: a one-key mapping of a list under them is not a domain).
        hint = did_you_mean(str(key), DOMAIN_KINDS, cutoff=0.75) if isinstance(args, list) else ""
        if hint:
            raise SearchSpaceError(f"{path}: {key!r} is not a search domain kind; {hint}domain kinds: "
                                   f"{', '.join(DOMAIN_KINDS)}, e.g. {{grid: {args!r}}}")


def raw_holds(node: Any, found: Callable[[Mapping[str, Any]], bool]) -> bool:
    """Whether a raw spec (grid and choice values included) holds a mapping for which `found` is true: a cheap
    test of whether a study needs a check that walks every trial (validate_checks.py, vocabulary.py)."""
    if isinstance(node, Mapping):
        return found(node) or any(raw_holds(value, found) for value in node.values())
    return isinstance(node, list) and any(raw_holds(item, found) for item in node)


def find_domains(raw: Mapping[str, Any], prefix: str = "") -> list[Domain]:
    """Every search domain in a raw spec, in document order."""
    found: list[Domain] = []
    for key, node in raw.items():
        path = f"{prefix}{key}"
        _misspelt_domain(path, node)
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
    _set_in_place(out, path, value)
    return out


def _set_in_place(node: dict[str, Any], path: str, value: Any) -> None:
    keys = path.split(".")
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise SearchSpaceError(f"{'.'.join(keys[: i + 1])} is a value ({child!r}), so {path} cannot be set")
        node = child
    node[keys[-1]] = value


def resolve(raw: Mapping[str, Any], assignment: Mapping[str, Any]) -> dict[str, Any]:
    """The raw spec with each domain path replaced by its assigned value (one copy of the spec, not one per
    path: validation resolves every grid combination)."""
    out = copy.deepcopy(dict(raw))
    for path, value in assignment.items():
        _set_in_place(out, path, value)
    return out


def grid_size(domains: list[Domain]) -> int:
    """Grid combinations, counted without making them."""
    return math.prod(len(d.values) for d in domains if d.is_grid)


def iter_grid_points(domains: list[Domain]) -> Iterator[dict[str, Any]]:
    """The grid combinations Tune will run (one sample each), one at a time and in the sweep's order, so that the
    i-th is the trial whose id ends in `_<i:05d>`: Tune's variant generator sorts the grid paths and varies the
    first fastest (ray/tune/search/variant_generator.py `_grid_search_generator`), where a plain product over the
    spec's order varied the last (tune.seeds, appended last, numbered seed 1 of a point as the next grid point).
    Each point keeps the spec's order of paths, as `validate` prints them."""
    grids = [d for d in domains if d.is_grid]
    slowest_first = sorted(grids, key=lambda d: d.path, reverse=True)
    for combo in itertools.product(*(d.values for d in slowest_first)):
        chosen = dict(zip((d.path for d in slowest_first), combo))
        yield {d.path: chosen[d.path] for d in grids}


def grid_lines(domains: list[Domain], num_samples: int, shown: int) -> Iterator[str]:
    """`grid <i>: path=value, ...` for the first `shown` grid combinations, numbered as the sweep's trials are
    (iter_grid_points), then a count of the rest; Tune runs the whole grid once per sample, one sample after
    another, so with num_samples > 1 a line says which trials repeat a point."""
    points = iter_grid_points(domains)  # one at a time: a grid may hold MAX_TRIALS points
    for i, point in enumerate(points):
        if i == shown:
            yield f"  ... {sum(1 for _ in points) + 1:,} more grid points"
            break
        yield f"  grid {i}: " + (", ".join(f"{k}={v}" for k, v in point.items()) or "(no grid domains)")
    if num_samples > 1:
        size = grid_size(domains)
        trials = (f"i and i+{size:,}" if num_samples == 2 else f"i, i+{size:,}, ..., i+{size * (num_samples - 1):,}")
        yield f"  each grid point runs tune.num_samples={num_samples} times: grid i is trials {trials}"


def grid_points(domains: list[Domain]) -> list[dict[str, Any]]:
    """Every grid combination as a list (bounded by MAX_TRIALS once a study is validated)."""
    return list(iter_grid_points(domains))


@dataclass(frozen=True)
class ValidationPlan:
    """The assignments validation checks, counted up front (for progress lines) and made one at a time, never
    all at once: a study's grid may hold MAX_TRIALS combinations, and what it is refused for, many more."""

    domains: list[Domain]
    search: str
    seed: int = 0

    @property
    def exhaustive(self) -> bool:
        """Every combination of every domain's test points is checked."""
        return math.prod(len(d.test_points()) for d in self.domains) <= MAX_VALIDATED_POINTS

    def _rows(self) -> int:
        """Assignments before the random draws."""
        lengths = [len(d.test_points()) for d in self.domains]
        if self.exhaustive:
            return math.prod(lengths)
        if self.search == "grid":
            return max(grid_size(self.domains), *lengths)
        return max(lengths)

    def describe(self) -> str:
        """What validation checked, in a line for `orchestrator validate`."""
        draws = f", and {self._draws()} random draws" if self._draws() else ""
        if self.exhaustive:
            what = f"all {self._rows():,} combinations of the grid and choice values and range ends"
        elif self.search == "grid":
            what = (f"all {grid_size(self.domains):,} grid combinations, each choice value and range end in "
                    f"at least one of them")
        else:
            what = "each grid and choice value and range end at least once (their product is too large)"
        return f"validated: {what}{draws}"

    def _draws(self) -> int:
        return RANDOM_VALIDATION_SAMPLES if any(d.kind in _RANGE_KINDS for d in self.domains) else 0

    def __len__(self) -> int:
        return self._rows() + self._draws() if self.domains else 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.domains:
            return
        axes = [d.test_points() for d in self.domains]
        paths = [d.path for d in self.domains]
        if self.exhaustive:
            combos: Iterator[tuple[Any, ...]] = itertools.product(*axes)
        elif self.search == "grid":
            combos = self._grids_with_sampled_values(axes)
        else:
            # Grids are drawn like choices: each test value of every domain once, in covering rows.
            combos = (tuple(a[row % len(a)] for a in axes) for row in range(self._rows()))
        for combo in combos:
            yield dict(zip(paths, combo))
        rng = random.Random(self.seed)
        for _ in range(self._draws()):
            yield {d.path: d.sample(rng) for d in self.domains}

    def _grids_with_sampled_values(self, axes: list[list[Any]]) -> Iterator[tuple[Any, ...]]:
        """Every grid combination (the trials Tune runs) with the sampled domains' test values taken in turn, so
        each appears at least once (the grid starts over while a sampled domain has values left)."""
        grid_axes = [i for i, d in enumerate(self.domains) if d.is_grid]
        # product() again at each pass, not cycle(): cycle keeps every combination it has made.
        passes = itertools.chain.from_iterable(itertools.product(*(axes[i] for i in grid_axes))
                                               for _ in itertools.count())
        for row, grid_combo in zip(range(self._rows()), passes):
            by_axis = dict(zip(grid_axes, grid_combo))
            yield tuple(by_axis[i] if i in by_axis else axis[row % len(axis)] for i, axis in enumerate(axes))


def validation_points(domains: list[Domain], seed: int = 0, search: str = "grid") -> Iterator[dict[str, Any]]:
    """Assignments that, once validated as full specs, cover every grid combination, every choice value, the
    edges and a few random samples of every range, so a bad combination fails before any trial runs
    (see ValidationPlan for what is checked when the product of every domain's test points is too large)."""
    return iter(ValidationPlan(list(domains), search, seed))


def to_param_space(domains: list[Domain], search: str) -> dict[str, Any]:
    """Tune's `param_space`: a flat mapping from dotted path to Tune domain.

    With `search: grid` Tune's variant generator runs every grid combination (num_samples times);
    `random` and `optuna` draw from the grid values like a `choice` instead, because a searcher
    proposes points one at a time and Optuna rejects grid domains outright.
    """
    grid_as_choice = search != "grid"
    return {d.path: d.to_tune(grid_as_choice=grid_as_choice) for d in domains}
