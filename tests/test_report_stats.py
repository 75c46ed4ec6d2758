"""The report's statistics against scipy on the same numbers, from an MLflow store of seeded synthetic runs.

Each method's per-seed scores are built from the reference's by adding a known difference and a fixed noise vector
of mean 0 and sample std 1, so the paired t statistic is diff·√n by construction: a clear margin (p ~ 1e-9), a
zero mean difference, and a margin whose p-value (~0.03) is below 0.05 alone but not after Holm's correction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from scipy import optimize, stats

from orchestrator.report.build import PARENT_TAG, ReportError, build_report
from orchestrator.report.compare import analyse, verdict_of
from orchestrator.report.metrics import MethodRow, Summary, peop, prr
from orchestrator.report.objectives import as_list
from orchestrator.report.pareto import Objective, non_dominated
from orchestrator.report.stats import (
    SIGN_FLIP,
    Interval,
    compare,
    holm,
    holm_level,
    power_analysis,
    ratio_interval,
)
from tests.ram_folder import ram_folder

SEEDS = 10
NOISE = stats.zscore(np.random.default_rng(7).normal(size=SEEDS), ddof=1)  # mean 0, sample std 1 exactly
T_03 = stats.t.isf(0.03 / 2, SEEDS - 1) / math.sqrt(SEEDS)  # a paired mean difference with p = 0.03 (sd 1)
FEW = 5
FEW_NOISE = stats.zscore(np.random.default_rng(11).normal(size=FEW), ddof=1)


def _log(client: MlflowClient, experiment_id: str, kind: str, seed: int, score: float, *, parent: str | None = None,
         params: int = 1000, extra: dict[str, str] | None = None, tokens: float = 100.0) -> None:
    run = client.create_run(experiment_id, tags={PARENT_TAG: parent} if parent else {})
    now = int(time.time() * 1000)
    logged = {"model.attention.kind": kind, "optim.seed": str(seed), "params.attention": str(params), **(extra or {})}
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in logged.items()],
                     metrics=[Metric("val/acc", score, now, 10), Metric("train/tokens_per_s", tokens, now, 10),
                              Metric("memory/peak_gb", 1.0, now, 10)])
    client.set_terminated(run.info.run_id)


def _reference_scores() -> np.ndarray:
    return 70.0 + 2.0 * np.random.default_rng(3).normal(size=SEEDS)


# Each method's scores: the reference's plus a mean difference and the unit noise times a spread.
METHODS = {"clear": (5.0, 1.0), "worse": (-5.0, 1.0), "same": (0.0, 1.0), "holm": (T_03, 1.0)}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[dict[str, object]]:
    with ram_folder() as d:
        root = Path(d)
        uri = f"sqlite:///{root}/mlflow.db"
        client = MlflowClient(tracking_uri=uri)
        paired = client.create_experiment("paired", artifact_location=(root / "a").as_uri())
        parent = client.create_run(paired, run_name="sweep").info.run_id
        ref = _reference_scores()
        for seed in range(SEEDS):
            _log(client, paired, "mha", seed, ref[seed], parent=parent, params=4000, tokens=100.0)
            for i, (kind, (diff, spread)) in enumerate(METHODS.items()):
                _log(client, paired, kind, seed, ref[seed] + diff + spread * NOISE[seed], parent=parent,
                     params=1000 * (i + 1), tokens=100.0 + i)
        client.set_terminated(parent)
        unpaired = client.create_experiment("unpaired", artifact_location=(root / "b").as_uri())
        for seed in range(4):  # mha on seeds 0-3, lsh on 10-14: nothing to pair
            _log(client, unpaired, "mha", seed, 70.0 + NOISE[seed])
        for seed in range(10, 15):
            _log(client, unpaired, "lsh", seed, 72.0 + 2.0 * NOISE[seed - 10])
        few = client.create_experiment("few", artifact_location=(root / "c").as_uri())
        for seed in range(FEW):  # sha below mha on every seed by ~20x the spread of the differences; tie level
            _log(client, few, "mha", seed, ref[seed])
            _log(client, few, "sha", seed, ref[seed] - 5.0 + 0.25 * FEW_NOISE[seed])
            _log(client, few, "tie", seed, ref[seed] + FEW_NOISE[seed])
        overlap = client.create_experiment("overlap", artifact_location=(root / "d").as_uri())
        for seed in range(5):  # mhe ran seeds 0-2, mha 0-4 (the MQAR study's case)
            _log(client, overlap, "mha", seed, ref[seed])
            if seed < 3:
                _log(client, overlap, "mhe", seed, ref[seed] - 3.0 + 0.5 * FEW_NOISE[seed])
        yield {"uri": uri, "client": client, "parent": parent, "ref": ref}


def _row(table: pd.DataFrame, method: str) -> pd.Series:
    return table.set_index("method").loc[method]


def _scores(kind: str, ref: np.ndarray) -> np.ndarray:
    diff, spread = METHODS[kind]
    return ref + diff + spread * NOISE


def test_intervals_p_values_and_verdicts_equal_scipys(store, tmp_path):
    report = build_report(store["uri"], "paired", parent_run_id=store["parent"], metric="val/acc",
                          lower_reference="none", out_dir=tmp_path)
    ref = store["ref"]
    table = report.table
    low, high = stats.t.interval(0.95, SEEDS - 1, loc=np.mean(ref), scale=stats.sem(ref))
    assert _row(table, "mha")[["score_ci_low", "score_ci_high"]].tolist() == pytest.approx([low, high])
    for kind in METHODS:
        x = _scores(kind, ref)
        expected = stats.ttest_rel(x, ref)
        row = _row(table, kind)
        assert row["test"] == "paired t" and row["n_compared"] == SEEDS
        assert row["diff"] == pytest.approx(np.mean(x - ref))
        assert row["p_value"] == pytest.approx(expected.pvalue)
        ci = expected.confidence_interval(0.95)
        assert [row["diff_ci_low"], row["diff_ci_high"]] == pytest.approx([ci.low, ci.high])
        assert row["score_ci_low"] == pytest.approx(stats.t.interval(0.95, SEEDS - 1, loc=np.mean(x),
                                                                      scale=stats.sem(x))[0])
    assert _row(table, "clear")["verdict"] == "better" and _row(table, "worse")["verdict"] == "worse"
    assert _row(table, "same")["verdict"] == "indistinguishable"
    # PRR's bootstrap interval holds the point PRR; the clear margin's lies wholly above 100%.
    clear = _row(table, "clear")
    assert clear["prr_ci_low"] <= clear["prr"] <= clear["prr_ci_high"] and clear["prr_ci_low"] > 1.0
    assert "Holm's correction for 4 comparisons" in report.markdown


def test_holm_turns_a_lone_significant_pair_indistinguishable(store, tmp_path):
    report = build_report(store["uri"], "paired", metric="val/acc", lower_reference="none", out_dir=tmp_path,
                          log_to_mlflow=False)
    row = _row(report.table, "holm")
    assert row["p_value"] == pytest.approx(0.03) and row["p_value"] < 0.05
    # Third smallest of 4 p-values: Holm multiplies it by 4 - 3 + 1 = 2.
    assert row["p_holm"] == pytest.approx(0.06)
    assert row["verdict"] == "indistinguishable"
    assert _row(report.table, "clear")["p_holm"] < 0.05  # a clear margin survives the correction
    assert holm([0.01, 0.04, 0.03, math.nan]) == pytest.approx([0.03, 0.06, 0.06, math.nan], nan_ok=True)


def test_unequal_seed_sets_use_welch_and_say_so(store, tmp_path):
    report = build_report(store["uri"], "unpaired", metric="val/acc", lower_reference="none", out_dir=tmp_path,
                          log_to_mlflow=False)
    row = _row(report.table, "lsh")
    lsh = 72.0 + 2.0 * NOISE[:5]
    mha = 70.0 + NOISE[:4]
    expected = stats.ttest_ind(lsh, mha, equal_var=False)
    assert row["test"] == "Welch (unpaired)" and "seeds" in row["test_note"]
    assert row["p_value"] == pytest.approx(expected.pvalue)
    ci = expected.confidence_interval(0.95)
    assert [row["diff_ci_low"], row["diff_ci_high"]] == pytest.approx([ci.low, ci.high])
    assert "Welch (unpaired) (seeds" in report.markdown and "Welch's unpaired t-test" in report.markdown


def test_five_paired_seeds_with_a_clear_gap_are_called_worse_and_a_tie_indistinguishable(store, tmp_path):
    """The case the sign-flip test could never decide: with 5 seeds its smallest p is 2/32 = 0.0625. The paired
    t-test is primary; the sign-flip p is shown beside it and the row says they disagree."""
    report = build_report(store["uri"], "few", metric="val/acc", lower_reference="none", out_dir=tmp_path,
                          log_to_mlflow=False)
    ref = store["ref"][:FEW]
    sha = ref - 5.0 + 0.25 * FEW_NOISE
    row = _row(report.table, "sha")
    expected = stats.ttest_rel(sha, ref)
    assert row["test"] == "paired t" and row["n_compared"] == FEW
    assert row["p_value"] == pytest.approx(expected.pvalue) and row["p_value"] < 1e-5
    assert row["verdict"] == "worse"
    assert row["sign_flip_p"] == pytest.approx(2 / 2**FEW) and row["sign_flip_min_p"] == pytest.approx(2 / 2**FEW)
    assert "sign-flip check disagrees" in row["test_note"] and "0.0625" in row["test_note"]
    # Two comparisons: the smaller p is Holm-multiplied by 2, and the printed interval is t's at 1 - 0.05/2.
    low, high = stats.t.interval(1 - 0.05 / 2, FEW - 1, loc=np.mean(sha - ref), scale=stats.sem(sha - ref))
    assert [row["diff_ci_holm_low"], row["diff_ci_holm_high"]] == pytest.approx([low, high]) and high < 0
    assert _row(report.table, "tie")["verdict"] == "indistinguishable"
    assert "| sha | -5." in report.markdown and "| worse |" in report.markdown


def test_overlapping_seed_sets_are_paired_on_the_seeds_both_ran(store, tmp_path):
    report = build_report(store["uri"], "overlap", metric="val/acc", lower_reference="none", out_dir=tmp_path,
                          log_to_mlflow=False)
    row = _row(report.table, "mhe")
    ref, mhe = store["ref"][:3], store["ref"][:3] - 3.0 + 0.5 * FEW_NOISE[:3]
    expected = stats.ttest_rel(mhe, ref)
    assert row["test"] == "paired t" and row["n_compared"] == 3
    assert "paired on the 3 shared seeds (method ran 3, reference 5)" in row["test_note"]
    assert row["p_value"] == pytest.approx(expected.pvalue)
    ci = expected.confidence_interval(0.95)
    assert [row["diff_ci_low"], row["diff_ci_high"]] == pytest.approx([ci.low, ci.high])
    assert row["verdict"] == "worse"


@pytest.mark.parametrize("seed", range(40))
def test_no_interval_excludes_zero_beside_indistinguishable(seed):
    """Random studies (2-10 seeds, 1-5 methods, some shifted): the Holm-adjusted interval excludes 0 exactly when
    the Holm p is below alpha, so a row's interval and verdict always agree."""
    rng = np.random.default_rng(seed)
    n, methods = int(rng.integers(2, 11)), int(rng.integers(1, 6))
    reference = dict(enumerate(rng.normal(size=n)))
    comparisons = [compare({s: v + rng.normal(0, 0.6) + rng.choice([0.0, 0.5, 1.5]) for s, v in reference.items()},
                           reference, 0.95) for _ in range(methods)]
    adjusted = holm([c.p_value for c in comparisons])
    for comparison, p_holm in zip(comparisons, adjusted):
        interval = comparison.interval(holm_level(0.05, comparison.p_value, p_holm))
        assert (0.0 not in interval) == (p_holm < 0.05), (comparison, p_holm, interval)


