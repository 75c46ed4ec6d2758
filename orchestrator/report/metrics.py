"""PRR / PEoP formulas and the grouping of runs into compared methods.

Pure functions over plain records, so the numbers of the report can be checked without an MLflow
store. The definitions follow the MHE paper (Xue & Aletras, "Multi-Head Embeddings", arXiv
2310.07911, §4.5-4.6): PRR measures how much of the reference method's (MHA's) score a method
keeps, PEoP how much score it gains per extra parameter over the lower reference (SHA).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from orchestrator.report.costs import cost_warnings, geometric_mean
from orchestrator.report.pareto import Mode

KIND_KEY = "model.attention.kind"
EMBEDDING_KEY = "model.embedding.kind"
ATTENTION_PREFIX = "model.attention."
# Model options that also define a method (Transformer-XL's positions and memory, reversible layers). Unlike
# the attention knobs they are logged for every run, so they only join the default grouping when runs differ
# in them: a study of attention kinds keeps its labels.
MODEL_METHOD_KEYS = ("model.positional", "model.memory.mem_len", "model.reversible")
PARAMS_ATTENTION = "params.attention"
PARAMS_TOTAL = "params.total"
TOKENS_PER_S = "train/tokens_per_s"
PEAK_MEMORY = "memory/peak_gb"
SEED_KEYS = ("optim.seed", "seed")
"""Where a run's seed is logged: the spec's `optim.seed` (set per trial by `tune.seeds`), else a plain `seed`."""

# Substrings of a metric name that say which way is better. Inverse hints are checked first so that
# e.g. "val/acc_loss" counts as a loss.
_INVERSE_HINTS = ("loss", "ppl", "perplexity", "bpb")  # bpb: bits per byte (task.kind: bytelm)
_DIRECT_HINTS = ("bleu", "chrf", "acc", "f1")
# What a flattened spec writes for an unset (Python None) field: "knob absent", not a knob value.
# Lower-case "none" stays a value: it is a real setting, e.g. Linformer `sharing: none`.
_MISSING_VALUES = frozenset({"", "None"})


class ReportError(ValueError):
    """A report cannot be built; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class RunRecord:
    """What the report needs of one MLflow run: params as logged and the latest metric values."""

    run_id: str
    params: Mapping[str, str]
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class MethodGroup:
    """The runs (seeds) of one method configuration, with the knobs that tell it apart."""

    label: str
    kind: str | None
    # Short knob name -> value, only knobs that vary between groups of the same kind.
    knobs: Mapping[str, str]
    runs: tuple[RunRecord, ...]


@dataclass(frozen=True)
class MethodRow:
    """One line of the comparison table: seed statistics plus PRR and PEoP of the seed mean."""

    label: str
    kind: str | None
    knobs: Mapping[str, str]
    run_ids: tuple[str, ...]
    n_runs: int
    score_mean: float
    score_std: float
    params_attention: float
    params_total: float
    prr: float
    peop: float
    tokens_per_s: float
    peak_memory_gb: float
    seeds: tuple[str | None, ...] = ()
    """Per run, in `run_ids` order: its seed (`seed_of`), None where no seed param was logged."""
    scores: tuple[float, ...] = ()
    """Per run: the compared score, the last logged value of the metric."""
    tokens: tuple[float, ...] = ()
    """Per run that logged it: the last train/tokens_per_s."""
    memory: tuple[float, ...] = ()
    """Per run that logged it: the last memory/peak_gb."""


@dataclass(frozen=True)
class Summary:
    """The table rows plus which groups served as references and what was noticed on the way."""

    rows: list[MethodRow]
    reference: str | None
    """None: no PRR reference (`--reference none`, or a sweep without mha), so no PRR, PEoP or tests."""
    lower_reference: str | None
    warnings: list[str] = field(default_factory=list)


def infer_mode(metric: str) -> Mode:
    """Direction of a metric from its name: losses and perplexities are minimised, scores maximised."""
    name = metric.lower()
    if any(hint in name for hint in _INVERSE_HINTS):
        return "min"
    if any(hint in name for hint in _DIRECT_HINTS):
        return "max"
    raise ReportError(
        f"cannot tell whether {metric!r} is better high or low; pass mode='max' or mode='min' "
        "(--mode on the command line)"
    )


def prr(score: float, score_ref: float, mode: Mode) -> float:
    """Performance Retention Ratio against the reference (MHA); 1.0 means as good as MHA.

    Direct metrics: score / score_ref. Inverse metrics (perplexity): 1 - (score - score_ref) / score_ref,
    so a perplexity 10% above MHA's gives 0.9, mirroring a score 10% below. NaN for a zero reference.
    """
    if score_ref == 0.0:
        return math.nan
    if mode == "max":
        return score / score_ref
    return 1.0 - (score - score_ref) / score_ref


