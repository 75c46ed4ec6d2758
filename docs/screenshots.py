"""The README's screenshots (docs/img/*.png), made by running the README's own quick start and looking at the
MLflow UI the way it says, in headless Chromium driven by Playwright.

    python -m docs.screenshots --out docs/img    # from the repository root: 3 min 31 s measured on 2 cores

What it does, printing each step:

1. `git clone` of this checkout's commit into a fresh working folder (default `~/attention-orchestrator`; it
   must not exist yet), as the quick start's `git clone <this repository> && cd <it>`. The pictures therefore
   show a commit, not uncommitted edits (a dirty tree is warned about), and the paths MLflow shows (the
   artifact path, the checkpoints tag) are those of a user's clone, never a test's temporary folder.
2. The quick start's commands verbatim, each first checked to be in README.md (`README_COMMANDS`), so the
   pictures cannot drift from what the README tells a user to run: `orchestrator sweep configs/smoke.yaml`
   (the full smoke study, not a shortened one), then `orchestrator ui configs/smoke.yaml`. `orchestrator` is
   the clone's own CLI, run as `python -m orchestrator` with the clone on PYTHONPATH (what `pip install -e .`
   in the clone would give). The UI gets the README's default port 5000, or a free one when 5000 is taken
   (no picture shows the port).
3. Chromium opens the link `orchestrator ui` prints (the study's runs, best first) and the sweep's parent run,
   and writes `mlflow-runs.png`, `mlflow-sweep-parent.png` (the PRR / PEoP table of its description) and
   `mlflow-report-plot.png` (its `report/score_vs_params.png` artifact) to `--out`.

`orchestrator report --experiment smoke`, which the README names beside these, is not run: it makes no
picture, and the `report` run it logs would show on the runs page that the README's picture shows.
`--reuse` skips steps 1-2 for an existing working folder (to shoot again without training again).

Why a module run with `-m`, not a script file: tests/test_user_view.py drives the same pages with these
functions (`from docs.screenshots import ...`, as tests import `benchmarks.*`), so how the MLflow UI is opened,
tidied and photographed has one home; `-m` from the repository root also puts the checkout on sys.path without
installing it. Playwright (the `dev` extra) drives a system Chromium (Debian's `chromium`, or `CHROMIUM=path`);
Playwright's own browser download is not used. Without either, it stops before any work with the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = "configs/smoke.yaml"
README_COMMANDS = (f"orchestrator sweep {SPEC}", f"orchestrator ui {SPEC}")
"""The quick start's commands the pictures come from, as README.md prints them."""
UI_PORT = 5000
"""`orchestrator ui`'s default port (orchestrator/cli.py)."""
RUNS_PNG, PARENT_PNG, PLOT_PNG = "mlflow-runs.png", "mlflow-sweep-parent.png", "mlflow-report-plot.png"
VIEWPORT = {"width": 1600, "height": 900}
PAGE_TIMEOUT_MS = 120_000
"""A loaded 2-core machine renders MLflow's UI slowly."""
UI_START_S = 300.0
"""MLflow's server imports a lot; on a loaded 2-core machine it takes a while to answer."""


class MissingTool(RuntimeError):
    """Playwright or Chromium is not installed; the message says how to install it."""


def find_chromium() -> str:
    """Playwright for Python is importable and a Chromium binary exists (CHROMIUM, else `chromium` on PATH):
    that binary's path; MissingTool naming the fix otherwise."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        raise MissingTool("Playwright for Python is not installed: pip install -e '.[dev]' (or pip install "
                          "playwright); its own browser download is not needed") from None
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise MissingTool("no Chromium binary: apt-get install chromium, or set CHROMIUM=/path/to/chrome")
    return path


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """Headless Chromium (the system binary, `find_chromium`) under Playwright, closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=find_chromium(), args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def command_env(checkout: Path) -> dict[str, str]:
    """The environment the `orchestrator` commands run in: `checkout` importable first, and no Ray cluster
    address inherited (the quick start runs on a local Ray)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(checkout), os.environ.get("PYTHONPATH"))))}
    env.pop("RAY_ADDRESS", None)
    return env


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_ui(args: Sequence[str], *, cwd: Path, env: dict[str, str], port: int, log: Path) -> Iterator[str]:
    """`orchestrator ui ARGS` (with `--port PORT` unless PORT is its default) in its own process group until the
    block ends; yields the UI's base URL once it answers /health. Its output goes to `log` (read the printed
    links there), not to a pipe that would fill and stall the server."""
    url = f"http://127.0.0.1:{port}"
    port_args = [] if port == UI_PORT else ["--port", str(port)]
    with open(log, "w") as out:
        # Unbuffered: the links it prints before starting MLflow's server reach the log now, not at its exit.
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", *args, *port_args], cwd=cwd,
                                env={**env, "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + UI_START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"orchestrator ui exited ({proc.returncode}) before serving {url}:\n"
                                   f"{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                # and the links, which the command prints once the server listens (just after /health answers)
                if response.status == 200 and "MLflow UI on" in log.read_text():
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"orchestrator ui did not serve {url} within {UI_START_S:.0f} s:\n"
                                   f"{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def printed_link(log: Path) -> str:
    """The link `orchestrator ui SPEC` prints to the study's runs, best first."""
    found = re.search(r"^the study's runs, best first: (\S+)$", log.read_text(), re.M)
    if not found:
        raise RuntimeError(f"orchestrator ui printed no link to the study's runs:\n{log.read_text()[-3000:]}")
    return found.group(1)