def test_power_matches_a_hand_computed_case():
    # Paired t, effect d_z = 1 (mean difference = sd of differences), alpha 0.05 two-sided, power 0.8: the
    # textbook answer (Cohen 1988; G*Power) is 10 pairs, actual power 0.803; 9 pairs give 0.76.
    mdd, needed = power_analysis(1.0, [1.0], 10, 0.05)
    assert needed == 10
    t_crit = stats.t.ppf(0.975, 9)
    # At the detectable difference the noncentral t with nc = mdd·√10 exceeds t_crit with probability 0.8.
    assert stats.nct.sf(t_crit, 9, mdd * math.sqrt(10)) == pytest.approx(0.8, abs=1e-3)
    assert mdd == pytest.approx(0.996, abs=1e-3)
    # More spread, same difference: more seeds.
    assert power_analysis(1.0, [2.0], 10, 0.05)[1] > 10


def test_identical_scores_and_single_runs_give_no_verdict():
    same = compare({"0": 1.0, "1": 2.0}, {"0": 1.0, "1": 2.0}, 0.95)
    assert same.p_value == 1.0 and same.diff == 0.0
    lone = compare({"0": 1.0}, {"0": 1.0, "1": 2.0}, 0.95)
    assert lone.test == "" and math.isnan(lone.p_value)