def peop(score: float, score_low: float, params: float, params_low: float, mode: Mode) -> float:
    """Performance Elasticity of Parameters against the lower reference (SHA).

    Relative score gain divided by relative parameter growth, both with 1 subtracted as in the
    economic definition of elasticity (paper footnote 4); negated for inverse metrics so that a
    lower perplexity gives a positive elasticity. NaN where the denominator is 0 (same size as SHA).
    """
    if score_low == 0.0 or params_low == 0.0:
        return math.nan
    params_growth = params / params_low - 1.0
    if params_growth == 0.0 or math.isnan(params_growth):
        return math.nan
    elasticity = (score / score_low - 1.0) / params_growth
    return -elasticity if mode == "min" else elasticity


def param_value(params: Mapping[str, str], key: str) -> str | None:
    """A logged param, or None when it is absent or was logged as an unset value."""
    value = params.get(key)
    if value is None or value.strip() in _MISSING_VALUES:
        return None
    return value.strip()


def seed_of(run: RunRecord) -> str | None:
    """The run's seed: what pairs it with the run of another method that saw the same data order and init."""
    return next((value for key in SEED_KEYS if (value := param_value(run.params, key)) is not None), None)


def default_group_keys(runs: Sequence[RunRecord]) -> list[str]:
    """Params that define a method: the attention kind and knobs, the embedding kind, and the model options
    of MODEL_METHOD_KEYS that differ between the runs.

    `model.attention.d_model` follows the model size and dropout/seed values are training noise,
    so they would split one method into several rows.
    """
    names = {name for run in runs for name in run.params}
    knobs = sorted(
        (
            name
            for name in names
            if name.startswith(ATTENTION_PREFIX) and name != KIND_KEY and not _is_noise_param(name)
        ),
        key=_knob_order,
    )
    keys = [KIND_KEY, *knobs]
    if EMBEDDING_KEY in names:
        keys.append(EMBEDDING_KEY)
    keys += [key for key in MODEL_METHOD_KEYS if len({run.params.get(key) for run in runs}) > 1]
    return keys


def group_keys(records: Sequence[RunRecord], group_by: Sequence[str] | None) -> list[str]:
    """The params that define a method: `group_by` (--group-by) when given, else `default_group_keys`."""
    if not group_by:
        return default_group_keys(records)
    logged = sorted({name for record in records for name in record.params})
    unknown = [key for key in group_by if key not in logged]
    if unknown:
        model_params = [name for name in logged if name.startswith("model.")] or logged
        raise ReportError(
            f"--group-by names params no run logged: {unknown}; "
            f"logged model params: {', '.join(model_params)}"
        )
    return list(group_by)


def _knob_order(name: str) -> tuple[str, bool, str]:
    """Alphabetical, except that a nested block's `kind` leads its siblings.

    So a crossed method reads "mha mechanism.kind=linformer mechanism.k=64", not "... mechanism.k=64
    mechanism.kind=linformer".
    """
    parent, _, leaf = name.rpartition(".")
    return parent, leaf != "kind", leaf


def _is_noise_param(name: str) -> bool:
    leaf = name[len(ATTENTION_PREFIX) :]
    return leaf == "d_model" or leaf.startswith("dropout") or "seed" in leaf


def short_knob_name(key: str) -> str:
    """Name of a knob in labels: `model.attention.k` -> `k`, `model.embedding.kind` -> `embedding`."""
    if key == EMBEDDING_KEY:
        return "embedding"
    if key.startswith(ATTENTION_PREFIX):
        return key[len(ATTENTION_PREFIX) :]
    return key