def ui_store(log: Path) -> str:
    """The tracking URI `orchestrator ui` printed it serves."""
    found = re.search(r"^MLflow UI on (\S+): http", log.read_text(), re.M)
    if not found:
        raise RuntimeError(f"orchestrator ui did not say which store it serves:\n{log.read_text()[-3000:]}")
    return found.group(1)


def open_page(browser, url: str):
    """A new page of the screenshots' size at `url`."""
    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    page.goto(url)
    return page


def close_assistant(page) -> None:
    """MLflow 3.17 opens its assistant panel beside the page on first visit; it hides the table's right half."""
    close = page.locator('[aria-label="Close"]').first
    try:
        close.wait_for(timeout=20_000)
    except Exception:  # noqa: BLE001 - a UI without the panel
        return
    close.click()


def save(page, out: Path | None, name: str) -> None:
    """A screenshot of the page as `out/name`; nothing without `out`."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out / name))
    print(f"wrote {out / name}")


RUNS_COLUMNS = {"drop": ("Dataset", "Source", "Models"), "add": ("val/ppl", "model.attention.kind")}
"""The runs table's columns for the picture: the metric it is sorted by and the method, not MLflow's empty
dataset, source and model columns."""


def shoot_runs(browser, link: str, run_names: Sequence[str], out: Path | None) -> tuple[list[str], list[str]]:
    """The runs page at `link` (sorted best first) once every run of `run_names` shows, with the columns of
    RUNS_COLUMNS; returns the run names top to bottom and the attention-kind cells, and saves RUNS_PNG."""
    page = open_page(browser, link)
    try:
        page.get_by_text("smoke", exact=True).first.wait_for()
        close_assistant(page)
        for name in run_names:
            page.get_by_text(name, exact=True).wait_for()
        page.get_by_test_id("column-selection-dropdown").first.click()  # the second opens a menu variant
        search = page.get_by_placeholder("Search columns")
        for column in (*RUNS_COLUMNS["drop"], *RUNS_COLUMNS["add"]):  # each click toggles the column
            search.fill(column)
            page.locator(".du-bois-light-tree-title", has_text=re.compile(f"^{re.escape(column)}$")).first.click()
        page.keyboard.press("Escape")
        cells = page.locator('[role="gridcell"][col-id="params.`model.attention.kind`"]')
        cells.first.wait_for()
        # A name cell also holds the run's colour picker ("#e65b77"): the name is its last line.
        rows = [cell.strip().splitlines()[-1] for cell in
                page.locator('[role="gridcell"][col-id="attributes.`Run Name`"]').all_inner_texts()]
        save(page, out, RUNS_PNG)
        return rows, cells.all_inner_texts()
    finally:
        page.close()


def shoot_parent(browser, run_page: str, out: Path | None) -> None:
    """A sweep's parent run at `run_page` (a `ui_url` with a run id) with its description unfolded: the best
    trial and the PRR / PEoP table, rendered; saves PARENT_PNG."""
    page = open_page(browser, run_page)
    try:
        close_assistant(page)
        table = page.get_by_text("PRR / PEoP", exact=False).first  # the description: the report's table
        table.wait_for()
        page.get_by_text("Best trial:", exact=False).first.wait_for()
        page.get_by_role("cell", name=re.compile(r"^mhe")).first.wait_for()  # a row of the rendered table
        more = page.get_by_text("Show more", exact=True)
        if more.count():  # the UI folds a long description
            more.first.click()
        table.scroll_into_view_if_needed()
        save(page, out, PARENT_PNG)
    finally:
        page.close()


def artifacts_page(run_page: str) -> str:
    """The artifacts tab of the run page `run_page` (a `ui_url` with a run id)."""
    base, _, query = run_page.partition("?")
    return f"{base}/artifacts" + (f"?{query}" if query else "")


def show_artifact_image(page, name: str) -> None:
    """Click the image artifact `name` in the open artifact tree and wait until the UI has drawn it."""
    page.get_by_text(name, exact=True).first.click()
    image = page.locator('img[src^="blob:"]').first  # the UI fetches the artifact, shows it from a blob
    image.wait_for()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())


def shoot_report_plot(browser, run_page: str, out: Path | None, also: Sequence[str] = ()):
    """The parent run's `report/score_vs_params.png` in the UI's artifact viewer (saves PLOT_PNG), then each
    image of `also` under `report/` the same way (checked drawn, not saved)."""
    page = open_page(browser, artifacts_page(run_page))
    try:
        close_assistant(page)
        page.get_by_text("report", exact=True).first.click()
        show_artifact_image(page, "score_vs_params.png")
        # Selecting a file redraws the tree with that file alone for a moment, then the folder's whole listing
        # again: wait for it (report.md: every report writes one) to show what a user sees.
        page.get_by_text("report.md", exact=True).first.wait_for()
        save(page, out, PLOT_PNG)
        for name in also:
            show_artifact_image(page, name)
    finally:
        page.close()


# --- the command -------------------------------------------------------------------------------------------


def _check_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for command in README_COMMANDS:
        if command not in readme:
            sys.exit(f"README.md no longer shows `{command}`: update README_COMMANDS in docs/screenshots.py "
                     "to the quick start's commands")


def _run(args: Sequence[str], *, cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run a command with its output passed through; stop on failure."""
    done = subprocess.run(list(args), cwd=cwd, env=env)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(args)}")


