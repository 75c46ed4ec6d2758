"""The report of a patching experiment (task.kind: pretrained_lm; orchestrator/report/patching.py): rows by
mechanism configuration and number of patched layers l, seeds as replicates, PRR and the paired test against the
unpatched model (l = 0), and the perplexity-and-speed-up-vs-l plot of HyperAttention's Figure 3.

A synthetic MLflow store holds a sweep as `orchestrator sweep` logs it: l in {0, 1, 2, 3} x two HyperAttention
block sizes x seeds 0-2, each configuration running its own l = 0 (the same unpatched model, so the same
perplexity on every seed). Expected numbers are scipy's on the same values.
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
from scipy import stats

from orchestrator.report.build import PARENT_TAG, ReportError, build_report, report_cli
from orchestrator.report.metrics import prr
from orchestrator.report.patching import REFERENCE, RunRecord, layer_count
from orchestrator.report.plots import patching_figure
from tests.ram_folder import ram_folder

SEEDS = 3
NOISE = stats.zscore(np.random.default_rng(5).normal(size=SEEDS), ddof=1)  # mean 0, sample std 1 exactly
UNPATCHED = 20.0
# block_size -> l -> (mean rise of perplexity over l = 0, spread over seeds in units of NOISE).
RISE = {64: {1: (0.0, 1.0), 2: (2.0, 0.1), 3: (5.0, 0.1)},
        128: {1: (0.5, 0.1), 2: (1.0, 0.1), 3: (2.0, 0.1)}}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IN_PROCESS_DRIFT = (0.0, 0.03, -0.02)


def _ppl(block: int, layers: int, seed: int) -> float:
    if layers == 0:
        return UNPATCHED
    rise, spread = RISE[block][layers]
    return UNPATCHED + rise + spread * NOISE[seed]


def _speedup(layers: int, seed: int, attention: bool) -> float:
    return 1.0 + (0.3 if attention else 0.1) * layers + 0.01 * seed


def _log(client: MlflowClient, experiment_id: str, block: int, layers: int, seed: int, *, parent: str | None = None,
         ppl: float | None = None, unpatched: float | None = UNPATCHED, extra: dict[str, str] | None = None) -> str:
    """One trial as the pretrained_lm task logs it: the flattened spec as params, val/ and test/ metrics."""
    run = client.create_run(experiment_id, tags={PARENT_TAG: parent} if parent else {})
    params = {"task.kind": "pretrained_lm", "task.pretrained": "models/tiny", "task.seq_len": "1024",
              "task.patch.layers": str(layers), "task.patch.attention.kind": "hyper",
              "task.patch.attention.block_size": str(block), "task.patch.attention.sample_size": "64",
              "task.patch.attention.min_seq_len": "128", "task.patch.attention.seed": "0",
              "task.patch.attention.causal_routing": "past_only", "optim.seed": str(seed), "optim.max_steps": "0",
              "model.attention.kind": "mha", "tune.metric": "val/ppl", "tune.mode": "min", **(extra or {})}
    value = _ppl(block, layers, seed) if ppl is None else ppl
    now = int(time.time() * 1000)
    metrics = []
    for split, shift in (("val", 0.0), ("test", 1.0)):  # the final evaluation's test/ copies, a little higher
        metrics += [Metric(f"{split}/ppl", value + shift, now, 0), Metric(f"{split}/loss", math.log(value + shift), now, 0),
                    Metric(f"{split}/patched_layers", float(layers), now, 0),
                    Metric(f"{split}/speedup", _speedup(layers, seed, False), now, 0),
                    Metric(f"{split}/attention_speedup", _speedup(layers, seed, True), now, 0),
                    Metric(f"{split}/forward_s", 2.0 / _speedup(layers, seed, False), now, 0),
                    Metric(f"{split}/forward_s_unpatched", 2.0, now, 0)]
        if unpatched is not None:  # task.time_unpatched: false logs none
            metrics.append(Metric(f"{split}/ppl_unpatched", unpatched + shift, now, 0))
    client.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()])
    client.set_terminated(run.info.run_id)
    return run.info.run_id


@pytest.fixture(scope="module")
def store() -> Iterator[dict[str, object]]:
    with ram_folder() as d:
        root = Path(d)
        uri = f"sqlite:///{root}/mlflow.db"
        client = MlflowClient(tracking_uri=uri)
        sweep = client.create_experiment("patch", artifact_location=(root / "a").as_uri())
        parent = client.create_run(sweep, run_name="sweep").info.run_id
        for block in RISE:
            for layers in range(4):
                for seed in range(SEEDS):
                    _log(client, sweep, block, layers, seed, parent=parent)
        client.set_terminated(parent)
        one = client.create_experiment("one-seed-reference", artifact_location=(root / "b").as_uri())
        _log(client, one, 64, 0, 0)  # l = 0 once: a constant reference
        for layers in (1, 2):
            for seed in range(SEEDS):
                _log(client, one, 64, layers, seed)
        unreferenced = client.create_experiment("no-l0", artifact_location=(root / "c").as_uri())
        for seed in range(2):
            _log(client, unreferenced, 64, 2, seed, unpatched=None)
        in_process = client.create_experiment("in-process", artifact_location=(root / "e").as_uri())
        for layers in (1, 2):  # no l = 0 run: the unpatched perplexity each run measured is the reference, here a
            for seed in range(SEEDS):  # little different per seed (as bf16 kernels on a GPU may give)
                _log(client, in_process, 64, layers, seed, unpatched=UNPATCHED + IN_PROCESS_DRIFT[seed])
        drifted = client.create_experiment("drifted", artifact_location=(root / "f").as_uri())
        for seed in range(2):
            _log(client, drifted, 64, 0, seed)
            _log(client, drifted, 64, 2, seed, unpatched=UNPATCHED + (0.5 if seed else 0.0))
        mixed = client.create_experiment("two-lengths", artifact_location=(root / "d").as_uri())
        for seq_len in ("1024", "2048"):
            for layers in (0, 1):
                _log(client, mixed, 64, layers, 0, extra={"task.seq_len": seq_len})
        yield {"uri": uri, "parent": parent}


@pytest.fixture(scope="module")
def report(store, tmp_path_factory):
    return build_report(store["uri"], "patch", parent_run_id=store["parent"], out_dir=tmp_path_factory.mktemp("r"),
                        log_to_mlflow=False)


def _row(table: pd.DataFrame, block: int, layers: int) -> pd.Series:
    rows = table[(table["mechanism"] == f"hyper block_size={block}") & (table["layers"] == layers)]
    assert len(rows) == 1, table[["method", "mechanism", "layers"]]
    return rows.iloc[0]


def _holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment written out here, independently of report_stats."""
    order = np.argsort(p_values)
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def test_the_table_is_scipys_paired_test_against_l0_per_configuration_and_l(report):
    table = report.table
    assert report.metric == "val/ppl" and report.reference == REFERENCE and report.patching is not None
    reference = table[table["method"] == REFERENCE].iloc[0]
    assert reference["layers"] == 0 and reference["n_runs"] == 2 * SEEDS and reference["score_mean"] == UNPATCHED
    assert reference["verdict"] == "n/a" and reference["seeds"] == "0 1 2"
    ref = np.full(SEEDS, UNPATCHED)
    p_values = {}
    for block, rises in RISE.items():
        for layers in rises:
            x = np.array([_ppl(block, layers, seed) for seed in range(SEEDS)])
            row = _row(table, block, layers)
            assert row["n_runs"] == SEEDS and row["test"] == "paired t" and row["n_compared"] == SEEDS
            assert row["score_mean"] == pytest.approx(np.mean(x))
            low, high = stats.t.interval(0.95, SEEDS - 1, loc=np.mean(x), scale=stats.sem(x))
            assert [row["score_ci_low"], row["score_ci_high"]] == pytest.approx([low, high])
            expected = stats.ttest_rel(x, ref)
            assert row["diff"] == pytest.approx(np.mean(x) - UNPATCHED)
            assert row["p_value"] == pytest.approx(expected.pvalue)
            ci = expected.confidence_interval(0.95)
            assert [row["diff_ci_low"], row["diff_ci_high"]] == pytest.approx([ci.low, ci.high])
            assert row["prr"] == pytest.approx(1.0 - (np.mean(x) - UNPATCHED) / UNPATCHED)
            assert row["prr"] == pytest.approx(prr(np.mean(x), UNPATCHED, "min"))
            assert row["prr_ci_low"] <= row["prr"] <= row["prr_ci_high"]
            # A speed-up is a ratio: the geometric mean over seeds, its t interval on the log scale mapped back.
            speedups = [_speedup(layers, seed, True) for seed in range(SEEDS)]
            logs = np.log(speedups)
            assert row["attention_speedup_mean"] == pytest.approx(stats.gmean(speedups))
            assert row["speedup_mean"] == pytest.approx(stats.gmean([_speedup(layers, s, False) for s in range(SEEDS)]))
            low, high = np.exp(stats.t.interval(0.95, SEEDS - 1, loc=np.mean(logs), scale=stats.sem(logs)))
            assert [row["attention_speedup_ci_low"], row["attention_speedup_ci_high"]] == pytest.approx([low, high])
            p_values[(block, layers)] = expected.pvalue
    # Holm over every (configuration, l) row against the one reference: six comparisons.
    for key, adjusted in zip(p_values, _holm(list(p_values.values()))):
        assert _row(table, *key)["p_holm"] == pytest.approx(adjusted)
    assert _row(table, 64, 3)["verdict"] == "worse" and _row(table, 64, 2)["verdict"] == "worse"
    assert _row(table, 64, 1)["verdict"] == "indistinguishable"  # same mean as l = 0, seed noise only
    assert "Holm's correction for 6 comparisons" in report.markdown