def test_pareto_front_counts_uncertainty():
    # b is better than a on the score by the means, but their intervals overlap: a stays on the uncertain front.
    score = Objective("score", "max", [1.0, 1.2, 0.5],
                      [Interval(0.8, 1.2), Interval(1.1, 1.3), Interval(0.45, 0.55)])
    params = Objective("params", "min", [10.0, 10.0, 10.0])
    assert non_dominated([score, params]) == [False, True, False]
    assert non_dominated([score, params], uncertain=True) == [True, True, False]


def test_report_files_on_the_parent_run_include_importance_and_parallel_coordinates(store, tmp_path):
    client = store["client"]
    report = build_report(store["uri"], "paired", parent_run_id=store["parent"], metric="val/acc",
                          lower_reference="none", out_dir=tmp_path)
    files = {f.path for f in client.list_artifacts(store["parent"], "report")}
    assert {"report/importance.csv", "report/parallel_coordinates.png", "report/cost_front.png"} <= files, files
    assert set(report.importance) == {"model.attention.kind"} and report.importance["model.attention.kind"] == 1.0
    assert pd.read_csv(tmp_path / "importance.csv")["param"].tolist() == ["model.attention.kind"]


def test_several_objectives_mark_the_non_dominated_runs(store, tmp_path):
    report = build_report(store["uri"], "paired", parent_run_id=store["parent"],
                          metric=["val/acc", "params.attention"], mode=["max", "min"], lower_reference="none",
                          out_dir=tmp_path, log_to_mlflow=False)
    table = report.objectives.table
    # Per run: non-dominated when no run is both as small and as accurate, one of them strictly.
    values = [(row["params.attention"], row["val/acc"]) for _, row in table.iterrows()]
    expected = [not any(p2 <= p1 and a2 >= a1 and (p2, a2) != (p1, a1) for p2, a2 in values) for p1, a1 in values]
    assert table["non_dominated"].tolist() == expected and 0 < sum(expected) < len(expected)
    assert set(table["params.attention"]) == {1000.0, 2000.0, 3000.0, 4000.0}
    assert "Non-dominated runs" in report.markdown and (tmp_path / "objectives.csv").is_file()
    # A sweep logs its list tune.metric as the list's repr; the report reads it back as the objectives.
    assert as_list("['val/acc', 'params.attention']") == ["val/acc", "params.attention"]
    assert as_list("val/acc,params.attention") == ["val/acc", "params.attention"]
    with pytest.raises(ReportError, match="objective 'train/flops': no run logs it"):
        build_report(store["uri"], "paired", metric=["val/acc", "train/flops"], mode=["max", "min"],
                     out_dir=tmp_path / "x", log_to_mlflow=False)


