"""docs/screenshots.py, which makes the README's pictures, is run by hand, not by CI: what it relies on is checked
here instead. The README still shows the commands it runs, and it reads `orchestrator ui`'s real output (the store
it serves, the link to the study's runs) and turns a run's page into its artifacts tab as MLflow's UI spells them.
"""

from __future__ import annotations

from pathlib import Path

from docs import screenshots
from orchestrator.cli import main
from orchestrator.tracking.read import ui_url

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_shows_the_commands_the_pictures_come_from_and_how_they_are_made():
    readme = (ROOT / "README.md").read_text()
    for command in screenshots.README_COMMANDS:
        assert f"\n{command}\n" in readme or f"`{command}`" in readme, command
    assert "python -m docs.screenshots --out docs/img" in readme
    for name in (screenshots.RUNS_PNG, screenshots.PARENT_PNG, screenshots.PLOT_PNG):
        assert (ROOT / "docs" / "img" / name).is_file(), name


def test_the_store_and_the_runs_link_are_read_from_what_orchestrator_ui_prints(tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = MlflowClient(tracking_uri=uri).create_experiment("smoke")
    started = []
    from orchestrator.tracking import ui

    # not MLflow's server itself: the command, and the links it prints once a server listens
    monkeypatch.setattr(ui, "run_server", lambda cmd, env, port, lines: started.append(cmd) or print(lines()) or 0)
    assert main(["ui", str(ROOT / screenshots.SPEC), f"tracking.uri={uri}", "--port", "5123"]) == 0
    assert started and "--port" in started[0]
    log = tmp_path / "ui.log"
    log.write_text(capsys.readouterr().out)
    link = screenshots.printed_link(log)
    assert link == ui_url("http://127.0.0.1:5123", experiment_id, metric="val/ppl", mode="min")
    assert screenshots.ui_store(log) == uri


def test_the_artifacts_tab_keeps_the_run_pages_workflow_switch():
    page = ui_url("http://127.0.0.1:5000", "3", "abc123")
    assert screenshots.artifacts_page(page) == \
        "http://127.0.0.1:5000/#/experiments/3/runs/abc123/artifacts?workflowType=machine_learning"
