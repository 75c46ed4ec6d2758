"""Reading a spec: YAML files with their `base:` chain, named scales, dotted overrides (also those a resume may
make), validation into an `ExperimentSpec` with every bad field named, and a study's trials."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.spec.merge import merge_base
from orchestrator.spec.messages import booleans_as_numbers, describe_errors
from orchestrator.spec.models import ExperimentSpec, SpecError
from orchestrator.spec.search_space import (
    MAX_TRIALS,
    Domain,
    SearchSpaceError,
    ValidationPlan,
    find_domains,
    grid_size,
    is_domain,
    repeated_value,
    resolve,
    set_path,
)

MAX_SPEC_VALUES = 100_000
"""Values a spec file may expand to, an alias counted again at every use. Real specs have a few hundred; a few
hundred bytes of nested aliases (a "billion laughs") expand to billions, which merging and validation walk."""


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Values under `node` once every alias is expanded; each node is counted once (memo), so this is linear in
    the file even when its expansion is not."""
    if id(node) not in memo:
        memo[id(node)] = 1  # a node reached again while counting it (a recursive alias) counts once
        children = ([part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        memo[id(node)] = 1 + sum(_expanded_size(child, memo) for child in children)
    return memo[id(node)]


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a document whose aliases expand past MAX_SPEC_VALUES values, and a mapping that
    gives one key twice (YAML keeps the last silently: a block pasted in below would undo a field set above it)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: later keys override the merged ones
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found the key {key!r} twice; keep one (YAML would silently use the last)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_document(self, node: yaml.Node) -> Any:
        if (size := _expanded_size(node, {})) > MAX_SPEC_VALUES:
            raise yaml.YAMLError(f"its aliases expand to {size:,} values, more than {MAX_SPEC_VALUES:,}; a spec "
                                 "needs a few hundred (write the repeated blocks out, or use base:)")
        return super().construct_document(node)


def bounded_yaml(text: str) -> Any:
    """YAML parsed safely (no tags that build objects) and with its alias expansion bounded: for every YAML read
    from a file or from storage (a checkpoint's spec.yaml), which a careless or hostile hand may have written."""
    return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader, with a bound on aliases


def _read_mapping(path: Path, missing: str) -> dict[str, Any]:
    if not path.is_file():
        raise SpecError(missing)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                        "save the spec as UTF-8") from None
    try:
        data = bounded_yaml(text)
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from err
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply to be a spec") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a spec is a mapping with name/task/model/... keys, got {type(data).__name__}")
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a spec file, with its `base:` chain merged in (see `merge_base`); a clear error for a
    missing file, a non-mapping document, a missing base file or a cycle of bases."""
    path = Path(path)
    return _read_with_bases(
        path, f"spec file {str(path)!r} not found; pass the path of a YAML spec such as configs/smoke.yaml", ())


def _read_with_bases(path: Path, missing: str, chain: tuple[Path, ...]) -> dict[str, Any]:
    raw = _read_mapping(path, missing)
    if "base" not in raw:
        return raw
    base_name = raw.pop("base")
    if not isinstance(base_name, str) or not base_name:
        raise SpecError(f"{path}: base must be the path of another spec file (relative to this one), "
                        f"e.g. base: mhe.yaml; got {base_name!r}")
    if "name" not in raw:
        raise SpecError(f"{path}: name is required in a spec with base: {base_name} (a base's name is never "
                        "inherited: it names the storage folder and the MLflow experiment); add e.g. "
                        f"name: {path.stem.replace('_', '-')}")
    base_path = (path.parent / base_name).resolve()
    seen = (*chain, path.resolve())
    if base_path in seen:
        cycle = " -> ".join(str(p) for p in (*seen[seen.index(base_path):], base_path))
        raise SpecError(f"{path}: base: {base_name} makes a cycle of bases ({cycle}); remove one of these "
                        "base: fields")
    missing = (f"{path}: base: {base_name} not found (looked for {base_path}; a base path is relative to the "
               "file that names it)")
    return merge_base(_read_with_bases(base_path, missing, seen), raw)


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Dotted `key.path=value` overrides; values are parsed as YAML (`k=64`, `sharing=kv`, `lr={grid: [1, 2]}`)."""
    out = dict(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z0-9_.]+", key):
            raise SpecError(f"override {item!r} is not key.path=value; e.g. model.attention.k=64")
        try:
            parsed = bounded_yaml(value) if value else ""
        except yaml.YAMLError as err:
            raise SpecError(f"override {item!r}: value is not valid YAML: {err}") from err
        out = _assign(out, key, parsed, f"override {item!r}")
    return out