def _clone(workdir: Path) -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
    if dirty:
        print(f"warning: {ROOT} has uncommitted changes; the pictures show commit {head.stdout.strip()[:12]}")
    print(f"$ git clone {ROOT} {workdir}   # commit {head.stdout.strip()[:12]}")
    _run(["git", "clone", "--quiet", str(ROOT), str(workdir)], cwd=ROOT)
    _run(["git", "checkout", "--quiet", "--detach", head.stdout.strip()], cwd=workdir)


def _sweep_pages(log: Path, link: str, ui: str) -> tuple[list[str], str]:
    """The trials' run names and the parent run's page of the newest sweep in the store `orchestrator ui`
    serves, in the experiment of the link it printed."""
    from orchestrator.tracking.describe import ROLE_TAG
    from orchestrator.tracking.read import TrackingReader, ui_url

    uri, experiment_id = ui_store(log), re.search(r"/#/experiments/(\w+)/", link).group(1)
    reader = TrackingReader(uri)
    parents = reader.runs_with_tag(experiment_id, ROLE_TAG, "sweep")  # oldest first
    if not parents:
        sys.exit(f"no sweep's parent run in experiment {experiment_id} of {uri}")
    children = reader.children(experiment_id, parents[-1].info.run_id)
    return [child.info.run_name for child in children], ui_url(ui, experiment_id, parents[-1].info.run_id)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.screenshots", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go (docs/img)")
    parser.add_argument("--workdir", type=Path, default=Path.home() / "attention-orchestrator",
                        help="a new folder to clone into and run the quick start in (~/attention-orchestrator)")
    parser.add_argument("--reuse", action="store_true",
                        help="the working folder already holds the sweep: skip the clone and the sweep")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # our lines in order with the commands' own output
    out, workdir = args.out.resolve(), args.workdir.expanduser().resolve()
    try:
        print(f"Chromium: {find_chromium()}")
    except MissingTool as err:
        sys.exit(f"cannot take screenshots: {err}")
    _check_readme()
    env = command_env(workdir)
    if args.reuse:
        if not (workdir / SPEC).is_file():
            sys.exit(f"--reuse: {workdir} holds no {SPEC}; run without --reuse to clone and sweep there")
        print(f"reusing the sweep in {workdir}")
    else:
        if workdir.exists():
            sys.exit(f"{workdir} exists: remove it, pass --workdir NEW_FOLDER, or --reuse to shoot its sweep again")
        _clone(workdir)
        print(f"$ cd {workdir}")
        print(f"$ {README_COMMANDS[0]}   # as python -m orchestrator, the clone on PYTHONPATH")
        _run([sys.executable, "-m", "orchestrator", *README_COMMANDS[0].split()[1:]], cwd=workdir, env=env)
    port = UI_PORT if port_free(UI_PORT) else free_port()
    log = workdir / "ui.log"
    note = "" if port == UI_PORT else f"   # port {UI_PORT} is taken: --port {port}"
    print(f"$ {README_COMMANDS[1]}{note}   (output in {log})")
    with serve_ui(README_COMMANDS[1].split()[2:], cwd=workdir, env=env, port=port, log=log) as ui:
        link = printed_link(log)
        print(f"MLflow UI at {ui}; the study's runs: {link}")
        names, parent_page = _sweep_pages(log, link, ui)
        with chromium() as browser:
            rows, _ = shoot_runs(browser, link, names, out)
            print(f"runs page, top to bottom: {', '.join(rows)}")
            shoot_parent(browser, parent_page, out)
            shoot_report_plot(browser, parent_page, out)
    print(f"done: {RUNS_PNG}, {PARENT_PNG}, {PLOT_PNG} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