def group_runs(runs: Sequence[RunRecord], keys: Sequence[str]) -> list[MethodGroup]:
    """Split runs into methods by the values of `keys`; seeds of one configuration share a group.

    A label shows the kind plus only the knobs that vary among runs of that kind, so a study with
    one Linformer setting reads "linformer", and a k sweep reads "linformer k=64", "linformer k=128".
    """
    kind_key = KIND_KEY if KIND_KEY in keys else None
    knob_keys = [key for key in keys if key != kind_key]
    by_values: dict[tuple[str | None, ...], list[RunRecord]] = {}
    for run in runs:
        values = tuple(param_value(run.params, key) for key in keys)
        by_values.setdefault(values, []).append(run)

    def kind_of(values: tuple[str | None, ...]) -> str | None:
        return values[keys.index(kind_key)] if kind_key else None

    # Which knobs take more than one value (absent counts as a value) within each kind.
    seen: dict[tuple[str | None, str], set[str | None]] = {}
    for values in by_values:
        for key in knob_keys:
            seen.setdefault((kind_of(values), key), set()).add(values[keys.index(key)])
    groups = []
    for values, members in by_values.items():
        kind = kind_of(values)
        knobs = {
            short_knob_name(key): value
            for key in knob_keys
            if len(seen[(kind, key)]) > 1 and (value := values[keys.index(key)]) is not None
        }
        parts = [kind] if kind is not None else []
        parts += [f"{name}={value}" for name, value in knobs.items()]
        label = " ".join(parts) if parts else "(no method params)"
        groups.append(MethodGroup(label=label, kind=kind, knobs=knobs, runs=tuple(members)))
    return sorted(groups, key=lambda group: _natural_key(group.label))


def groups_with_metric(records: Sequence[RunRecord], keys: Sequence[str], metric: str) -> list[MethodGroup]:
    """Group the runs that have the metric, after checking that no method lacks it entirely.

    A method whose runs all lack the metric usually means the runs logged different metrics (an
    MT run has val/bleu, an LM run val/ppl); silently dropping it would hide it from the table.
    """
    lacking = [
        group for group in group_runs(records, keys) if not any(metric in run.metrics for run in group.runs)
    ]
    if lacking:
        details = "; ".join(
            f"{group.label!r} has {sorted({m for r in group.runs for m in r.metrics}) or 'no metrics'}"
            for group in lacking
        )
        common = set.intersection(*(set(record.metrics) for record in records))
        raise ReportError(
            f"the runs logged different metrics: no run of {len(lacking)} method(s) has {metric!r} "
            f"({details}). "
            f"Metrics every run has: {', '.join(sorted(common)) or '(none)'}. Pick one with --metric, or "
            "restrict the report to one sweep with --parent-run."
        )
    return group_runs([record for record in records if metric in record.metrics], keys)


def _natural_key(label: str) -> list[tuple[int, float, str]]:
    """Sort "k=64" before "k=128": numbers compare as numbers, the rest as text."""
    parts = []
    for token in label.replace("=", " ").split():
        try:
            parts.append((0, float(token), ""))
        except ValueError:
            parts.append((1, 0.0, token))
    return parts


def find_reference(groups: Sequence[MethodGroup], name: str) -> MethodGroup | None:
    """The group a reference name points at.

    An exact label wins ("mha heads=12"). Otherwise the groups whose kind is `name` compete and the
    one with the fewest knobs in its label wins (plain "mha" over "mha mechanism=exact"); a tie is
    ambiguous and raises, naming the labels to choose from.
    """
    for group in groups:
        if group.label == name:
            return group
    candidates = [group for group in groups if group.kind == name]
    if not candidates:
        return None
    fewest = min(len(group.knobs) for group in candidates)
    best = [group for group in candidates if len(group.knobs) == fewest]
    if len(best) > 1:
        labels = ", ".join(repr(group.label) for group in best)
        raise ReportError(
            f"reference {name!r} is ambiguous: several {name} configurations qualify ({labels}); "
            "pick one by its full label, e.g. --reference " + repr(best[0].label)
        )
    return best[0]


def _mean_of(values: Sequence[float]) -> float:
    finite = [value for value in values if not math.isnan(value)]
    return float(np.mean(finite)) if finite else math.nan


def _logged(runs: Sequence[RunRecord], key: str) -> list[float]:
    return [run.metrics[key] for run in runs if key in run.metrics]


def _sample_std(values: Sequence[float]) -> float:
    """Seed std with ddof=1; NaN for one seed or a diverged (non-finite) one, where it means nothing."""
    if len(values) < 2 or not all(math.isfinite(value) for value in values):
        return math.nan
    return float(np.std(values, ddof=1))


def _numeric_param(runs: Sequence[RunRecord], key: str, label: str, warnings: list[str]) -> float:
    """A per-method param such as the parameter count: equal for all seeds, else their mean + warning."""
    values = []
    for run in runs:
        raw = param_value(run.params, key)
        if raw is None:
            continue
        try:
            values.append(float(raw))
        except ValueError:
            warnings.append(f"{label}: param {key}={raw!r} of run {run.run_id} is not a number")
    if len(set(values)) > 1:
        warnings.append(f"{label}: seeds logged different {key} values {sorted(set(values))}; using the mean")
    return _mean_of(values)


