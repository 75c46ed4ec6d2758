"""Which knobs matter: hyperparameter importance over a sweep's runs (Optuna's fANOVA evaluator) and a
parallel-coordinates plot (Optuna's matplotlib one), both from an in-memory Optuna study built from the runs.

A knob is a logged param that takes more than one value among the compared runs, other than the seed (noise,
not a choice), the sizes training derives (`params.*`, `flops_per_token`), where a run was stored or logged, and
what restates the method (`method_knobs`). Each run is one trial of the study, its score the objective value;
fANOVA (Hutter et al., 2014, "An Efficient Approach for Assessing Hyperparameter Importance") fits a random forest
to score ~ knobs and splits the forest's variance over the knobs, so the importances sum to 1 and the seed-to-seed
noise is what no knob explains. That split needs repeated configurations (MIN_RUNS_PER_CONFIGURATION) or many
drawn ones (MIN_RUNS_DRAWN).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from orchestrator.report.metrics import KIND_KEY, SEED_KEYS, Mode, RunRecord, param_value, short_knob_name

IMPORTANCE_FILE = "importance.csv"
PARALLEL_FILE = "parallel_coordinates.png"
_NOT_KNOBS = ("params.", "tracking.", "run.", "sweep.", "tune.")
# Sizes training derives from the spec and logs next to it (launch/worker.py): they follow the knobs, they are not any.
_DERIVED = ("flops_per_token",)
# Where a run's method is logged: its attention kind, or the mechanism a patching experiment swaps in (report_patching).
_METHOD_KEYS = (KIND_KEY, "task.patch.attention.kind")
MIN_RUNS_PER_CONFIGURATION = 2
"""fANOVA is computed when the runs number at least this many times the configurations of the knobs they ran: with
one run each, every difference between configurations is also seed noise, and the forest splits it among the knobs
all the same."""
MIN_RUNS_DRAWN = 20
"""...or when there are at least this many runs: a random or Optuna search draws a new configuration for every
run, and there the forest learns the noise from neighbouring points, as fANOVA is meant to be used."""


def knobs(runs: Sequence[RunRecord]) -> list[str]:
    """The params that vary among `runs`, seeds and derived or machine-specific params left out."""
    names = sorted({name for run in runs for name in run.params})
    return [name for name in names
            if name not in SEED_KEYS and name not in _DERIVED and not name.startswith(_NOT_KNOBS) and name != "name"
            and len({param_value(run.params, name) for run in runs}) > 1]


def method_knobs(runs: Sequence[RunRecord], names: Sequence[str]) -> tuple[list[RunRecord], list[str]]:
    """`names` less the params that restate the method, and `runs` with those folded into the method's value.

    A param that takes one value within each method (MHE's `init_std`, absent elsewhere) says which method ran and
    nothing more, so fANOVA would split the method's effect between the two at random: it is dropped. A param only
    one method has that varies within it (MHE's `mode` in a study of `mhe mode=add`, `mhe mode=mul` and `sha`) is part
    of that method, as in the report's labels: the method takes the values `mhe mode=add` and `mhe mode=mul`.
    """
    key = next((key for key in _METHOD_KEYS if key in names), None)
    if key is None:
        return list(runs), list(names)
    method = {run.run_id: param_value(run.params, key) for run in runs}
    kept, nested = [], []
    for name in names:
        per_method: dict[str | None, set[str | None]] = {}
        for run in runs:
            per_method.setdefault(method[run.run_id], set()).add(param_value(run.params, name))
        if name != key and all(len(values) == 1 for values in per_method.values()):
            continue  # restates the method
        if name != key and sum(values != {None} for values in per_method.values()) == 1:
            nested.append(name)
        else:
            kept.append(name)
    folded = []
    for run in runs:
        parts = [method[run.run_id] or "None"] + [f"{short_knob_name(name)}={value}" for name in nested
                                                   if (value := param_value(run.params, name)) is not None]
        folded.append(RunRecord(run.run_id, {**run.params, key: " ".join(parts)}, run.metrics))
    return folded, kept


def _distribution(values: Sequence[str | None]):
    """An Optuna distribution covering `values`: int or float range when all are numbers, else categorical."""
    import optuna

    numbers = []
    for value in values:
        try:
            numbers.append(float(value))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            choices = sorted({str(v) for v in values})
            return optuna.distributions.CategoricalDistribution(choices), str
    if all(n.is_integer() for n in numbers):
        return optuna.distributions.IntDistribution(int(min(numbers)), int(max(numbers))), lambda v: int(float(v))
    return optuna.distributions.FloatDistribution(min(numbers), max(numbers)), float


def study_of(runs: Sequence[RunRecord], metric: str, mode: Mode, names: Sequence[str]):
    """An Optuna study holding one finished trial per run with a finite score, its params the run's knobs."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize" if mode == "min" else "maximize")
    scored = [run for run in runs if math.isfinite(run.metrics.get(metric, math.nan))]
    distributions = {name: _distribution([param_value(run.params, name) for run in scored]) for name in names}
    for run in scored:
        params = {name: cast(param_value(run.params, name) if param_value(run.params, name) is not None else "None")
                  for name, (_, cast) in distributions.items()}
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={name: dist for name, (dist, _) in distributions.items()},
            value=float(run.metrics[metric]), user_attrs={"run_id": run.run_id}))
    return study


