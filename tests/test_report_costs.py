"""Costs over seeds (tokens/s, peak memory, speed-ups; orchestrator/report/costs.py): geometric means with intervals
on the log scale, which hold the truth at their level and never go below 0, where the raw-scale t interval the
report printed before went negative for a cost that varies much over a few seeds (MQAR's hyper, -179 answers/s in
benchmarks/RESULTS.md). No MLflow store: the rows are built from run records, as `build_report` builds them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from orchestrator.report.compare import analyse
from orchestrator.report.costs import geometric_interval
from orchestrator.report.metrics import PEAK_MEMORY, TOKENS_PER_S, RunRecord, group_runs, summarize
from orchestrator.report.stats import mean_interval
from orchestrator.report.tables import rows_to_frame, rows_to_markdown


@pytest.mark.parametrize("seeds", [3, 5])
def test_cost_intervals_hold_the_true_geometric_mean_and_ratio_95_percent_of_the_time(seeds):
    """2,000 synthetic studies of lognormal throughput: a load shared by the methods on each seed (the trials of a
    seed ran side by side) and each run's own noise, both large (sd 0.6 in log). A method's interval is about its
    true geometric mean (1,000 tokens/s for the reference, 2,500 for the method), a per-seed ratio's (a speed-up) about
    the true ratio 2.5. The log-scale interval is exact for lognormal costs: the count's sd is 9.7, so [1855, 1945]
    is 4.6 sd each side of 95%. On the same draws the raw-scale t interval goes below 0 hundreds of times."""
    rng = np.random.default_rng(100 + seeds)
    studies, ratio = 2000, 2.5
    load = rng.normal(0.0, 0.6, size=(studies, seeds))
    reference = 1000.0 * np.exp(load + rng.normal(0.0, 0.6, (studies, seeds)))
    method = ratio * 1000.0 * np.exp(load + rng.normal(0.0, 0.6, (studies, seeds)))
    held = {"reference": 0, "method": 0, "ratio": 0}
    lowest = math.inf
    for i in range(studies):
        for name, values, truth in (("reference", reference[i], 1000.0), ("method", method[i], ratio * 1000.0),
                                    ("ratio", method[i] / reference[i], ratio)):
            interval = geometric_interval(values, 0.95)
            held[name] += truth in interval
            lowest = min(lowest, interval.low)
    assert all(1855 <= count <= 1945 for count in held.values()), held
    assert lowest > 0.0
    # The old interval on the same draws, for scale: mean - t sem below 0 in 2,000+ of the 6,000 (3 seeds: 4,636).
    values = np.concatenate([reference, method, method / reference])
    raw_low = values.mean(axis=1) - stats.t.ppf(0.975, seeds - 1) * stats.sem(values, axis=1)
    assert np.sum(raw_low < 0.0) > 2000


def _records(costs: dict[str, tuple[list[float], list[float]]]) -> list[RunRecord]:
    """One run per seed of each method: label -> (tokens/s per seed, peak memory per seed)."""
    return [RunRecord(f"{kind}-{seed}", {"model.attention.kind": kind, "optim.seed": str(seed),
                                         "params.attention": str(1000 * (i + 1))},
                      {"val/acc": 0.8 + 0.01 * seed + 0.02 * i, TOKENS_PER_S: tokens[seed], PEAK_MEMORY: memory[seed]})
            for i, (kind, (tokens, memory)) in enumerate(costs.items()) for seed in range(len(tokens))]


def _table(costs: dict[str, tuple[list[float], list[float]]]):
    records = _records(costs)
    summary = summarize(group_runs(records, ["model.attention.kind"]), "val/acc", "max", "mha", None)
    statistics = analyse(summary, "max")
    return summary, statistics, rows_to_frame(summary.rows, statistics).set_index("method")


def test_a_cost_that_varies_much_over_seeds_has_a_positive_interval_around_its_geometric_mean():
    """hyper's throughput over three seeds of a shared machine: 150, 2,000 and 300 tokens/s. The raw-scale t
    interval of their mean, 817, is [-1,736, 3,369]; the report's is that of their geometric mean, 448, on the log
    scale: [16, 12,534], wide (three seeds that far apart know little) but positive."""
    hyper = [150.0, 2000.0, 300.0]
    summary, statistics, table = _table({"mha": ([1000.0, 1100.0, 1050.0], [1.4, 1.5, 1.4]),
                                         "hyper": (hyper, [1.6, 2.9, 1.7])})
    assert mean_interval(hyper, 0.95).low < 0.0  # what the report printed before
    logs = np.log(hyper)
    low, high = np.exp(stats.t.interval(0.95, 2, loc=np.mean(logs), scale=stats.sem(logs)))
    row = table.loc["hyper"]
    assert row["tokens_per_s"] == pytest.approx(stats.gmean(hyper))
    assert [row["tokens_per_s_ci_low"], row["tokens_per_s_ci_high"]] == pytest.approx([low, high])
    assert 0.0 < row["tokens_per_s_ci_low"] < row["tokens_per_s"] < row["tokens_per_s_ci_high"]
    assert row["peak_memory_gb"] == pytest.approx(stats.gmean([1.6, 2.9, 1.7]))
    assert 0.0 < row["peak_memory_gb_ci_low"] < row["peak_memory_gb"]
    assert table.loc["mha", "peak_memory_gb"] == pytest.approx(stats.gmean([1.4, 1.5, 1.4]))
    assert f"| {stats.gmean(hyper):,.0f} |" in rows_to_markdown(summary.rows, "val/acc", "max", statistics)
    assert statistics.front_axes == ("score", "params", "tokens/s", "peak memory")


def test_a_cost_that_is_not_a_positive_number_is_left_blank_with_a_warning_not_a_crash():
    summary, statistics, table = _table({"mha": ([1000.0, 1100.0], [1.4, 1.5]),
                                         "lsh": ([900.0, 0.0], [1.6, math.nan])})
    assert math.isnan(table.loc["lsh", "tokens_per_s"]) and math.isnan(table.loc["lsh", "tokens_per_s_ci_low"])
    assert math.isnan(table.loc["lsh", "peak_memory_gb"]) and math.isnan(table.loc["lsh", "peak_memory_gb_ci_high"])
    assert table.loc["mha", "tokens_per_s"] == pytest.approx(stats.gmean([1000.0, 1100.0]))
    assert any(w.startswith(f"lsh: a logged {TOKENS_PER_S} of 0 is not a positive number") for w in summary.warnings)
    assert any(w.startswith(f"lsh: a logged {PEAK_MEMORY} of nan") for w in summary.warnings), summary.warnings
    assert statistics.front_axes == ("score", "params")  # a cost one method lacks is no axis of the front
    assert "| lsh | 2,000 | - | 2 | " in rows_to_markdown(summary.rows, "val/acc", "max", statistics)
    assert "| - | - |" in rows_to_markdown(summary.rows, "val/acc", "max", statistics)
