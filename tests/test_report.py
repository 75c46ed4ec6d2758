"""Tests of `orchestrator report`: PRR / PEoP numbers, errors, plots and MLflow artifacts.

Expected values are the MHE paper's worked examples (arXiv 2310.07911, §4.1-4.2), written as the
arithmetic that produces them. BERT/GPT2-base attention parameters with W^O and no biases:
MHA 4·768² = 2,359,296, SHA 3·768·64 + 768² = 737,280, MHE 737,280 + 3·12·64 = 739,584.
One SQLite MLflow store is shared by the module because creating its schema costs seconds.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from orchestrator.report.build import PARENT_TAG, REPORT_TAG, Report, ReportError, build_report, report_cli
from orchestrator.report.metrics import (
    MethodGroup,
    RunRecord,
    default_group_keys,
    group_runs,
    infer_mode,
    peop,
    prr,
    summarize,
)
from orchestrator.report.pareto import pareto_front
from orchestrator.report.tables import rows_to_markdown

MHA_PARAMS = 4 * 768**2
SHA_PARAMS = 3 * 768 * 64 + 768**2
MHE_PARAMS = SHA_PARAMS + 3 * 12 * 64
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _log_run(
    client: MlflowClient,
    experiment_id: str,
    attention: dict[str, object],
    metric: str | None,
    final: float,
    *,
    params_attention: int | None,
    parent: str | None = None,
    seed: int = 0,
    extra_params: dict[str, str] | None = None,
    status: str = "FINISHED",
) -> str:
    """One trial as the trainer logs it: flattened spec params, derived sizes, metric history."""
    run = client.create_run(experiment_id, tags={PARENT_TAG: parent} if parent else {})
    params = {f"model.attention.{key}": str(value) for key, value in attention.items()}
    # Knobs the report must not group by: model width, dropout and the seed.
    params.update({"model.attention.d_model": "768", "model.attention.dropout": "0.1", "seed": str(seed)})
    if params_attention is not None:
        params["params.attention"] = str(params_attention)
        params["params.total"] = str(params_attention + 1_000_000)
    params.update(extra_params or {})
    now = int(time.time() * 1000)
    metrics = [Metric("train/tokens_per_s", 1000.0 + seed, now, 3), Metric("memory/peak_gb", 2.0, now, 3)]
    if metric is not None:
        # The curve moves towards the final value; the last step is what the report scores.
        direction = -1.0 if "ppl" in metric else 1.0
        metrics += [
            Metric(metric, final - direction * (3 - step), now + step, step * 100) for step in (1, 2, 3)
        ]
    client.log_batch(
        run.info.run_id, metrics=metrics, params=[Param(key, value) for key, value in params.items()]
    )
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def _log_seeds(client, experiment_id, attention, metric, mean, params_attention, parent=None, spread=0.5):
    """Two seeds at mean ± spread, so the seed mean is `mean` and the sample std spread·√2."""
    for seed, offset in enumerate((-spread, spread)):
        _log_run(client, experiment_id, attention, metric, mean + offset,
                 params_attention=params_attention, parent=parent, seed=seed)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    # SQLite syncs to disk on every commit; in RAM (/dev/shm) the ~70 commits below take a fifth of
    # the time, which matters on a shared CI box. Elsewhere pytest's temporary folder does the job.
    in_ram = Path("/dev/shm")
    if in_ram.is_dir() and os.access(in_ram, os.W_OK):
        with tempfile.TemporaryDirectory(dir=in_ram, prefix="test_report_") as folder:
            yield _fill_store(Path(folder))
    else:
        yield _fill_store(tmp_path_factory.mktemp("mlflow"))


def _fill_store(root: Path) -> dict[str, object]:
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)

    def experiment(name: str) -> str:
        return client.create_experiment(name, artifact_location=(root / "artifacts" / name).as_uri())

    # SQuAD v2.0 (direct metric, logged as val/bleu), one sweep: parent run with nested trials.
    squad = experiment("squad")
    parent = client.create_run(squad, run_name="sweep").info.run_id
    _log_seeds(client, squad, {"kind": "mha", "heads": 12}, "val/bleu", 76.5, MHA_PARAMS, parent)
    _log_seeds(client, squad, {"kind": "sha", "heads": 1}, "val/bleu", 67.6, SHA_PARAMS, parent)
    for mode, mean in (("mul", 72.3), ("add", 71.8)):
        mhe = {"kind": "mhe", "heads": 12, "mode": mode}
        _log_seeds(client, squad, mhe, "val/bleu", mean, MHE_PARAMS, parent)
    linformer = ((64, "none", 70.0), (128, "none", 71.0), (64, "layerwise", 69.0), (128, "layerwise", 70.5))
    for k, sharing, score in linformer:
        _log_run(client, squad, {"kind": "linformer", "heads": 12, "k": k, "sharing": sharing}, "val/bleu",
                 score, params_attention=MHA_PARAMS + 2 * k * 512, parent=parent)
    client.set_terminated(parent)

    # WikiText-103 (inverse metric), flat runs without a sweep parent; one crashed before evaluating.
    wikitext = experiment("wikitext")
    spec = {"tune.metric": "val/ppl", "tune.mode": "min"}
    for attention, mean, size in (
        ({"kind": "mha"}, 43.0, MHA_PARAMS),
        ({"kind": "sha"}, 62.0, SHA_PARAMS),
        ({"kind": "mhe", "mode": "mul"}, 53.8, MHE_PARAMS),
    ):
        for seed, offset in enumerate((-0.4, 0.4)):
            _log_run(client, wikitext, attention, "val/ppl", mean + offset, params_attention=size, seed=seed,
                     extra_params=spec)
    _log_run(client, wikitext, {"kind": "mha"}, None, 0.0, params_attention=MHA_PARAMS, seed=9,
             extra_params=spec)

    # An LM run and an MT run in one experiment: the metric exists for only one method.
    mixed = experiment("mixed")
    _log_run(client, mixed, {"kind": "mha"}, "val/bleu", 24.8, params_attention=MHA_PARAMS)
    _log_run(client, mixed, {"kind": "sha"}, "val/ppl", 62.0, params_attention=SHA_PARAMS)

    # Runs logged before the trainer recorded parameter counts.
    unsized = experiment("unsized")
    _log_run(client, unsized, {"kind": "mha"}, "val/bleu", 24.8, params_attention=None)
    _log_run(client, unsized, {"kind": "sha"}, "val/bleu", 22.5, params_attention=None)
    return {"uri": uri, "client": client, "squad_parent": parent, "root": root}


def _row(report: Report, method: str) -> pd.Series:
    table = report.table.set_index("method")
    assert method in table.index, f"{method!r} not in {list(table.index)}"
    return table.loc[method]


def _artifacts(client: MlflowClient, run_id: str) -> set[str]:
    return {item.path for item in client.list_artifacts(run_id, "report")}


def test_formulas_reproduce_paper_worked_examples():
    # SQuAD v2.0 MHE-MUL vs SHA (direct) and WikiText-103 MHE-MUL (inverse), stated 22.25 and 42.32.
    assert MHE_PARAMS / SHA_PARAMS - 1 == pytest.approx(0.003125)
    assert round(peop(72.3, 67.6, MHE_PARAMS, SHA_PARAMS, "max"), 2) == 22.25
    assert round(peop(53.8, 62.0, MHE_PARAMS, SHA_PARAMS, "min"), 2) == 42.32
    # Table 2: WikiText-103 MHE-MUL PRR 74.9%; Appendix D: GLUE MHE-MUL PRR 98.4%.
    assert round(100 * prr(53.8, 43.0, "min"), 1) == 74.9
    assert round(100 * prr(80.6, 81.9, "max"), 1) == 98.4
    assert math.isnan(peop(70.0, 67.6, SHA_PARAMS, SHA_PARAMS, "max"))


def test_metric_direction_is_inferred_from_the_name():
    assert [infer_mode(m) for m in ("val/ppl", "val/loss", "test/perplexity")] == ["min"] * 3
    assert [infer_mode(m) for m in ("val/bleu", "val/chrf", "val/acc", "val/f1")] == ["max"] * 4
    with pytest.raises(ReportError, match="mode="):
        infer_mode("val/rouge")


def test_labels_show_only_knobs_that_tell_methods_apart():
    def run(run_id: str, **attention: str) -> RunRecord:
        params = {f"model.attention.{key}": value for key, value in attention.items()}
        # Logged for every run but never a method knob: width, dropout, hashing seed, unset fields.
        params |= {"model.attention.d_model": "None", "model.attention.dropout": "0.1",
                   "model.attention.mechanism.seed": run_id, "model.embedding.kind": "standard"}
        return RunRecord(run_id, params, {"val/ppl": 1.0})

    runs = [
        run("1", kind="mha", heads="8", **{"mechanism.kind": "exact"}),
        run("2", kind="mha", heads="8", **{"mechanism.kind": "exact"}),
        run("3", kind="mha", heads="8", **{"mechanism.kind": "linformer", "mechanism.k": "64"}),
        run("4", kind="mhe", heads="8", mode="mul", **{"mechanism.kind": "exact"}),
    ]
    keys = default_group_keys(runs)
    assert keys == ["model.attention.kind", "model.attention.heads", "model.attention.mode",
                    "model.attention.mechanism.kind", "model.attention.mechanism.k", "model.embedding.kind"]
    groups = {group.label: [r.run_id for r in group.runs] for group in group_runs(runs, keys)}
    assert groups == {
        "mha mechanism.kind=exact": ["1", "2"],
        "mha mechanism.kind=linformer mechanism.k=64": ["3"],
        "mhe": ["4"],
    }


def test_memory_and_positions_define_methods_by_default_when_runs_differ_in_them():
    """A Transformer-XL study sweeps model.memory.mem_len and model.positional: without --group-by, runs with
    different memory are different methods; a study where every run has the same value keeps its labels."""
    def run(run_id: str, mem_len: str, positional: str = "relative") -> RunRecord:
        params = {"model.attention.kind": "mha", "model.attention.heads": "4", "model.positional": positional,
                  "model.memory.mem_len": mem_len, "model.reversible": "False"}
        return RunRecord(run_id, params, {"val/ppl": 1.0})

    runs = [run("1", "0"), run("2", "64"), run("3", "64"), run("4", "0", "sinusoidal")]
    keys = default_group_keys(runs)
    assert keys == ["model.attention.kind", "model.attention.heads", "model.positional", "model.memory.mem_len"]
    groups = {tuple(r.run_id for r in group.runs) for group in group_runs(runs, keys)}
    assert groups == {("1",), ("2", "3"), ("4",)}
    assert default_group_keys(runs[1:3]) == ["model.attention.kind", "model.attention.heads"]


def test_diverged_seed_is_reported_not_hidden():
    def group(label: str, *scores: float) -> MethodGroup:
        runs = tuple(RunRecord(f"{label}{i}", {}, {"val/ppl": score}) for i, score in enumerate(scores))
        return MethodGroup(label=label, kind=label, knobs={}, runs=runs)

    groups = [group("mha", 40.0, 42.0), group("lsh", 50.0, math.inf)]
    summary = summarize(groups, "val/ppl", "min", "mha", None)
    lsh = next(row for row in summary.rows if row.label == "lsh")
    assert not math.isfinite(lsh.score_mean) and not math.isfinite(lsh.prr)
    assert summary.warnings == ["lsh: 1 run(s) ended with a non-finite val/ppl (diverged?)"]
    # Undefined cells print as "-", never as "inf%" or "nan".
    assert "| lsh | - | - | 2 | - | - | - | - | - |" in rows_to_markdown(summary.rows, "val/ppl", "min")


def test_pareto_front_keeps_only_undominated_points():
    params = [1.0, 2.0, 3.0, 3.0, math.nan]
    assert pareto_front(params, [10.0, 12.0, 11.0, 13.0, 20.0], "max") == [True, True, False, True, False]
    assert pareto_front(params, [10.0, 12.0, 11.0, 9.0, 1.0], "min") == [True, False, False, True, False]


def test_direct_metric_table_and_artifacts_on_parent_run(store, tmp_path):
    client, parent = store["client"], store["squad_parent"]
    report = build_report(store["uri"], "squad", metric="val/bleu", parent_run_id=parent, out_dir=tmp_path)

    assert report.mode == "max" and report.reference == "mha" and report.lower_reference == "sha"
    assert list(report.table["method"][:2]) == ["mha", "sha"]
    mul = _row(report, "mhe mode=mul")
    assert mul["n_runs"] == 2
    assert mul["score_mean"] == pytest.approx(72.3)
    assert mul["score_std"] == pytest.approx(0.5 * math.sqrt(2))
    assert mul["prr"] == pytest.approx(72.3 / 76.5)
    assert mul["peop"] == pytest.approx((72.3 / 67.6 - 1) / (739584 / 737280 - 1))
    assert mul["params_attention"] == MHE_PARAMS and mul["params_total"] == MHE_PARAMS + 1_000_000
    assert mul["tokens_per_s"] == pytest.approx(1000.5) and mul["peak_memory_gb"] == pytest.approx(2.0)
    assert _row(report, "mhe mode=add")["peop"] == pytest.approx((71.8 / 67.6 - 1) / 0.003125)
    assert _row(report, "mha")["prr"] == pytest.approx(1.0)
    assert math.isnan(_row(report, "sha")["peop"])
    assert _row(report, "linformer k=128 sharing=layerwise")["n_runs"] == 1
    assert math.isnan(_row(report, "linformer k=128 sharing=layerwise")["score_std"])

    markdown = (tmp_path / "report.md").read_text()
    assert "| mhe mode=mul | 739,584 |" in markdown and "22.25" in markdown and "94.5%" in markdown
    assert pd.read_csv(tmp_path / "report.csv").shape == report.table.shape
    assert report.mlflow_run_id == parent
    assert _artifacts(client, parent) >= {
        "report/report.md", "report/report.csv", "report/score_vs_params.png", "report/curves.png",
        "report/knob_linformer_k.png",
    }


def test_plots_are_valid_pngs(store, tmp_path):
    report = build_report(store["uri"], "squad", metric="val/bleu", out_dir=tmp_path, log_to_mlflow=False)
    pngs = [path for path in report.files if path.suffix == ".png"]
    assert {path.name for path in pngs} == {"score_vs_params.png", "cost_front.png", "curves.png",
                                            "knob_linformer_k.png", "parallel_coordinates.png"}
    for path in pngs:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        assert path.stat().st_size > 10_000, f"{path.name} looks empty"
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 200
        assert image[..., :3].std() > 0.01, f"{path.name} is a blank canvas"


def test_inverse_metric_from_spec_defaults_logs_to_new_report_run(store, tmp_path):
    client = store["client"]
    report = build_report(store["uri"], "wikitext", out_dir=tmp_path)

    assert (report.metric, report.mode) == ("val/ppl", "min")
    # Only one MHE setting in this study, so its label needs no knob.
    mul = _row(report, "mhe")
    assert mul["prr"] == pytest.approx(1 - (53.8 - 43.0) / 43.0)
    assert mul["peop"] == pytest.approx(-(53.8 / 62.0 - 1) / (739584 / 737280 - 1))
    assert round(mul["peop"], 2) == 42.32
    assert "42.32" in report.markdown and "74.9%" in report.markdown
    # The crashed mha run has no val/ppl: skipped, said so, and not counted.
    assert _row(report, "mha")["n_runs"] == 2
    assert any("1 run(s) without 'val/ppl' skipped" in warning for warning in report.warnings)

    run = client.get_run(report.mlflow_run_id)
    assert run.info.run_name == "report" and run.data.tags[REPORT_TAG] == "true"
    assert "report/curves.png" in _artifacts(client, report.mlflow_run_id)
    # Reading the experiment again ignores the report run itself.
    again = build_report(store["uri"], "wikitext", out_dir=tmp_path / "again", log_to_mlflow=False)
    assert list(again.table["n_runs"]) == list(report.table["n_runs"])


def test_missing_reference_names_it_and_lists_methods(store, tmp_path):
    with pytest.raises(ReportError, match="'el_att' not found") as error:
        build_report(store["uri"], "squad", metric="val/bleu", reference="el_att", out_dir=tmp_path,
                     log_to_mlflow=False)
    assert "'mhe mode=mul'" in str(error.value) and "--reference" in str(error.value)


def test_ambiguous_reference_asks_for_a_full_label(store, tmp_path):
    with pytest.raises(ReportError, match="ambiguous.*'linformer k=128 sharing=layerwise'"):
        build_report(store["uri"], "squad", metric="val/bleu", reference="linformer", out_dir=tmp_path,
                     log_to_mlflow=False)


def test_full_label_reference_and_missing_lower_reference(store, tmp_path):
    report = build_report(store["uri"], "squad", metric="val/bleu", reference="linformer k=64 sharing=none",
                          lower_reference="skv", out_dir=tmp_path, log_to_mlflow=False)
    assert report.reference == "linformer k=64 sharing=none" and report.lower_reference is None
    assert _row(report, "linformer k=128 sharing=none")["prr"] == pytest.approx(71.0 / 70.0)
    # No SKV runs: PEoP is blank, with a warning, and the report is still written.
    assert report.table["peop"].isna().all()
    assert any("'skv' not found" in warning for warning in report.warnings)
    assert "'skv' not found" in (tmp_path / "report.md").read_text()


def test_unknown_experiment_lists_existing_ones(store, tmp_path):
    with pytest.raises(ReportError, match="'nope' does not exist.*'squad'.*'wikitext'"):
        build_report(store["uri"], "nope", out_dir=tmp_path)


def test_missing_sqlite_store_is_not_created(tmp_path):
    with pytest.raises(ReportError, match="no MLflow database at .*--tracking-uri"):
        build_report(f"sqlite:///{tmp_path}/typo.db", "squad", out_dir=tmp_path / "out")
    assert not (tmp_path / "typo.db").exists()


def test_unknown_metric_lists_logged_metrics(store, tmp_path):
    with pytest.raises(ReportError, match="'val/acc'.*memory/peak_gb, train/tokens_per_s, val/bleu"):
        build_report(store["uri"], "squad", metric="val/acc", out_dir=tmp_path)


def test_metric_missing_for_some_methods_is_an_error(store, tmp_path):
    with pytest.raises(ReportError, match="different metrics.*'sha' has \\['memory/peak_gb'"):
        build_report(store["uri"], "mixed", metric="val/bleu", out_dir=tmp_path)


def test_peop_needs_attention_params(store, tmp_path):
    with pytest.raises(ReportError, match="'params.attention'.*--lower-reference none"):
        build_report(store["uri"], "unsized", metric="val/bleu", out_dir=tmp_path)
    report = build_report(store["uri"], "unsized", metric="val/bleu", lower_reference=None, out_dir=tmp_path,
                          log_to_mlflow=False)
    assert _row(report, "sha")["prr"] == pytest.approx(22.5 / 24.8)
    assert "score_vs_params.png" not in {path.name for path in report.files}


def test_unknown_parent_run_lists_sweeps(store, tmp_path):
    listed = f"{store['squad_parent']} \\(sweep\\)"
    with pytest.raises(ReportError, match=f"not a run of experiment 'squad'.*{listed}"):
        build_report(store["uri"], "squad", parent_run_id="0" * 32, out_dir=tmp_path)


def test_group_by_override_pools_methods(store, tmp_path):
    report = build_report(store["uri"], "squad", metric="val/bleu", group_by=["model.attention.kind"],
                          out_dir=tmp_path, log_to_mlflow=False)
    assert _row(report, "mhe")["n_runs"] == 4
    assert _row(report, "mhe")["score_mean"] == pytest.approx((72.3 + 71.8) / 2)
    with pytest.raises(ReportError, match="model.attention.kind"):
        build_report(store["uri"], "squad", group_by=["model.attention.typo"], out_dir=tmp_path)


def test_cli_writes_report_and_reports_errors(store, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["--tracking-uri", store["uri"], "--experiment", "wikitext", "--out", str(out), "--no-log"]
    assert report_cli(argv) == 0
    printed = capsys.readouterr()
    assert "| mhe |" in printed.out and "warning: 1 run(s) without 'val/ppl' skipped" in printed.err
    assert (out / "report.md").exists() and (out / "report.csv").exists()
    assert report_cli([*argv, "--reference", "gqa"]) == 2
    assert "'gqa' not found" in capsys.readouterr().err


def test_runs_that_did_not_finish_are_left_out_unless_asked_for(store, tmp_path):
    """A FAILED or ASHA-stopped (KILLED) run ends at whatever value it last had; averaging it in would move a
    method's mean. Here both are far better than the finished runs, so including them would show."""
    client = store["client"]
    experiment_id = client.create_experiment("statuses")
    _log_seeds(client, experiment_id, {"kind": "mha"}, "val/ppl", 40.0, MHA_PARAMS)
    _log_seeds(client, experiment_id, {"kind": "sha"}, "val/ppl", 50.0, SHA_PARAMS)
    _log_run(client, experiment_id, {"kind": "mha"}, "val/ppl", 10.0, params_attention=MHA_PARAMS, seed=2,
             status="FAILED")
    _log_run(client, experiment_id, {"kind": "mha"}, "val/ppl", 4.0, params_attention=MHA_PARAMS, seed=3,
             status="KILLED")

    finished = build_report(store["uri"], "statuses", metric="val/ppl", out_dir=tmp_path / "a", log_to_mlflow=False)
    assert _row(finished, "mha")["n_runs"] == 2
    assert _row(finished, "mha")["score_mean"] == pytest.approx(40.0)
    assert any("2 run(s) left out by status (1 FAILED, 1 KILLED" in w for w in finished.warnings), finished.warnings

    everything = build_report(store["uri"], "statuses", metric="val/ppl", out_dir=tmp_path / "b",
                              log_to_mlflow=False, statuses=None)
    assert _row(everything, "mha")["n_runs"] == 4
    assert _row(everything, "mha")["score_mean"] == pytest.approx((39.5 + 40.5 + 10.0 + 4.0) / 4)

    with pytest.raises(ReportError, match="no run to compare has status RUNNING.*--status all"):
        build_report(store["uri"], "statuses", metric="val/ppl", out_dir=tmp_path / "c", log_to_mlflow=False,
                     statuses=["running"])
    with pytest.raises(ReportError, match=r"--status FINSHED: not an MLflow run status; use .*FINISHED.*or 'all'"):
        build_report(store["uri"], "statuses", metric="val/ppl", out_dir=tmp_path / "d", log_to_mlflow=False,
                     statuses=["finshed", "failed"])


def test_a_tracking_server_that_does_not_answer_is_refused_in_seconds_naming_the_flag(capsys):
    """MLflow's client retried for minutes against a dead server, then printed a urllib3 traceback."""
    import socket
    import time

    from orchestrator.report.build import report_cli

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again below: nothing listens there
    started = time.monotonic()
    assert report_cli(["--tracking-uri", f"http://127.0.0.1:{port}", "--experiment", "x", "--no-log"]) == 2
    err = capsys.readouterr().err
    assert f"the tracking server at http://127.0.0.1:{port} did not answer" in err and "--tracking-uri" in err
    assert time.monotonic() - started < 60


def test_a_tracking_server_that_answers_with_an_error_status_counts_as_answering():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from orchestrator.report.runs import check_store_exists

    class Locked(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Locked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_store_exists(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