def test_the_files_hold_the_table_and_the_figure_3_plot(report):
    names = {path.name for path in report.files}
    assert {"report.md", "report.csv", "patching.png"} <= names
    assert (report.out_dir / "patching.png").read_bytes().startswith(PNG_SIGNATURE)
    csv = pd.read_csv(report.out_dir / "report.csv")
    assert len(csv) == 1 + 2 * 3 and sorted(set(csv["layers"])) == [0, 1, 2, 3]
    assert set(csv["mechanism"]) == {REFERENCE, "hyper block_size=64", "hyper block_size=128"}
    assert "| hyper block_size=64 | 3 | 3 |" in report.markdown and "![patching](patching.png)" in report.markdown
    assert "each row is paired with it on the seeds both ran" in report.markdown


def test_the_plot_draws_one_line_per_configuration_from_l0(report):
    from orchestrator.report.patching import _plot_lines

    figure = patching_figure(_plot_lines(report.patching.rows), "val/ppl", "min")
    score_axes, speed_axes = figure.axes
    drawn = {bars.get_label(): bars.lines[0] for bars in score_axes.containers}
    assert set(drawn) == {"hyper block_size=64", "hyper block_size=128"}
    for block in RISE:
        assert list(drawn[f"hyper block_size={block}"].get_xdata()) == [0, 1, 2, 3]
        means = [np.mean([_ppl(block, layers, s) for s in range(SEEDS)]) for layers in (1, 2, 3)]
        assert list(drawn[f"hyper block_size={block}"].get_ydata()) == pytest.approx([UNPATCHED, *means])
    speed = {line.get_label(): list(line.get_ydata()) for line in speed_axes.get_lines()}
    expected = [stats.gmean([_speedup(layers, s, True) for s in range(SEEDS)]) for layers in range(4)]
    assert speed["hyper block_size=64: attention"] == pytest.approx(expected)