def _assign(raw: Mapping[str, Any], key: str, value: Any, label: str) -> dict[str, Any]:
    _refuse_path_through_domain(raw, key, label)
    try:
        return set_path(raw, key, value)
    except SearchSpaceError as err:
        raise SpecError(f"{label}: {err}") from err


RESUME_OVERRIDES = ("optim.max_steps", "run.max_failures", "run.checkpoint_every", "run.eval_every", "run.log_every",
                    "run.keep_checkpoints", "run.workers", "run.cpus_per_worker", "run.gpus_per_worker",
                    "run.final_eval", "task.prepared_path", "task.prepare_workers", "tracking.")
"""What `orchestrator resume NAME key=value` may change: how long and where a run goes on, where it logs, and
where its prepared corpus lies (the same ids, moved: a new cluster's shared folder).
Everything else (model, task, data order, optimizer) shaped the checkpoints it continues from."""


def apply_resume_overrides(raw: Mapping[str, Any], overrides: Sequence[str], *, kind: str) -> dict[str, Any]:
    """The stored spec (`kind` run) or study (`kind` sweep) with the overrides a resume may make."""
    for item in overrides:
        key = item.partition("=")[0]
        if not any(key == allowed or (allowed.endswith(".") and key.startswith(allowed)) for allowed in RESUME_OVERRIDES):
            raise SpecError(f"resume override {item!r}: {key} cannot change on resume (its checkpoints were trained "
                            f"with the stored value); resume may change {', '.join(RESUME_OVERRIDES)}*. To change "
                            "anything else, start a new run from a checkpoint with model.init_from")
        if kind == "sweep" and key == "optim.max_steps":
            raise SpecError("resume override optim.max_steps: a sweep resumes only its unfinished trials (its finished "
                            "ones and ASHA's rungs stay as they were); train a chosen trial further with "
                            "`orchestrator train SPEC model.init_from=<its MLflow run id>` or start a longer sweep")
    return apply_overrides(raw, overrides)


def apply_scale(raw: Mapping[str, Any], scale: str | None) -> dict[str, Any]:
    """Drop the spec's `scales:` block and, with `scale`, apply that named set of dotted overrides.

    A study keeps its full size in the body and smaller sizes as overrides (`scales: {tiny: {model.d_model: 64,
    ...}}`), so the CPU version cannot drift from the real one. A scale also renames the study to
    `<name>-<scale>` (unless it sets `name` itself): its runs get their own storage folder and MLflow experiment
    instead of mixing into the full study's.
    """
    out = dict(raw)
    scales = out.pop("scales", None) or {}
    if not isinstance(scales, Mapping) or not all(isinstance(v, Mapping) for v in scales.values()):
        raise SpecError("scales must map a scale name to dotted overrides, e.g. scales: {tiny: {model.d_model: 64}}")
    if scale is None:
        return out
    if scale not in scales:
        known = ", ".join(sorted(scales)) or "none"
        raise SpecError(f"--scale {scale}: this spec defines no such scale (its scales: {known}); "
                        "pick one of them or add it under scales:")
    for key, value in scales[scale].items():
        out = _assign(out, str(key), value, f"scales.{scale}.{key}")
    if "name" not in scales[scale] and isinstance(out.get("name"), str):
        out["name"] = f"{out['name']}-{scale}"
    return out


def _refuse_path_through_domain(raw: Mapping[str, Any], key: str, label: str) -> None:
    """`model.attention.kind=mha` on a spec whose model.attention is a grid would silently break the grid."""
    node: Any = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        node = node.get(part) if isinstance(node, Mapping) else None
        if is_domain(node):
            prefix = ".".join(parts[: i + 1])
            raise SpecError(
                f"{label}: {prefix} is a search domain ({{{next(iter(node))}: ...}}); override it whole, "
                f"e.g. {prefix}=<value> or {prefix}={{grid: [...]}}"
            )