def summarize(
    groups: Sequence[MethodGroup],
    metric: str,
    mode: Mode,
    reference: str | None,
    lower_reference: str | None,
    *,
    missing_reference_ok: bool = False,
) -> Summary:
    """Aggregate seeds per group and compute PRR / PEoP of the seed means.

    PRR and PEoP use the seed-mean score, as the paper reports them "across five runs". The std is
    the sample std (ddof=1); with a single seed it is NaN and printed as "-". Without a reference (None, or not
    found with `missing_reference_ok`) PRR and PEoP are NaN: PEoP is read next to PRR, as in the paper.
    """
    if mode not in ("min", "max"):
        raise ReportError(f"mode must be 'min' or 'max', got {mode!r}")
    labels = ", ".join(repr(group.label) for group in groups)
    ref = find_reference(groups, reference) if reference is not None else None
    if ref is None and reference is not None and not missing_reference_ok:
        raise ReportError(
            f"reference method {reference!r} not found among the runs; methods found: {labels}. "
            "Pass --reference with one of them (PRR is measured against it), or --reference none for the table "
            "without PRR / PEoP."
        )
    warnings: list[str] = []
    low = find_reference(groups, lower_reference) if lower_reference and ref is not None else None
    if lower_reference and ref is not None and low is None:
        warnings.append(
            f"lower reference {lower_reference!r} not found (methods: {labels}); PEoP left blank. "
            "Pass --lower-reference with one of the methods to get PEoP."
        )

    scores = {group.label: [run.metrics[metric] for run in group.runs] for group in groups}
    for label, values in scores.items():
        diverged = sum(not math.isfinite(value) for value in values)
        if diverged:
            # Kept, not dropped: averaging only the surviving seeds would flatter an unstable method.
            warnings.append(f"{label}: {diverged} run(s) ended with a non-finite {metric} (diverged?)")
    means = {label: float(np.mean(values)) for label, values in scores.items()}
    params = {
        group.label: _numeric_param(group.runs, PARAMS_ATTENTION, group.label, warnings) for group in groups
    }
    if low is not None:
        missing = [label for label, value in params.items() if math.isnan(value)]
        if missing:
            raise ReportError(
                f"PEoP needs the logged param {PARAMS_ATTENTION!r} (attention parameters incl. the "
                f"output projection, no biases), but no run of {missing} has it. Log it from training, "
                "or pass --lower-reference none to report without PEoP."
            )

    if ref is not None and math.isfinite(means[ref.label]) and means[ref.label] <= 0.0:
        warnings.append(f"{ref.label}'s mean {metric} is {means[ref.label]:g}: PRR is a ratio to it, meaningful "
                        "only for a positive score")
    if low is not None:
        fewer = [label for label, value in params.items() if label != low.label and value < params[low.label]]
        if fewer:
            warnings.append(f"{', '.join(fewer)}: fewer attention parameters than the lower reference {low.label}, "
                            "so PEoP's sign reads reversed there (a worse score gives a positive PEoP)")
    rows = []
    for group in groups:
        label = group.label
        tokens, memory = _logged(group.runs, TOKENS_PER_S), _logged(group.runs, PEAK_MEMORY)
        warnings += cost_warnings(label, {TOKENS_PER_S: tokens, PEAK_MEMORY: memory})
        row_peop = math.nan
        if low is not None and label != low.label:
            row_peop = peop(means[label], means[low.label], params[label], params[low.label], mode)
        rows.append(
            MethodRow(
                label=label,
                kind=group.kind,
                knobs=group.knobs,
                run_ids=tuple(run.run_id for run in group.runs),
                n_runs=len(group.runs),
                score_mean=means[label],
                score_std=_sample_std(scores[label]),
                params_attention=params[label],
                params_total=_numeric_param(group.runs, PARAMS_TOTAL, label, warnings),
                prr=prr(means[label], means[ref.label], mode) if ref is not None else math.nan,
                peop=row_peop,
                tokens_per_s=geometric_mean(tokens),  # costs compare as ratios: orchestrator/report/costs.py
                peak_memory_gb=geometric_mean(memory),
                seeds=tuple(seed_of(run) for run in group.runs),
                scores=tuple(scores[label]),
                tokens=tuple(tokens),
                memory=tuple(memory),
            )
        )
    # Paper order: upper reference, lower reference, then the compared methods.
    first = [ref.label] if ref is not None else []
    first += [low.label] if low is not None and low.label not in first else []
    rows.sort(key=lambda row: (row.label not in first, first.index(row.label) if row.label in first else 0))
    return Summary(rows, ref.label if ref is not None else None, low.label if low is not None else None, warnings)