def test_a_published_paired_row_gives_back_scipys_t_test(tmp_path):
    """benchmarks/studies/rereport.py --from-report: a report.csv row of the old form (exact sign-flip p, the paired
    95% t interval) yields the paired t-test scipy computes on the per-seed scores it no longer has."""
    import pandas as pd

    from benchmarks.studies.rereport import comparison_from_row, from_report

    ref = np.array([4.44, 4.50, 4.16])
    lsh = np.array([3.79, 3.85, 3.72])
    ci = stats.ttest_rel(lsh, ref).confidence_interval(0.95)
    rows = [{"method": "mha", "test": None, "n_compared": None, "diff": None, "diff_ci_low": None,
             "diff_ci_high": None, "p_value": None, "verdict": "n/a"},
            {"method": "lsh", "test": "exact sign-flip", "n_compared": 3, "diff": float(np.mean(lsh - ref)),
             "diff_ci_low": ci.low, "diff_ci_high": ci.high, "p_value": 0.25, "verdict": "indistinguishable"}]
    pd.DataFrame(rows).to_csv(tmp_path / "report.csv", index=False)
    comparison = comparison_from_row(pd.read_csv(tmp_path / "report.csv").iloc[1])
    assert comparison.p_value == pytest.approx(stats.ttest_rel(lsh, ref).pvalue, rel=1e-9)
    assert comparison.check_p == 0.25 and comparison.interval(0.95).low == pytest.approx(ci.low)
    text = from_report(tmp_path, "val/bpb")
    assert "| lsh |" in text and "| better |" in text and "indistinguishable |" in text  # new and old verdicts


