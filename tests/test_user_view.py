"""A user's view of one tiny sweep, end to end with real processes: what the terminal shows, what
`orchestrator status` says, what the sweep's MLflow runs carry, and what the MLflow UI served by
`orchestrator ui` shows in a real browser (Chromium driven by Playwright).

One sweep (mha, mhe, sha; 20 steps each) is shared by the module; a `train` run checks the single-run lines.
The browser tests skip, naming why, when Playwright or a Chromium binary is missing (`.ci/run` installs
both: Playwright from PyPI, Chromium from Debian; Playwright's own browser download is not used).
Set ORCHESTRATOR_SCREENSHOTS=<folder> to keep the browser's screenshots (docs/img/ holds the committed ones).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TINY = ["optim.max_steps=20", "optim.warmup_steps=2", "run.eval_every=10", "run.checkpoint_every=10",
        "run.log_every=5", "task.builtin.train_sentences=300", "task.builtin.eval_sentences=40"]
KINDS = ("mha heads=4", "mhe heads=4 mode=mul", "sha heads=4")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    env.pop("RAY_ADDRESS", None)
    return env


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


def test_train_prints_a_line_per_report_and_verbose_brings_rays_output_back(tmp_path):
    spec = ROOT / "configs" / "smoke.yaml"
    common = [*TINY, "model.attention={kind: mha, heads: 4}", f"run.storage_path={tmp_path / 'runs'}",
              f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    quiet = _orchestrator("train", str(spec), *common, "name=quiet", cwd=tmp_path, timeout=600)
    assert quiet.returncode == 0, quiet.stdout[-3000:]
    lines = re.findall(r"^\[quiet\] step (\d+)/20 \| train/loss [\d.]+ \| val/ppl [\d.]+$", quiet.stdout, re.M)
    assert lines == ["10", "20"], quiet.stdout
    assert "TrainingReport(" not in quiet.stdout and "(RayTrainWorker" not in quiet.stdout, quiet.stdout[-3000:]
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
    # PRR against MHA for a lower-is-better metric: 1 - (score - mha) / mha (orchestrator/report_metrics.py).
    mha, mhe = by_kind["mha"].data.metrics["val/ppl"], by_kind["mhe"].data.metrics["val/ppl"]
    expected = 1 - (mhe - mha) / mha
    prr = {key: value for key, value in metrics.items() if key.startswith("prr/")}
    assert prr["prr/mha"] == pytest.approx(1.0) and prr["prr/mhe"] == pytest.approx(expected, rel=1e-6), prr
    assert "PRR" in tags["mlflow.note.content"] and "| mhe" in tags["mlflow.note.content"], tags["mlflow.note.content"]
    files = {f.path for f in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.md", "report/report.csv", "report/score_vs_params.png", "report/importance.csv",
            "report/parallel_coordinates.png"} <= files, files
    # Which knobs matter: fANOVA importances (orchestrator/report_importance.py) on the parent, summing to 1.
    importance = {key: value for key, value in metrics.items() if key.startswith("importance/")}
    assert importance and sum(importance.values()) == pytest.approx(1.0), importance


def test_children_are_named_by_what_they_try_and_carry_the_swept_knobs_as_params(sweep):
    _, _, _, children = _runs(sweep[0])
    for child in children:
        kind = child.data.params["model.attention.kind"]
        assert child.info.run_name.startswith(f"{kind} heads=4"), child.info.run_name
        assert child.data.params["model.attention.heads"] == "4"
    assert {c.data.params.get("model.attention.mode") for c in children} >= {"mul"}


# --- the MLflow UI in a browser -----------------------------------------------------------------------


def _chromium() -> str:
    """Debian's Chromium (or one named by CHROMIUM); the reason to skip when there is none."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("Playwright for Python is not installed (pip install -e '.[dev]')")
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no Chromium binary (apt-get install chromium, or set CHROMIUM=/path/to/chrome)")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ui(sweep):
    """`orchestrator ui` on the sweep's store, on a free port of 127.0.0.1; ended by its pid."""
    _chromium()
    s, _ = sweep
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", str(ROOT / "configs" / "smoke.yaml"),
                             f"tracking.uri={s.uri}", "--port", str(port)], cwd=s.folder, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # MLflow's server imports a lot; a loaded 2-core machine takes a while
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"orchestrator ui did not serve {url}: {proc.stdout.read() if proc.poll() is not None else ''}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser(ui):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            yield chrome
        finally:
            chrome.close()


