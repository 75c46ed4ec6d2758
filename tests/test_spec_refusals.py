"""Inputs that used to pass validation and fail later (in a Ray worker, after the cluster was spent) or do harm:
non-finite or negative numbers, credentials in the tracking URI, names that are not one short path component.
Each is refused before Ray with the field and the fix."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.spec import SpecError, validate_spec
from tests.test_spec import base_raw

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("section, field", [
    ("optim", "lr"), ("optim", "weight_decay"), ("optim", "grad_clip"), ("tracking", "timeout_s"),
    ("run", "cpus_per_worker"), ("run", "gpus_per_worker"),
])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_non_finite_number_is_refused_naming_its_field(tmp_path, section, field, value):
    with pytest.raises(SpecError, match=rf"{section}\.{field}: must be a finite number \(got {value}\)"):
        raw = base_raw(run={"storage_path": str(tmp_path)})
        raw[section] = {**raw.get(section, {}), field: value}
        validate_spec(raw)


def test_a_negative_weight_decay_is_refused_and_zero_accepted(tmp_path):
    with pytest.raises(SpecError, match=r"optim.weight_decay must be >= 0 \(got -0.1\)"):
        validate_spec(base_raw(optim={"weight_decay": -0.1}, run={"storage_path": str(tmp_path)}))
    assert validate_spec(base_raw(optim={"weight_decay": 0.0}, run={"storage_path": str(tmp_path)})).optim.weight_decay == 0


@pytest.mark.parametrize("uri", ["http://alice:secret@127.0.0.1:5000", "https://token@mlflow.example.org"])
def test_credentials_in_the_tracking_uri_are_refused_with_the_environment_variables_to_use(tmp_path, uri):
    with pytest.raises(SpecError, match="tracking.uri must not hold credentials.*MLFLOW_TRACKING_USERNAME") as err:
        validate_spec(base_raw(tracking={"uri": uri}, run={"storage_path": str(tmp_path)}))
    assert "secret" not in str(err.value) and "token@" not in str(err.value)


def test_a_server_uri_without_credentials_is_accepted(tmp_path):
    spec = validate_spec(base_raw(tracking={"uri": "http://127.0.0.1:5000"}, run={"storage_path": str(tmp_path)}))
    assert spec.tracking.uri == "http://127.0.0.1:5000"


@pytest.mark.parametrize("field, value, reason", [
    ("name", "a" * 300, "at most 100 characters"),
    ("name", "../up", "is not a name"),
    ("experiment", "..", "is not a name"),
    ("experiment", "reports/../../elsewhere", "is not a name"),
    ("experiment", "x" * 101, "at most 100 characters"),
])
def test_names_that_are_not_one_short_path_component_are_refused(tmp_path, field, value, reason):
    raw = base_raw(run={"storage_path": str(tmp_path)})
    if field == "name":
        raw["name"] = value
    else:
        raw["tracking"] = {"experiment": value}
    with pytest.raises(SpecError, match=rf"{'tracking.experiment' if field == 'experiment' else 'name'}: .*{reason}"):
        validate_spec(raw)


@pytest.mark.parametrize("command", ["status", "evaluate", "resume"])
@pytest.mark.parametrize("name", ["../../etc", "a" * 300, ".hidden"])
def test_the_name_argument_of_the_stored_run_commands_is_checked_before_storage_is_touched(tmp_path, command, name):
    done = subprocess.run([sys.executable, "-m", "orchestrator", command, name, "--storage-path", str(tmp_path / "s")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is not a run name" in done.stderr
    assert not (tmp_path / "s").exists()