# --- the statistics a reviewer checked by simulation and by hand -------------------------------------------------


def _method(label: str, scores, params: float, seeds=None, ref: float | None = None, low: tuple | None = None,
            mode: str = "max") -> MethodRow:
    seeds = tuple(str(s) for s in (seeds if seeds is not None else range(len(scores))))
    mean = float(np.mean(scores))
    return MethodRow(label=label, kind=label, knobs={}, run_ids=tuple(f"{label}-{s}" for s in seeds),
                     n_runs=len(scores), score_mean=mean, score_std=float(np.std(scores, ddof=1)),
                     params_attention=params, params_total=params,
                     prr=prr(mean, ref, mode) if ref is not None else math.nan,
                     peop=peop(mean, low[0], params, low[1], mode) if low is not None else math.nan,
                     tokens_per_s=math.nan, peak_memory_gb=math.nan, seeds=seeds, scores=tuple(scores))


def _summary(rows: dict, mode: str = "max") -> Summary:
    """rows: label -> (scores, params[, seeds]); mha the reference, sha the lower one."""
    ref, low = float(np.mean(rows["mha"][0])), (float(np.mean(rows["sha"][0])), rows["sha"][1])
    return Summary([_method(label, *spec, ref=ref, low=None if label == "sha" else low, mode=mode)
                    for label, spec in rows.items()], "mha", "sha")


@pytest.mark.parametrize("seeds", [2, 3, 5])
def test_the_ratio_interval_holds_the_true_ratio_95_percent_of_the_time(seeds):
    """Paired normal scores with a seed effect shared by the methods, true ratio of means 0.95 (PRR and PEoP are
    affine in it: test_the_ratio_interval_is_fiellers_by_hand). A percentile bootstrap over the seeds held the
    truth 52% of the time at 2 seeds, 74% at 3 and 82% at 5. 2,000 studies: the count's sd is 9.7, so
    [1855, 1945] is 4.6 sd each side of 95%. Unpaired (Welch's case) too."""
    rng = np.random.default_rng(seeds)
    studies = 2000
    shared = rng.normal(0.0, 2.0, size=(studies, seeds))
    ref = 100.0 + shared + rng.normal(0, 1.0, (studies, seeds))
    method = 95.0 + shared + rng.normal(0, 1.0, (studies, seeds))
    paired = sum(0.95 in ratio_interval(x, y, 0.95, paired=True) for x, y in zip(method, ref))
    apart = sum(0.95 in ratio_interval(x, y, 0.95, paired=False)
                for x, y in zip(95.0 + rng.normal(0, 1.0, (studies, seeds)), 100.0 + rng.normal(0, 2.0, (studies, 4))))
    assert 1855 <= paired <= 1945 and 1855 <= apart <= 1945, (paired, apart)


@pytest.mark.parametrize("seeds", [3, 5])
def test_a_ratio_to_a_reference_near_zero_is_unbounded_rather_than_too_narrow(seeds):
    """A reference whose mean is a standard deviation or less from 0 (0.3 +- 0.5 a seed), a steady method (0.25):
    the delta method's symmetric R +- t se held the true ratio 89% of the time at 3 seeds and 88% at 5; Fieller's
    interval 97% and 98%, unbounded where the reference's mean is not distinguishable from 0."""
    rng = np.random.default_rng(seeds)
    studies, true = 2000, 0.25 / 0.3
    ref, method = rng.normal(0.3, 0.5, (studies, seeds)), rng.normal(0.25, 0.01, (studies, seeds))
    intervals = [ratio_interval(x, y, 0.95, paired=True) for x, y in zip(method, ref)]
    assert 1855 <= sum(true in interval for interval in intervals) <= 1990
    unbounded = [interval for interval in intervals if math.isinf(interval.high)]
    assert unbounded and all(interval.low == -math.inf for interval in unbounded)
    # unbounded exactly where the reference's own t-test does not reject a zero mean
    rejects = [stats.ttest_1samp(y, 0.0).pvalue < 0.05 for y in ref]
    assert [math.isinf(interval.high) for interval in intervals] == [not r for r in rejects]