def test_a_single_unpatched_seed_is_a_constant_reference_and_the_test_one_sample(store, tmp_path):
    report = build_report(store["uri"], "one-seed-reference", out_dir=tmp_path, log_to_mlflow=False)
    for layers in (1, 2):
        x = np.array([_ppl(64, layers, seed) for seed in range(SEEDS)])
        row = report.table[report.table["layers"] == layers].iloc[0]
        assert row["p_value"] == pytest.approx(stats.ttest_1samp(x, UNPATCHED).pvalue)
        assert row["n_compared"] == SEEDS
    assert report.table[report.table["layers"] == 0].iloc[0]["n_runs"] == 1
    assert "l = 0 ran one seed (0): its score is a constant reference" in report.markdown


def test_without_l0_the_unpatched_score_each_run_measured_is_the_reference(store, tmp_path):
    report = build_report(store["uri"], "in-process", out_dir=tmp_path, log_to_mlflow=False)
    reference = report.table[report.table["layers"] == 0].iloc[0]
    ref = UNPATCHED + np.array(IN_PROCESS_DRIFT)
    assert reference["score_mean"] == pytest.approx(np.mean(ref)) and reference["n_runs"] == 2 * SEEDS
    assert reference["speedup_mean"] == 1.0
    for layers in (1, 2):
        x = np.array([_ppl(64, layers, seed) for seed in range(SEEDS)])
        row = report.table[report.table["layers"] == layers].iloc[0]
        assert row["test"] == "paired t" and row["p_value"] == pytest.approx(stats.ttest_rel(x, ref).pvalue)
    assert "no l = 0 run, so the reference is `val/ppl_unpatched`" in report.markdown
    assert "each row is paired with it on the seeds both ran" in report.markdown
    assert not any("away from l = 0" in warning for warning in report.warnings)


