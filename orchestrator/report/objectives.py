"""Several objectives (`tune.metric: [val/acc, params.attention]`): each run's value of every objective and
which runs no other run beats on all of them (the non-dominated trials a multi-objective search is after).

An objective is a metric (its last logged value) or, for sizes such as `params.attention`, a numeric param the
run logged. The first objective is the one the table compares; the others are costs or second scores.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from orchestrator.report.metrics import Mode, ReportError, RunRecord, infer_mode, param_value, seed_of
from orchestrator.report.pareto import Objective, non_dominated

OBJECTIVES_FILE = "objectives.csv"


def as_list(value: str | None) -> list[str] | None:
    """A logged `tune.metric` / `tune.mode` param: one name, or a list of them (logged as its Python repr)."""
    if value is None:
        return None
    text = value.strip()
    if text.startswith("["):
        try:
            parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return [text]
        return [str(item) for item in parsed]
    return [part.strip() for part in text.split(",") if part.strip()]


def objective_value(run: RunRecord, name: str) -> float:
    if name in run.metrics:
        return float(run.metrics[name])
    raw = param_value(run.params, name)
    try:
        return float(raw) if raw is not None else math.nan
    except ValueError:
        return math.nan


def check_objectives(runs: Sequence[RunRecord], names: Sequence[str], modes: Sequence[str | None]) -> list[Mode]:
    """The direction of each objective; a ReportError for one no run logs (as a metric or a numeric param)
    or for a mode list of another length."""
    if len(modes) != len(names):
        raise ReportError(f"{len(names)} objectives ({', '.join(names)}) but {len(modes)} modes; give one mode "
                          "per objective, e.g. --mode max,min")
    for name in names:
        if not any(math.isfinite(objective_value(run, name)) for run in runs):
            metrics = sorted({m for run in runs for m in run.metrics})
            raise ReportError(f"objective {name!r}: no run logs it as a metric or a numeric param; metrics that "
                              f"exist: {', '.join(metrics) or '(none)'}. Fix tune.metric (or --metric).")
    out: list[Mode] = []
    for name, mode in zip(names, modes):
        if mode is None:
            mode = "min" if name.startswith(("params.", "memory/")) else infer_mode(name)
        if mode not in ("min", "max"):
            raise ReportError(f"mode {mode!r} of objective {name!r} must be 'min' or 'max'")
        out.append(mode)  # type: ignore[arg-type]
    return out


@dataclass(frozen=True)
class TrialObjectives:
    table: pd.DataFrame
    """Per run: run_id, method, seed, one column per objective, non_dominated."""
    names: tuple[str, ...]
    modes: tuple[Mode, ...]


def trial_objectives(runs: Sequence[RunRecord], labels: dict[str, str], names: Sequence[str],
                     modes: Sequence[Mode]) -> TrialObjectives:
    """Every run's objectives and whether it is non-dominated among the runs (NaN values never are)."""
    values = {name: [objective_value(run, name) for run in runs] for name in names}
    front = non_dominated([Objective(name, mode, values[name]) for name, mode in zip(names, modes)])
    table = pd.DataFrame({"run_id": [run.run_id for run in runs],
                          "method": [labels.get(run.run_id, "") for run in runs],
                          "seed": [seed_of(run) for run in runs], **values, "non_dominated": front})
    return TrialObjectives(table, tuple(names), tuple(modes))


def write_objectives(found: TrialObjectives, out_dir: Path) -> Path:
    path = out_dir / OBJECTIVES_FILE
    found.table.to_csv(path, index=False)
    return path


def objectives_markdown(found: TrialObjectives) -> str:
    arrows = [f"`{name}` {'↓' if mode == 'min' else '↑'}" for name, mode in zip(found.names, found.modes)]
    kept = found.table[found.table["non_dominated"]]
    lines = [f"Objectives: {', '.join(arrows)}. Non-dominated runs ({len(kept)} of {len(found.table)}: no other "
             "run is as good on every objective and better on one):", "",
             "| run | method | seed | " + " | ".join(found.names) + " |", "|" + "---|" * (3 + len(found.names))]
    for _, row in kept.iterrows():
        cells = [str(row["run_id"])[:8], str(row["method"]), str(row["seed"])]
        cells += [format(row[name], ".4g") for name in found.names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