def _screenshot(page, name: str) -> None:
    folder = os.environ.get("ORCHESTRATOR_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name))


def _open(browser, url: str):
    page = browser.new_page(viewport={"width": 1600, "height": 900})
    page.set_default_timeout(120_000)  # a loaded 2-core machine renders MLflow's UI slowly
    page.goto(url)
    return page


def _close_assistant(page) -> None:
    """MLflow 3.17 opens its assistant panel beside the page on first visit; it hides the table's right half."""
    close = page.locator('[aria-label="Close"]').first
    try:
        close.wait_for(timeout=20_000)
    except Exception:  # noqa: BLE001 - a UI without the panel
        return
    close.click()


def test_ui_runs_page_shows_the_parent_and_its_children_by_attention_kind(sweep, ui, browser):
    s, _ = sweep
    _, experiment, parent, children = _runs(s)
    from orchestrator.tracking.read import ui_url

    # The experiment's own address opens on its training runs, not on MLflow 3's GenAI overview.
    page = _open(browser, ui_url(ui, experiment.experiment_id))
    try:
        page.wait_for_url(re.compile(r"/#/experiments/\d+/(runs|overview)"))
        assert "/runs?" in page.url, page.url
    finally:
        page.close()
    # The link `orchestrator ui` prints: training runs, best first (children listed flat when sorted by a metric).
    page = _open(browser, ui_url(ui, experiment.experiment_id, metric="val/ppl", mode="min"))
    try:
        page.get_by_text("smoke", exact=True).first.wait_for()
        _close_assistant(page)
        for child in children:
            page.get_by_text(child.info.run_name, exact=True).wait_for()
        page.get_by_test_id("column-selection-dropdown").first.click()  # the second opens a menu variant
        search = page.get_by_placeholder("Search columns")
        for column in ("Dataset", "Source", "Models", "val/ppl", "model.attention.kind"):  # drop 3, add 2
            search.fill(column)
            page.locator(".du-bois-light-tree-title", has_text=re.compile(f"^{re.escape(column)}$")).first.click()
        page.keyboard.press("Escape")
        cells = page.locator('[role="gridcell"][col-id="params.`model.attention.kind`"]')
        cells.first.wait_for()
        assert sorted(cells.all_inner_texts()) == sorted(["mha", "mhe", "sha", "-"]), cells.all_inner_texts()
        # A name cell also holds the run's colour picker ("#e65b77"): the name is its last line.
        rows = [cell.strip().splitlines()[-1] for cell in
                page.locator('[role="gridcell"][col-id="attributes.`Run Name`"]').all_inner_texts()]
        best = min(children, key=lambda c: c.data.metrics["val/ppl"])
        assert rows[0] == best.info.run_name and rows[-1] == "smoke", rows
        _screenshot(page, "mlflow-runs.png")
    finally:
        page.close()


def test_ui_parent_run_shows_the_reports_table_and_plot(sweep, ui, browser):
    s, _ = sweep
    _, experiment, parent, _ = _runs(s)
    base = f"{ui}/#/experiments/{experiment.experiment_id}/runs/{parent.info.run_id}"
    page = _open(browser, f"{base}?workflowType=machine_learning")
    try:
        _close_assistant(page)
        table = page.get_by_text("PRR / PEoP", exact=False).first  # the description: the report's table
        table.wait_for()
        page.get_by_text("Best trial:", exact=False).first.wait_for()
        page.get_by_role("cell", name=re.compile(r"^mhe")).first.wait_for()  # a row of the rendered table
        more = page.get_by_text("Show more", exact=True)
        if more.count():  # the UI folds a long description
            more.first.click()
        table.scroll_into_view_if_needed()
        _screenshot(page, "mlflow-sweep-parent.png")
        page.goto(f"{base}/artifacts?workflowType=machine_learning")
        page.get_by_text("report", exact=True).first.click()
        page.get_by_text("score_vs_params.png", exact=True).first.click()
        image = page.locator('img[src^="blob:"]').first  # the UI fetches the artifact, shows it from a blob
        image.wait_for()
        page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())
        _screenshot(page, "mlflow-report-plot.png")
        page.get_by_text("parallel_coordinates.png", exact=True).first.click()  # which knobs matter, as a plot
        page.locator('img[src^="blob:"]').first.wait_for()
    finally:
        page.close()
