"""A report without its PRR reference, and which params the knob importance counts as knobs (QA findings 6, 9).

A sweep without mha (mhe against sha) still gets its report on the parent run, less PRR, PEoP and the tests, and
its description gives an `orchestrator report --reference` command that exists; `report --reference none` gives
the same table. Importance leaves out derived sizes (`flops_per_token`) and what restates the method (MHE's
`init_std` and `mode`), and is not computed when each configuration ran once. Stores are written directly, as in
tests/test_report_stats.py: no Ray.
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from orchestrator.launch.sweep_summary import summarize_sweep, summary_metrics
from orchestrator.report.build import PARENT_TAG, ReportError, build_report, report_cli
from orchestrator.tracking.describe import NOTE_TAG
from tests.ram_folder import ram_folder

# Per kind: its own attention params (MHE's exist only for it, as in configs/smoke.yaml), attention parameters,
# the FLOPs training derives from the spec, and a score.
KINDS = {
    "mha": ({}, 4000, 9.0e6, 6.0),
    "mhe": ({"init_std": "0.02", "mode": "mul"}, 1100, 7.0e6, 6.3),
    "sha": ({}, 1000, 6.5e6, 7.0),
}


def _log(client: MlflowClient, experiment_id: str, kind: str, seed: int, *, parent: str | None = None,
         attention: dict[str, str] | None = None, score: float | None = None, extra: dict[str, str] | None = None,
         ) -> str:
    """One trial as the worker logs it: the flattened spec, params.attention and flops_per_token, val/ppl."""
    own, size, flops, mean = KINDS[kind]
    run = client.create_run(experiment_id, tags={PARENT_TAG: parent} if parent else {})
    params = {"model.attention.kind": kind, "model.attention.heads": "4", "optim.seed": str(seed),
              "params.attention": str(size), "params.total": str(size + 50_000), "flops_per_token": str(flops),
              **{f"model.attention.{key}": value for key, value in {**own, **(attention or {})}.items()},
              **(extra or {})}
    value = (mean if score is None else score) + 0.05 * seed
    now = int(time.time() * 1000)
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()],
                     metrics=[Metric("val/ppl", value, now, 10), Metric("train/tokens_per_s", 100.0 + seed, now, 10),
                              Metric("memory/peak_gb", 1.0, now, 10)])
    client.set_terminated(run.info.run_id)
    return run.info.run_id


@pytest.fixture(scope="module")
def store() -> Iterator[dict[str, object]]:
    with ram_folder() as d:
        root = Path(d)
        uri = f"sqlite:///{root}/mlflow.db"
        client = MlflowClient(tracking_uri=uri)
        ids: dict[str, object] = {"uri": uri, "client": client, "root": root}
        # A sweep of mhe against sha, two seeds each: no mha.
        no_mha = client.create_experiment("no-mha", artifact_location=(root / "a").as_uri())
        parent = client.create_run(no_mha, run_name="sweep", tags={"orchestrator.role": "sweep"}).info.run_id
        for seed in (0, 1):
            for kind in ("mhe", "sha"):
                _log(client, no_mha, kind, seed, parent=parent)
        ids["parent"] = parent
        # The README's smoke study: one run per method.
        smoke = client.create_experiment("smoke", artifact_location=(root / "b").as_uri())
        for kind in KINDS:
            _log(client, smoke, kind, 0)
        # The same with two seeds each.
        seeded = client.create_experiment("seeded", artifact_location=(root / "c").as_uri())
        for seed in (0, 1):
            for kind in KINDS:
                _log(client, seeded, kind, seed)
        # MHE's mode varies within MHE (a knob of that method only), next to SHA; init_std stays one value.
        modes = client.create_experiment("modes", artifact_location=(root / "d").as_uri())
        for seed in (0, 1):
            _log(client, modes, "mhe", seed, attention={"mode": "add"}, score=6.6)
            _log(client, modes, "mhe", seed, attention={"mode": "mul"}, score=6.3)
            _log(client, modes, "sha", seed)
        # A knob every method has (the learning rate), crossed with the kind.
        crossed = client.create_experiment("crossed", artifact_location=(root / "e").as_uri())
        for seed in (0, 1):
            for kind in ("mha", "sha"):
                for lr in ("0.001", "0.002"):
                    _log(client, crossed, kind, seed, extra={"optim.lr": lr},
                         score=KINDS[kind][3] + (0.4 if lr == "0.001" else 0.0))
        yield ids


class _Tracker:
    """What summarize_sweep logs to the parent run, kept instead of sent."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.tags: dict[str, str] = {}

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        self.metrics.update(metrics)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def flush(self, run_id: str, force: bool = False) -> None:
        pass