def test_prr_peop_and_the_difference_use_the_seeds_of_their_interval():
    """mha ran seeds 0-4, mhe 0-2, and mha's seeds 3-4 happened to be high: every number of mhe's row is over
    seeds 0-2, so each interval holds its own point (the all-run PRR, 97.3%, lay below its interval)."""
    rows = {"mha": ([80.0, 80.4, 79.8, 83.0, 83.4], 4000.0), "sha": ([76.0, 76.5, 75.8, 78.9, 79.3], 1000.0),
            "mhe": ([79.0, 79.5, 78.9], 1010.0, [0, 1, 2])}
    summary = _summary(rows)
    stats_ = analyse(summary, "max")
    mhe = stats_.rows["mhe"]
    assert mhe.prr == pytest.approx(np.mean([79.0, 79.5, 78.9]) / np.mean([80.0, 80.4, 79.8]))
    assert mhe.prr in mhe.prr_ci and mhe.peop in mhe.peop_ci
    assert mhe.comparison.diff == pytest.approx(np.mean([-1.0, -0.9, -0.9]))
    from orchestrator.report.tables import rows_to_frame, rows_to_markdown

    frame = rows_to_frame(summary.rows, stats_).set_index("method")
    assert frame.loc["mhe", "prr"] == pytest.approx(mhe.prr)
    assert f"{100 * mhe.prr:.1f}% [" in rows_to_markdown(summary.rows, "val/acc", "max", stats_)


def test_the_ratio_interval_is_fiellers_by_hand():
    """Every R whose paired differences x - R y a t-test at 95% does not reject: the two roots of
    (mean(x) - R mean(y))^2 = t^2 var(x - R y) / n."""
    rows = {"mha": ([80.0, 81.0, 79.0], 4000.0), "sha": ([70.0, 72.0, 71.0], 1000.0),
            "mhe": ([78.0, 80.5, 77.0], 2000.0)}
    mhe = analyse(_summary(rows), "max").rows["mhe"]
    x, y = np.array(rows["mhe"][0]), np.array(rows["mha"][0])

    def t_of(r: float) -> float:
        return stats.ttest_1samp(x - r * y, 0.0).statistic

    critical = stats.t.ppf(0.975, 2)
    r = x.mean() / y.mean()
    low = optimize.brentq(lambda v: t_of(v) - critical, r - 1, r)
    high = optimize.brentq(lambda v: t_of(v) + critical, r, r + 1)
    assert [mhe.prr_ci.low, mhe.prr_ci.high] == pytest.approx([low, high])
    # perplexity (min): PRR = 2 - R, so the interval flips end to end
    flipped = analyse(_summary(rows, "min"), "min").rows["mhe"]
    assert [flipped.prr_ci.low, flipped.prr_ci.high] == pytest.approx([2 - high, 2 - low])
    # PEoP = (R - 1) / (params / params_sha - 1) against sha, on the same construction
    x, y = np.array(rows["mhe"][0]), np.array(rows["sha"][0])
    r = x.mean() / y.mean()
    low = optimize.brentq(lambda v: t_of(v) - critical, r - 1, r)
    high = optimize.brentq(lambda v: t_of(v) + critical, r, r + 1)
    assert [mhe.peop_ci.low, mhe.peop_ci.high] == pytest.approx([low - 1, high - 1])


def test_welch_with_a_constant_group_takes_the_other_groups_degrees_of_freedom_as_scipy_does():
    method, reference = {"a": 1.0, "b": 1.3}, {f"r{i}": 2.0 for i in range(5)}
    result = compare(method, reference, 0.95)
    expected = stats.ttest_ind([1.0, 1.3], [2.0] * 5, equal_var=False)
    ci = expected.confidence_interval(0.95)
    assert result.df == pytest.approx(1.0)
    assert [result.ci.low, result.ci.high] == pytest.approx([ci.low, ci.high])
    assert result.p_value == pytest.approx(expected.pvalue)


