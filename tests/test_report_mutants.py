"""Tests written against survivors of a hand mutation pass over the report's arithmetic (metrics.py, pareto.py,
objectives.py, importance.py). Each test names the mistake it catches; expected values are computed by hand from
the MHE paper's formulas (Xue & Aletras 2023, §4.5-4.6: PRR against MHA, PEoP against SHA) or from the docstrings'
definitions, never read back from the code under test."""

from __future__ import annotations

import math

import pytest

from orchestrator.report.importance import knobs, method_knobs, study_of
from orchestrator.report.metrics import (
    MethodGroup,
    RunRecord,
    find_reference,
    infer_mode,
    prr,
    summarize,
)
from orchestrator.report.objectives import check_objectives
from orchestrator.report.pareto import Objective, non_dominated
from orchestrator.report.stats import Interval

# BERT-base attention parameters incl. W^O, no biases (paper §2.3 of the digest): SHA 737,280, MHE 739,584,
# MHA 2,359,296 per layer.
SHA_P, MHE_P, MHA_P = 737_280.0, 739_584.0, 2_359_296.0


def _group(label: str, scores: list[float], params: float, metric: str = "val/acc") -> MethodGroup:
    runs = tuple(RunRecord(f"{label}-{seed}", {"model.attention.kind": label, "optim.seed": str(seed),
                                               "params.attention": str(params)}, {metric: score})
                 for seed, score in enumerate(scores))
    return MethodGroup(label=label, kind=label, knobs={}, runs=runs)


def test_summarize_measures_peop_against_the_lower_reference_not_mha():
    """Catches PEoP computed against the upper reference (MHA) in `summarize`: the paper's PEoP is the elasticity
    over SHA, (score/score_SHA - 1) / (params/params_SHA - 1); SQuAD v2.0 MHE-MUL 72.3 vs SHA 67.6 gives 22.25."""
    groups = [_group("mha", [76.5], MHA_P), _group("sha", [67.6], SHA_P), _group("mhe", [72.3], MHE_P)]
    rows = {row.label: row for row in summarize(groups, "val/acc", "max", "mha", "sha").rows}
    assert rows["mhe"].peop == pytest.approx((72.3 / 67.6 - 1) / (MHE_P / SHA_P - 1))
    assert round(rows["mhe"].peop, 2) == 22.25, "PEoP must be measured against SHA (the lower reference)"
    assert rows["mhe"].prr == pytest.approx(72.3 / 76.5)
    assert math.isnan(rows["sha"].peop)


def test_a_diverged_seed_makes_the_method_mean_nan_instead_of_being_dropped():
    """Catches a nan-ignoring mean: averaging only the surviving seeds would flatter an unstable method."""
    groups = [_group("mha", [80.0, 82.0], MHA_P), _group("lsh", [81.0, math.nan], MHA_P)]
    summary = summarize(groups, "val/acc", "max", "mha", None)
    lsh = next(row for row in summary.rows if row.label == "lsh")
    assert math.isnan(lsh.score_mean), "a NaN seed must not be averaged away"
    assert any("non-finite" in w for w in summary.warnings)


def test_the_reversed_peop_sign_is_warned_about_for_methods_smaller_than_the_lower_reference_only():
    """Catches the 'fewer parameters than SHA' warning raised for the larger methods instead of the smaller."""
    groups = [_group("mha", [80.0], MHA_P), _group("sha", [70.0], SHA_P), _group("tiny", [60.0], SHA_P / 2)]
    warnings = summarize(groups, "val/acc", "max", "mha", "sha").warnings
    flagged = [w for w in warnings if "fewer attention parameters" in w]
    assert len(flagged) == 1 and flagged[0].startswith("tiny:"), warnings


def test_prr_against_a_zero_reference_is_nan_not_a_crash():
    """Catches the zero-reference guard removed (a ZeroDivisionError on a reference that scored 0, e.g. BLEU 0)."""
    assert math.isnan(prr(10.0, 0.0, "max"))
    assert math.isnan(prr(10.0, 0.0, "min"))


