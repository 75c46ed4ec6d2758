"""A user's view of one tiny sweep, end to end with real processes: what the terminal shows, what
`orchestrator status` says, what the sweep's MLflow runs carry, and what the MLflow UI served by
`orchestrator ui` shows in a real browser (Chromium driven by Playwright).

One sweep (mha, mhe, sha; 20 steps each) is shared by the module; a `train --verbose` run checks what
--verbose brings back.
The browser tests skip, naming why, when Playwright or a Chromium binary is missing (`.ci/run` installs
both: Playwright from PyPI, Chromium from Debian; Playwright's own browser download is not used).
The browser's steps are docs/screenshots.py's, which makes the README's pictures (docs/img/) from the README's own
commands; set ORCHESTRATOR_SCREENSHOTS=<folder> to keep this tiny sweep's screenshots too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from docs import screenshots

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TINY = ["optim.max_steps=20", "optim.warmup_steps=2", "run.eval_every=10", "run.checkpoint_every=10",
        "run.log_every=5", "task.builtin.train_sentences=300", "task.builtin.eval_sentences=40"]
KINDS = ("mha heads=4", "mhe heads=4 mode=mul", "sha heads=4")


def _env() -> dict[str, str]:
    return screenshots.command_env(ROOT)


def _orchestrator(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, env=_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


class Sweep:
    def __init__(self, folder: Path):
        self.folder = folder
        self.storage = folder / "runs"
        self.uri = f"sqlite:///{folder / 'mlflow.db'}"
        self.overrides = [*TINY, f"run.storage_path={self.storage}", f"tracking.uri={self.uri}"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Sweep, str]:
    """The README's smoke sweep, tiny: three attention kinds, 20 steps each (about a minute on 2 cores)."""
    s = Sweep(tmp_path_factory.mktemp("user-view"))
    done = _orchestrator("sweep", str(ROOT / "configs" / "smoke.yaml"), *s.overrides, cwd=s.folder, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:]
    return s, done.stdout


# --- the terminal -------------------------------------------------------------------------------------


def test_sweep_prints_a_line_per_report_and_progress_lines_not_rays_chatter(sweep):
    _, out = sweep
    for kind in KINDS:  # one line per report: evaluation at step 10 and step 20 of each trial
        for step in (10, 20):
            assert re.search(rf"^\[\d{{5}} {kind}\] step {step}/20 \| train/loss [\d.]+ \| val/ppl [\d.]+$", out, re.M), out
    progress = re.findall(r"^sweep smoke: (\d)/3 done, (\d) running, (\d) pending, (\d) errored(.*)$", out, re.M)
    assert progress and progress[0][:4] == ("0", "1", "2", "0"), out  # the first trial starting
    assert ("3", "0", "0", "0") in [p[:4] for p in progress], out
    assert any(re.search(r"\| best val/ppl [\d.]+ \(\d{5} \w+.*\) \| [\d.]+ steps/s \| ETA \d+:\d\d:\d\d$", p[4])
               for p in progress), out
    # What Ray prints by default and a user should not have to read past:
    for noise in ("TrainingReport(", "Failed to query Ray Train Controller", "Trial status:", "(RayTrainWorker",
                  "Configuration for experiment", "Started training worker group", "Creating initial MLflow",
                  "Started a local Ray instance", "Token authentication is enabled"):
        assert noise not in out, f"{noise!r} in:\n{out[-3000:]}"


def test_verbose_train_brings_rays_output_back(tmp_path):
    """`train --verbose`: the worker's own line at every logging step and Ray Train's report log, which a run
    without --verbose leaves out for one line per report (tests/test_faults.py, the two launchers' consoles)."""
    spec = ROOT / "configs" / "smoke.yaml"
    common = [*TINY, "model.attention={kind: mha, heads: 4}", f"run.storage_path={tmp_path / 'runs'}",
              f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    verbose = _orchestrator("train", str(spec), *common, "name=loud", "--verbose", cwd=tmp_path, timeout=600)
    assert verbose.returncode == 0, verbose.stdout[-3000:]
    # The worker's line at every logging step (5, 10, 15, 20), and Ray Train's own report log.
    worker_lines = re.findall(r"\(RayTrainWorker pid=\d+\)(?:\x1b\[0m)? \[loud\] step \d+/20 \|", verbose.stdout)
    assert len(worker_lines) == 4, verbose.stdout
    assert "TrainingReport(" in verbose.stdout


# --- orchestrator status ------------------------------------------------------------------------------


def test_status_names_every_trial_its_checkpoint_the_best_and_the_mlflow_link(sweep):
    s, _ = sweep
    done = _orchestrator("status", "smoke", "--storage-path", str(s.storage), cwd=s.folder, timeout=120)
    assert done.returncode == 0, done.stdout
    out = done.stdout
    assert out.startswith("sweep smoke: MLflow FINISHED; launcher none"), out
    assert "trials: 3: 3 finished, 0 running, 0 failed, 0 stopped or unknown, 0 not started" in out, out
    for kind in KINDS:
        assert re.search(rf"FINISHED, step 20/20, val/ppl [\d.]+ \(best [\d.]+\), {kind} \(", out), out
    assert out.count("checkpoint_000000020") == 3, out
    assert re.search(r"^best so far: val/ppl [\d.]+ \(\w+ heads=4.*\)$", out, re.M), out
    assert re.search(r"^MLflow: http://127\.0\.0\.1:5000/#/experiments/\d+/runs/\w{32}\?workflowType=machine_learning ",
                     out, re.M), out


# --- MLflow -------------------------------------------------------------------------------------------


def _client(s: Sweep):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=s.uri)