def validate_spec(raw: Mapping[str, Any], *, where: str = "spec") -> ExperimentSpec:
    """A resolved spec (no search domains) as an ExperimentSpec, or a SpecError naming every bad field."""
    try:
        domains = find_domains(raw)
    except SearchSpaceError as err:
        raise SpecError(f"{where}: {err}") from err
    if domains:
        paths = ", ".join(d.path for d in domains)
        raise SpecError(
            f"{where} has search domains ({paths}); run it with `orchestrator sweep`, or pin them with "
            f"overrides such as {domains[0].path}=<value>"
        )
    if booleans := booleans_as_numbers(raw, [ExperimentSpec]):
        raise SpecError(f"{where} is invalid:\n" + "\n".join(booleans))
    try:
        return ExperimentSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(f"{where} is invalid:\n{describe_errors(err, raw, ExperimentSpec)}") from None
    except ValueError as err:  # raised outside pydantic's wrapping, e.g. by a task compatibility check
        raise SpecError(f"{where} is invalid:\n  {err}") from None


@dataclass(frozen=True)
class Study:
    """A spec with its search domains: what `validate` prints and `sweep` launches."""

    raw: dict[str, Any]
    """The spec as written (plus overrides), domains included; stored with a sweep to resume it."""
    domains: list[Domain]
    base: ExperimentSpec
    """The first validated trial; the settings no domain touches (run, tune, tracking) come from it."""

    def spec_for(self, assignment: Mapping[str, Any]) -> ExperimentSpec:
        """The full spec of one trial."""
        return validate_spec(resolve(self.raw, assignment), where=_trial_label(assignment))


def _trial_label(assignment: Mapping[str, Any]) -> str:
    if not assignment:
        return "spec"
    return "trial {" + ", ".join(f"{k}={v!r}" for k, v in assignment.items()) + "}"


def expected_trials(study: Study) -> int:
    """Trials the sweep runs: every grid combination num_samples times, or num_samples draws."""
    return _trials(study.domains, study.base)


def _trials(domains: Sequence[Domain], base: ExperimentSpec) -> int:
    per_sample = grid_size(list(domains)) if base.tune.search == "grid" else 1
    return per_sample * base.tune.num_samples


PROGRESS_EVERY_S = 3.0
"""Seconds between two progress lines of a long validation (a study near MAX_TRIALS takes several)."""


def study_from_raw(raw: Mapping[str, Any], *, progress: Callable[[str], None] | None = None) -> Study:
    """Validate a (possibly searched) spec: every grid combination, every choice value, range edges and a few
    random draws (ValidationPlan), after refusing a study of more than MAX_TRIALS trials. `progress` gets a
    line every PROGRESS_EVERY_S seconds of a long validation (the CLI prints them)."""
    raw = dict(raw)
    try:
        domains = find_domains(raw)
    except SearchSpaceError as err:
        raise SpecError(f"spec: {err}") from err
    for path in ("name", "tune", "run", "tracking", "pretrain.run"):
        if any(d.path == path or d.path.startswith(path + ".") or _sets_run_of_stage(d, path) for d in domains):
            raise SpecError(
                f"{path} cannot be searched: it configures the sweep itself; give it one value "
                f"(search over task, model and optim fields)"
            )
    domains += seed_domains(raw, domains)
    if not domains:
        return Study(raw=raw, domains=domains, base=validate_spec(raw))
    # The first point (every domain's first test value, where every plan starts) gives tune.search and
    # num_samples (tune cannot be searched), which size the study before anything else is made.
    first = {d.path: d.test_points()[0] for d in domains}
    base = validate_spec(resolve(raw, first), where=_trial_label(first))
    _refuse_too_many_trials(domains, base)
    plan = ValidationPlan(domains, search=base.tune.search)
    started = last = time.monotonic()
    for done, assignment in enumerate(itertools.islice(plan, 1, None), start=2):
        validate_spec(resolve(raw, assignment), where=_trial_label(assignment))
        if progress is not None and time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            progress(f"[{base.name}] validating: {done:,} of {len(plan):,} trial specs checked "
                     f"({last - started:.0f} s; Ctrl-C stops)")
    return Study(raw=raw, domains=domains, base=base)