def test_an_unpatched_score_that_drifts_from_l0_is_warned_about(store, tmp_path):
    report = build_report(store["uri"], "drifted", out_dir=tmp_path, log_to_mlflow=False)
    assert any("1 patched run(s) measured an unpatched val/ppl" in warning for warning in report.warnings)


def test_without_l0_or_with_two_settings_the_report_refuses(store, tmp_path):
    with pytest.raises(ReportError, match="no unpatched run .* and no run logged val/ppl_unpatched"):
        build_report(store["uri"], "no-l0", out_dir=tmp_path, log_to_mlflow=False)
    with pytest.raises(ReportError, match=r"task.seq_len: 1024, 2048"):
        build_report(store["uri"], "two-lengths", out_dir=tmp_path, log_to_mlflow=False)


def test_the_test_split_and_the_layer_count_fall_back_sensibly(store, report, tmp_path):
    tested = build_report(store["uri"], "patch", parent_run_id=store["parent"], metric="test/ppl", out_dir=tmp_path,
                          log_to_mlflow=False)
    assert tested.table[tested.table["method"] == REFERENCE].iloc[0]["score_mean"] == UNPATCHED + 1.0
    assert "`test/attention_speedup`" in tested.markdown
    assert layer_count(RunRecord("r", {"task.patch.layers": "last:3"}, {}), "val") == 3.0
    assert layer_count(RunRecord("r", {"task.patch.layers": "none"}, {}), "val") == 0.0
    assert layer_count(RunRecord("r", {"task.patch.layers": "all"}, {"test/patched_layers": 24.0}), "val") == 24.0
    assert layer_count(RunRecord("r", {"task.patch.layers": "every:2"}, {}), "val") is None


def test_the_command_prints_the_patching_table(store, tmp_path, capsys):
    code = report_cli(["--tracking-uri", store["uri"], "--experiment", "patch", "--out", str(tmp_path), "--no-log"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| Mechanism | l | Runs |" in printed and "| unpatched (l=0) | 0 | 6 |" in printed


def test_the_files_are_logged_under_report_of_the_sweeps_parent(store, tmp_path):
    report = build_report(store["uri"], "patch", parent_run_id=store["parent"], out_dir=tmp_path)
    assert report.mlflow_run_id == store["parent"]
    logged = {item.path for item in MlflowClient(tracking_uri=store["uri"]).list_artifacts(store["parent"], "report")}
    assert {"report/report.md", "report/report.csv", "report/patching.png"} <= logged