def _trials(client: MlflowClient, parent: str) -> list[dict[str, object]]:
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  filter_string=f"tags.`{PARENT_TAG}` = '{parent}'")
    return [{"trial_id": f"t{i}", "state": "done", "mlflow_run_id": run.info.run_id,
             "config": {"model.attention": {"kind": run.data.params["model.attention.kind"]}},
             "metrics": {"val/ppl": run.data.metrics["val/ppl"]}} for i, run in enumerate(children)]


def test_a_sweep_without_mha_gets_its_report_without_prr_and_a_command_that_exists(store, tmp_path, capsys):
    client, parent = store["client"], store["parent"]
    tracker = _Tracker()
    summarize_sweep(tracking_uri=store["uri"], tracker=tracker, experiment="no-mha",  # type: ignore[arg-type]
                    parent_run_id=parent, name="no-mha", trials=_trials(client, parent), metric="val/ppl",
                    mode="min", out_dir=tmp_path / "report")
    files = {f.path for f in client.list_artifacts(parent, "report")}
    assert {"report/report.md", "report/report.csv", "report/score_vs_params.png", "report/cost_front.png",
            "report/curves.png", "report/parallel_coordinates.png", "report/importance.csv"} <= files, files
    table = pd.read_csv(tmp_path / "report" / "report.csv")
    assert table["method"].tolist() == ["mhe", "sha"] and table["score_ci_low"].notna().all()
    assert "on_front" in table and not {"prr", "peop", "p_value", "verdict"} & set(table.columns)
    assert not any(key.startswith(("prr/", "peop/", "diff/", "p_holm/")) for key in tracker.metrics)
    assert "importance/model.attention.kind" in tracker.metrics
    description = tracker.tags[NOTE_TAG]
    assert "| mhe" in description and "PRR |" not in description and "Pass --reference" not in description
    printed = capsys.readouterr().out
    # The command the description gives runs, and measures PRR against one of the sweep's methods.
    [command] = [part for part in description.split("`") if part.startswith("orchestrator report ")]
    assert command in printed and "--reference sha" in command and f"--parent-run {parent}" in command
    argv = shlex.split(command)[2:] + ["--out", str(tmp_path / "again"), "--no-log"]
    assert report_cli(argv) == 0
    assert pd.read_csv(tmp_path / "again" / "report.csv").set_index("method").loc["sha", "prr"] == 1.0


def test_reference_none_gives_the_table_without_prr_peop_or_tests(store, tmp_path, capsys):
    argv = ["--tracking-uri", store["uri"], "--experiment", "seeded", "--reference", "none", "--no-log",
            "--out", str(tmp_path)]
    assert report_cli(argv) == 0
    printed = capsys.readouterr().out
    assert "| mha" in printed and "PRR" not in printed.split("wrote")[0] and "p (Holm)" not in printed
    report = build_report(store["uri"], "seeded", reference="none", out_dir=tmp_path, log_to_mlflow=False)
    assert report.reference is None and report.lower_reference is None and report.without_reference
    assert {row_stats.verdict for row_stats in report.stats.rows.values()} == {"n/a"}
    assert not {"prr", "peop", "p_holm"} & set(report.table.columns) and report.table["on_front"].any()
    assert "No PRR, PEoP or tests against a reference" in report.markdown and "| PRR" not in report.markdown
    # Unchanged with the reference there, and a reference that is not there is still refused.
    assert build_report(store["uri"], "seeded", out_dir=tmp_path, log_to_mlflow=False).reference == "mha"
    with pytest.raises(ReportError, match="--reference none"):
        build_report(store["uri"], "no-mha", out_dir=tmp_path, log_to_mlflow=False)


def test_importance_is_not_computed_with_one_run_per_configuration(store, tmp_path):
    report = build_report(store["uri"], "smoke", out_dir=tmp_path, log_to_mlflow=False)
    assert report.importance == {} and not (tmp_path / "importance.csv").exists()
    assert any("3 configurations" in w and "tune.seeds" in w for w in report.warnings), report.warnings
    assert "per configuration" in report.markdown
    assert not any(key.startswith("importance/") for key in summary_metrics([], "val/ppl", "min", report.rows, report))


def test_importance_leaves_out_derived_sizes_and_what_restates_the_method(store, tmp_path):
    seeded = build_report(store["uri"], "seeded", out_dir=tmp_path, log_to_mlflow=False)
    assert set(seeded.importance) == {"model.attention.kind"}, seeded.importance  # not flops_per_token, init_std, mode
    modes = build_report(store["uri"], "modes", reference="none", out_dir=tmp_path, log_to_mlflow=False)
    assert set(modes.importance) == {"model.attention.kind"}, modes.importance  # mode is part of the method
    crossed = build_report(store["uri"], "crossed", out_dir=tmp_path, log_to_mlflow=False)
    assert set(crossed.importance) == {"model.attention.kind", "optim.lr"}, crossed.importance
    assert pd.read_csv(tmp_path / "importance.csv")["param"].tolist() == list(crossed.importance)