def _sets_run_of_stage(domain: Domain, path: str) -> bool:
    """A domain over a whole `pretrain:` stage one of whose values sets its `run:`. A stage's run settings are
    checked against the cluster once, before the sweep, as the spec's own are (orchestrator/launch/run.py
    check_cluster), so no trial may choose its own."""
    stage, _, field = path.rpartition(".")
    return bool(stage) and domain.path == stage and any(isinstance(v, Mapping) and field in v for v in domain.values)


def _refuse_too_many_trials(domains: Sequence[Domain], base: ExperimentSpec) -> None:
    trials = _trials(domains, base)
    if trials <= MAX_TRIALS:
        return
    tune = base.tune
    if tune.search != "grid":
        raise SpecError(f"tune.num_samples={tune.num_samples:,} asks for more than {MAX_TRIALS:,} trials; lower "
                        "tune.num_samples (a sweep that large is several sweeps)")
    grids = sorted((d for d in domains if d.is_grid), key=lambda d: -len(d.values))
    fields = ", ".join(f"{d.path} ({len(d.values):,} values)" for d in grids)
    samples = f" x tune.num_samples={tune.num_samples:,}" if tune.num_samples > 1 else ""
    raise SpecError(f"the grid over {fields} makes {grid_size(list(domains)):,} combinations{samples} = {trials:,} "
                    f"trials, more than the {MAX_TRIALS:,} a sweep may run; give those fields fewer values, or "
                    "sample the space: tune.search: random (grids are then drawn like choice) with "
                    "tune.num_samples: <trials to run>")


SEED_PATH = "optim.seed"


def seed_domains(raw: Mapping[str, Any], domains: Sequence[Domain]) -> list[Domain]:
    """`tune.seeds: [0, 1, 2]` as the grid domain it runs: every other grid point once per seed, at optim.seed (the
    trial driver sets it from its config like any swept value). Stated once, in tune, so the report knows which
    runs are the same point under another seed."""
    tune = raw.get("tune")
    seeds = tune.get("seeds") if isinstance(tune, Mapping) else None
    if seeds is None:
        return []
    if any(d.path == SEED_PATH for d in domains):
        raise SpecError(f"{SEED_PATH} is searched and tune.seeds is set: state the seeds once, in tune.seeds, and give "
                        f"{SEED_PATH} no search domain")
    if isinstance(seeds, list) and (booleans := booleans_as_numbers({"tune": {"seeds": seeds}}, [ExperimentSpec])):
        raise SpecError("tune.seeds is invalid:\n" + "\n".join(booleans))  # YAML's true, read as seed 1
    if not isinstance(seeds, list) or not seeds or not all(isinstance(seed, int) for seed in seeds):
        raise SpecError(f"tune.seeds={seeds!r} must be a list of integer seeds, e.g. [0, 1, 2]")
    if (twice := repeated_value(seeds)) is not None:
        raise SpecError(f"tune.seeds={seeds!r} lists seed {twice} more than once: a repeated seed trains the same run "
                        "again; list each seed once")
    return [Domain(SEED_PATH, "grid", tuple(seeds))]


def load_study(path: str | Path, overrides: Sequence[str] = (), scale: str | None = None, *,
               progress: Callable[[str], None] | None = None) -> Study:
    """Read a spec file, apply its `scale` and the CLI overrides, and validate every trial it describes."""
    return study_from_raw(apply_overrides(apply_scale(read_yaml(path), scale), overrides), progress=progress)


def load_spec(path: str | Path, overrides: Sequence[str] = (), scale: str | None = None) -> ExperimentSpec:
    """Read and validate a single-run spec (no search domains)."""
    return validate_spec(apply_overrides(apply_scale(read_yaml(path), scale), overrides), where=str(path))