def test_the_same_difference_on_every_seed_is_decided_by_the_sign_flip_test_without_a_zero_width_interval():
    # accuracies on a 100-example dev set: the gap is 0.01 on both seeds, equal up to float rounding
    result = compare({"0": 0.80, "1": 0.82}, {"0": 0.81, "1": 0.83}, 0.95)
    assert result.test == SIGN_FLIP and result.p_value == pytest.approx(0.5)
    assert math.isnan(result.ci.low) and math.isnan(result.mdd) and "no spread" in result.note
    rows = {"mha": ([0.81, 0.83], 4000.0), "sha": ([0.70, 0.74], 1000.0), "mhe": ([0.80, 0.82], 2000.0)}
    assert analyse(_summary(rows), "max").rows["mhe"].verdict == "indistinguishable"
    # six seeds of the same gap: the sign-flip test's p is 2 / 64, below 0.05
    six = compare({str(s): 0.5 + s / 100 for s in range(6)}, {str(s): 0.6 + s / 100 for s in range(6)}, 0.95)
    assert six.test == SIGN_FLIP and six.p_value == pytest.approx(2 / 64)


def test_a_diverged_seed_leaves_the_row_untested():
    result = compare({"0": 78.0, "1": math.nan, "2": 78.5}, {"0": 80.0, "1": 80.5, "2": 79.0}, 0.95)
    assert result.test == "" and math.isnan(result.p_value) and math.isnan(result.check_p)
    assert "not finite" in result.note
    rows = {"mha": ([80.0, 80.5, 79.0], 4000.0), "sha": ([75.0, 76.0, 74.0], 1000.0),
            "mhe": ([78.0, math.nan, 78.5], 2000.0)}
    assert analyse(_summary(rows), "max").rows["mhe"].verdict == "n/a"


def test_power_and_the_sign_flip_note_use_the_verdicts_holm_level():
    """Five methods on 5 seeds; a's p is 0.0126 and its Holm p 0.0506 (indistinguishable). At plain alpha its
    detectable difference (1.68) was below its own |Δ| (1.92) and 'seeds for Δ' was the 5 already run; at its
    Holm level (about 0.0125) it is 2.48, and 7 seeds."""
    base = np.array([80.0, 81.0, 79.5, 80.5, 80.2])
    d = np.array([1.0, 1.4, 0.6, 1.2, 0.8])
    d = (d - d.mean()) / np.std(d, ddof=1) + 4.3 / math.sqrt(5)
    rows = {"mha": (base, 4000.0), "sha": (base - 3 + np.array([0, .5, -.5, .2, -.2]), 1000.0),
            "a": (base + d, 2000.0), "b": (base + np.array([.1, -.3, .2, -.1, .05]), 2000.0),
            "c": (base + np.array([.3, -.2, .2, -.4, .05]), 2000.0),
            "d": (base + np.array([-.3, .2, -.2, .4, .1]), 2000.0)}
    stats_ = analyse(_summary(rows), "max")
    a = stats_.rows["a"]
    assert a.verdict == "indistinguishable" and a.p_holm > 0.05 > a.comparison.p_value
    level = 0.05 * a.comparison.p_value / a.p_holm
    critical = stats.t.ppf(1 - level / 2, 4)
    at_mdd = a.comparison.mdd / (np.std(d, ddof=1) / math.sqrt(5))
    assert stats.nct.sf(critical, 4, at_mdd) + stats.nct.sf(critical, 4, -at_mdd) == pytest.approx(0.8, abs=1e-6)
    assert a.comparison.mdd > abs(a.comparison.diff) and a.comparison.seeds_needed == 7
    # the t-test and the sign-flip check (p = 0.0625) agree at that level: no "disagrees" note
    assert a.comparison.check_p == pytest.approx(0.0625) and "disagrees" not in a.comparison.note


def test_a_published_row_with_the_same_difference_on_every_seed_is_the_sign_flip_tests():
    """A zero-width published interval with a non-zero difference: every seed gave the same difference. The
    re-report gave it p = 0 ('better'); like the live report, the exact sign-flip test decides (2 / 2^n)."""
    import pandas as pd

    from benchmarks.studies.rereport import comparison_from_row

    row = pd.Series({"method": "lsh", "test": "paired t", "n_compared": 3, "diff": -0.5, "diff_ci_low": -0.5,
                     "diff_ci_high": -0.5, "p_value": 0.0, "verdict": "better"})
    comparison = comparison_from_row(row)
    assert comparison.test == SIGN_FLIP and comparison.p_value == pytest.approx(0.25)
    assert verdict_of(comparison, comparison.p_value, 0.05, "min") == "indistinguishable"