def importance(runs: Sequence[RunRecord], metric: str, mode: Mode, out_dir: Path,
               warnings_out: list[str]) -> tuple[dict[str, float], list[Path]]:
    """fANOVA importance of each knob for `metric` (sums to 1) and the files: `importance.csv` and the
    parallel-coordinates plot. Nothing (and a warning) with no knob or fewer than 3 scored runs; only the plot (and
    a warning saying why) when the runs do not repeat their configurations (MIN_RUNS_PER_CONFIGURATION)."""
    runs, names = method_knobs(runs, knobs(runs))
    if not names:
        return {}, []
    study = study_of(runs, metric, mode, names)
    if len(study.trials) < 3:
        warnings_out.append(f"hyperparameter importance needs 3 runs with {metric}; {len(study.trials)} have it")
        return {}, []
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    configurations = len({tuple(sorted(trial.params.items())) for trial in study.trials})
    scores = {}
    if len(study.trials) < min(MIN_RUNS_PER_CONFIGURATION * configurations, MIN_RUNS_DRAWN):
        warnings_out.append(
            f"hyperparameter importance not computed: {len(study.trials)} runs with {metric} over {configurations} "
            f"configurations of the knobs ({', '.join(names)}), fewer than {MIN_RUNS_PER_CONFIGURATION} per "
            f"configuration and fewer than {MIN_RUNS_DRAWN} in all, so what a knob changes cannot be told from seed "
            "noise; run more seeds (tune.seeds) or more trials")
    else:
        try:
            scores = get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=0), normalize=True)
        except (RuntimeError, ValueError) as err:  # e.g. every run scored the same: no variance to split
            warnings_out.append(f"hyperparameter importance not computed: {err}")
    files = []
    if scores:
        path = out_dir / IMPORTANCE_FILE
        pd.DataFrame({"param": list(scores), "importance": list(scores.values())}).to_csv(path, index=False)
        files.append(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        from optuna.visualization.matplotlib import plot_parallel_coordinate

        axes = plot_parallel_coordinate(study, params=list(names), target_name=metric)
    figure = axes.figure
    figure.set_size_inches(max(7.0, 1.6 * (len(names) + 1)), 4.5)
    figure.tight_layout()
    figure.savefig(out_dir / PARALLEL_FILE, format="png", dpi=120)
    import matplotlib.pyplot as plt  # Optuna's plot made the figure through pyplot: release it there

    plt.close(figure)
    files.append(out_dir / PARALLEL_FILE)
    return dict(scores), files


def importance_markdown(scores: Mapping[str, float], metric: str) -> str:
    if not scores:
        return ""
    lines = [f"Hyperparameter importance for `{metric}` (Optuna's fANOVA over the runs; sums to 1):", "",
             "| knob | importance |", "|---|---|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in scores.items()]
    return "\n".join(lines) + "\n"