def _runs(s: Sweep):
    client = _client(s)
    experiment = client.get_experiment_by_name("smoke")
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("orchestrator.role") == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return client, experiment, parent, children


def test_the_experiment_opens_on_its_training_runs_not_the_genai_overview(sweep):
    _, experiment, _, _ = _runs(sweep[0])
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"


def test_the_sweep_parent_carries_the_reports_comparison(sweep):
    client, _, parent, children = _runs(sweep[0])
    assert len(children) == 3
    by_kind = {c.data.params["model.attention.kind"]: c for c in children}
    best = min(children, key=lambda c: c.data.metrics["val/ppl"])
    tags, metrics = parent.data.tags, parent.data.metrics
    assert tags["sweep.best_run_id"] == best.info.run_id
    assert metrics["best/val/ppl"] == pytest.approx(best.data.metrics["val/ppl"])
    assert metrics["trials/finished"] == 3 and metrics["trials/errored"] == 0
    # PRR against MHA for a lower-is-better metric: 1 - (score - mha) / mha (orchestrator/report/metrics.py).
    mha, mhe = by_kind["mha"].data.metrics["val/ppl"], by_kind["mhe"].data.metrics["val/ppl"]
    expected = 1 - (mhe - mha) / mha
    prr = {key: value for key, value in metrics.items() if key.startswith("prr/")}
    assert prr["prr/mha"] == pytest.approx(1.0) and prr["prr/mhe"] == pytest.approx(expected, rel=1e-6), prr
    assert "PRR" in tags["mlflow.note.content"] and "| mhe" in tags["mlflow.note.content"], tags["mlflow.note.content"]
    files = {f.path for f in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.md", "report/report.csv", "report/score_vs_params.png",
            "report/parallel_coordinates.png"} <= files, files
    # Which knobs matter needs repeats: one run per method (orchestrator/report/importance.py) says so instead of
    # splitting seed noise among the knobs, and logs no importance.
    assert "report/importance.csv" not in files
    assert not any(key.startswith("importance/") for key in metrics), metrics
    report = Path(client.download_artifacts(parent.info.run_id, "report/report.md")).read_text()
    assert "hyperparameter importance not computed" in report and "tune.seeds" in report


def test_children_are_named_by_what_they_try_and_carry_the_swept_knobs_as_params(sweep):
    _, _, _, children = _runs(sweep[0])
    for child in children:
        kind = child.data.params["model.attention.kind"]
        assert child.info.run_name.startswith(f"{kind} heads=4"), child.info.run_name
        assert child.data.params["model.attention.heads"] == "4"
    assert {c.data.params.get("model.attention.mode") for c in children} >= {"mul"}


# --- the MLflow UI in a browser -----------------------------------------------------------------------
# Opening, tidying and photographing the pages is docs/screenshots.py's (the README's pictures come from it);
# here the same steps run on the tiny sweep, with assertions on what they show.


@pytest.fixture(scope="module")
def ui(sweep, tmp_path_factory):
    """`orchestrator ui` on the sweep's store, on a free port of 127.0.0.1; yields its base URL and output log."""
    try:
        screenshots.find_chromium()
    except screenshots.MissingTool as err:
        pytest.skip(str(err))
    s, _ = sweep
    log = tmp_path_factory.mktemp("ui") / "ui.log"
    with screenshots.serve_ui([str(ROOT / "configs" / "smoke.yaml"), f"tracking.uri={s.uri}"], cwd=s.folder,
                              env=_env(), port=screenshots.free_port(), log=log) as url:
        yield url, log


@pytest.fixture(scope="module")
def browser(ui):
    with screenshots.chromium() as chrome:
        yield chrome


def _pictures() -> Path | None:
    folder = os.environ.get("ORCHESTRATOR_SCREENSHOTS")
    return Path(folder) if folder else None


def test_ui_runs_page_shows_the_parent_and_its_children_by_attention_kind(sweep, ui, browser):
    s, _ = sweep
    url, log = ui
    _, experiment, parent, children = _runs(s)
    from orchestrator.tracking.read import ui_url

    # The experiment's own address opens on its training runs, not on MLflow 3's GenAI overview.
    page = screenshots.open_page(browser, ui_url(url, experiment.experiment_id))
    try:
        page.wait_for_url(re.compile(r"/#/experiments/\d+/(runs|overview)"))
        assert "/runs?" in page.url, page.url
    finally:
        page.close()
    # The link `orchestrator ui` prints: training runs, best first (children listed flat when sorted by a metric).
    link = screenshots.printed_link(log)
    assert link == ui_url(url, experiment.experiment_id, metric="val/ppl", mode="min"), link
    rows, kinds = screenshots.shoot_runs(browser, link, [c.info.run_name for c in children], _pictures())
    assert sorted(kinds) == sorted(["mha", "mhe", "sha", "-"]), kinds
    best = min(children, key=lambda c: c.data.metrics["val/ppl"])
    assert rows[0] == best.info.run_name and rows[-1] == "smoke", rows


def test_ui_parent_run_shows_the_reports_table_and_plot(sweep, ui, browser):
    s, _ = sweep
    url, _ = ui
    _, experiment, parent, _ = _runs(s)
    from orchestrator.tracking.read import ui_url

    run_page = ui_url(url, experiment.experiment_id, parent.info.run_id)
    screenshots.shoot_parent(browser, run_page, _pictures())
    # Which knobs matter, as a plot, drawn beside the score-vs-parameters one.
    screenshots.shoot_report_plot(browser, run_page, _pictures(), also=["parallel_coordinates.png"])