@pytest.mark.parametrize("name, mode", [("val/acc_loss", "min"), ("val/bleu_loss", "min"), ("val/f1", "max"),
                                        ("val/bpb", "min")])
def test_a_name_with_a_loss_hint_is_minimised_even_with_a_score_hint(name, mode):
    """Catches the direct hints checked before the inverse ones ('val/acc_loss' would be maximised)."""
    assert infer_mode(name) == mode


def test_a_plain_reference_beats_one_with_more_knobs():
    """Catches find_reference picking the group with the most knobs when no label is exactly the name."""
    plain = MethodGroup("mha heads=8", "mha", {"heads": "8"}, ())
    crossed = MethodGroup("mha heads=8 mechanism=exact", "mha", {"heads": "8", "mechanism": "exact"}, ())
    assert find_reference([crossed, plain], "mha") is plain


def test_two_equal_points_are_both_on_the_front():
    """Catches 'better on one' turned into 'as good on one': equal points would dominate each other and both
    leave the front, although neither is better anywhere (the docstring's definition of domination)."""
    front = non_dominated([Objective("params", "min", [10.0, 10.0, 20.0]), Objective("acc", "max", [0.8, 0.8, 0.7])])
    assert front == [True, True, False]


def test_under_uncertainty_a_point_without_an_interval_counts_as_exact():
    """Catches a NaN interval (Interval.none(), one seed) read as an interval: its NaN ends would compare False
    and the point could neither be dominated nor dominate."""
    params = Objective("params", "min", [10.0, 20.0], [Interval(10.0, 10.0), Interval(20.0, 20.0)])
    acc = Objective("acc", "max", [0.9, 0.5], [Interval(0.88, 0.92), Interval.none()])
    assert non_dominated([params, acc], uncertain=True) == [True, False]


def test_parameter_and_memory_objectives_default_to_minimised():
    """Catches the default direction of `params.*` / `memory/*` objectives flipped to 'max' (a larger model would
    look better on the Pareto front of a multi-objective sweep)."""
    runs = [RunRecord("a", {"params.attention": "100"}, {"val/acc": 0.5, "memory/peak_gb": 1.0})]
    modes = check_objectives(runs, ["val/acc", "params.attention", "memory/peak_gb"], [None, None, None])
    assert modes == ["max", "min", "min"]


def test_a_param_with_one_value_is_not_a_knob():
    """Catches 'varies' read as 'takes at least one value': a constant param would enter fANOVA as a knob."""
    runs = [RunRecord(str(i), {"model.attention.kind": kind, "optim.lr": "0.001", "optim.seed": str(i)}, {})
            for i, kind in enumerate(["mha", "sha", "mha", "sha"])]
    assert knobs(runs) == ["model.attention.kind"]


def test_a_param_that_only_restates_the_method_is_dropped():
    """Catches method_knobs keeping a param that takes one value within each method (heads: 12 for MHE, 1 for SHA):
    fANOVA would split the method's effect between the two at random."""
    runs = [RunRecord(f"{kind}{seed}", {"model.attention.kind": kind, "optim.seed": str(seed),
                                        "model.attention.heads": "12" if kind == "mhe" else "1"},
                      {"val/ppl": 1.0 + seed}) for kind in ("mhe", "sha") for seed in (0, 1)]
    _, names = method_knobs(runs, knobs(runs))
    assert names == ["model.attention.kind"]


@pytest.mark.parametrize("mode, direction", [("min", "MINIMIZE"), ("max", "MAXIMIZE")])
def test_the_importance_study_has_the_metrics_direction(mode, direction):
    """Catches the Optuna study built with a fixed direction: the parallel-coordinates plot colours by it."""
    import optuna

    runs = [RunRecord(str(i), {"optim.lr": str(lr)}, {"val/x": float(i)}) for i, lr in enumerate([1e-3, 2e-3, 3e-3])]
    assert study_of(runs, "val/x", mode, ["optim.lr"]).direction == getattr(optuna.study.StudyDirection, direction)