def test_a_param_only_one_method_varies_joins_that_methods_value():
    from orchestrator.report.importance import knobs, method_knobs
    from orchestrator.report.metrics import RunRecord

    runs = [RunRecord(f"{kind}{mode}{seed}", {"model.attention.kind": kind, "optim.seed": str(seed),
                                               **({"model.attention.mode": mode} if mode else {})}, {"val/ppl": 1.0})
            for kind, mode in (("mhe", "add"), ("mhe", "mul"), ("sha", "")) for seed in (0, 1)]
    folded, names = method_knobs(runs, knobs(runs))
    assert names == ["model.attention.kind"]
    assert sorted({run.params["model.attention.kind"] for run in folded}) == ["mhe mode=add", "mhe mode=mul", "sha"]


def test_a_search_of_twenty_drawn_points_gets_importance_without_repeats(tmp_path):
    """A random or Optuna search draws a new configuration every run: from MIN_RUNS_DRAWN runs fANOVA applies."""
    import numpy as np

    from orchestrator.report.importance import MIN_RUNS_DRAWN, importance
    from orchestrator.report.metrics import RunRecord

    rng = np.random.default_rng(0)
    lrs = rng.uniform(1e-4, 1e-2, MIN_RUNS_DRAWN)
    runs = [RunRecord(str(i), {"optim.lr": f"{lr:.6g}", "optim.seed": "0"}, {"val/ppl": 10 + 500 * lr + rng.normal()})
            for i, lr in enumerate(lrs)]
    warnings: list[str] = []
    scores, _ = importance(runs, "val/ppl", "min", tmp_path, warnings)
    assert set(scores) == {"optim.lr"} and not warnings
    scores, _ = importance(runs[:-1], "val/ppl", "min", tmp_path, warnings)
    assert scores == {} and "fewer than 20 in all" in warnings[-1]


def test_analyse_and_the_tables_without_a_reference_never_build_prr_peop_or_test_columns():
    """`reference=None` is the statistics' and the tables' own case: nothing is tested, and the CSV, the table and
    report.md are those with a reference less what measures against it."""
    from orchestrator.report.compare import analyse
    from orchestrator.report.metrics import RunRecord, group_runs, summarize
    from orchestrator.report.tables import markdown_document, rows_to_frame, rows_to_markdown

    records = [RunRecord(f"{kind}-{seed}", {"model.attention.kind": kind, "optim.seed": str(seed),
                                            "params.attention": str(KINDS[kind][1])},
                         {"val/ppl": KINDS[kind][3] + 0.05 * seed * (2 if kind == "mhe" else 1),
                          "train/tokens_per_s": 100.0 + seed})
               for kind in KINDS for seed in range(3)]
    groups = group_runs(records, ["model.attention.kind"])
    with_reference = summarize(groups, "val/ppl", "min", "mha", "sha")
    without = summarize(groups, "val/ppl", "min", None, None)
    stats_with, stats_without = analyse(with_reference, "min"), analyse(without, "min")
    assert stats_without.reference is None and stats_without.comparisons == 0 and stats_with.comparisons == 2
    assert {row.verdict for row in stats_without.rows.values()} == {"n/a"}
    assert all(row.comparison is None and math.isnan(row.prr) for row in stats_without.rows.values())
    frame = rows_to_frame(without.rows, stats_without).set_index("method")
    full = rows_to_frame(with_reference.rows, stats_with).set_index("method").loc[frame.index]
    against = ["prr", "peop", "prr_ci_low", "prr_ci_high", "peop_ci_low", "peop_ci_high", "test", "n_compared",
               "diff", "diff_ci_low", "diff_ci_high", "diff_ci_holm_low", "diff_ci_holm_high", "p_value", "p_holm",
               "sign_flip_p", "sign_flip_min_p", "verdict", "mdd", "seeds_needed", "test_note"]
    assert set(against) <= set(full.columns) and not set(against) & set(frame.columns)
    pd.testing.assert_frame_equal(frame, full.drop(columns=against))
    table = rows_to_markdown(without.rows, "val/ppl", "min", stats_without)
    assert table.splitlines()[0] == ("| Method | Attn params | Total params | Runs | val/ppl ↓ mean [95% CI] "
                                     "| tokens/s | Peak mem (GB) | Pareto front |")
    page = markdown_document("x", "val/ppl", "min", without, "all runs", 9, [], [], stats_without,
                             without_reference="`--reference none` asked for none")
    assert "- No PRR, PEoP or tests against a reference: `--reference none` asked for none." in page
    assert table in page and "PRR" not in page.replace("No PRR", "") and "p (Holm)" not in page
