"""Inputs that used to pass validation and fail later (in a Ray worker, after the cluster was spent) or do harm:
non-finite or negative numbers, credentials in the tracking URI, names that are not one short path component,
spec files of nested aliases or in another encoding, corpora that are not UTF-8. Each is refused before Ray with
the field (or file) and the fix."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.spec import SpecError, load_spec, validate_spec
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
def test_the_name_argument_of_the_stored_run_commands_is_checked_before_storage_is_touched(tmp_path, command, name,
                                                                                           capsys):
    from orchestrator.cli import main

    with pytest.raises(SystemExit) as exited:  # argparse's refusal of the argument, as the command line shows it
        main([command, name, "--storage-path", str(tmp_path / "s")])
    assert exited.value.code == 2
    assert "is not a run name" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


# --- files: a spec file and data files that are not what they claim ----------------------------------------------

BILLION_LAUGHS = "name: laughs\na: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi"))


def test_a_spec_of_nested_aliases_is_refused_at_once_instead_of_expanding(tmp_path):
    """In a process of its own with a deadline: unbounded, the expansion runs for hours and takes the memory."""
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 600
    done = subprocess.run([sys.executable, "-m", "orchestrator", "validate", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "aliases expand to 490,329,066 values, more than 100,000" in done.stderr


def test_aliases_a_spec_really_uses_are_accepted(tmp_path):
    text = yaml.safe_dump(base_raw(run={"storage_path": str(tmp_path)}), sort_keys=False)
    text = text.replace("seq_len: 16", "seq_len: &length 24").replace("max_seq_len: 32", "max_seq_len: *length")
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    assert "*length" in text and load_spec(path).model.max_seq_len == 24


def test_a_spec_file_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(yaml.safe_dump(base_raw()).replace("unit", "caf\xe9").encode("latin-1"))
    with pytest.raises(SpecError, match=rf"{path}: not UTF-8 text \(byte 0xe9 at offset \d+\)"):
        load_spec(path)


def _text_spec(tmp_path: Path, train: Path) -> dict:
    return base_raw(task={"kind": "clm", "seq_len": 16, "batch_size": 4, "vocab_size": 60,
                          "files": {"train": str(train), "validation": str(train)}},
                    run={"storage_path": str(tmp_path / "runs")})


@pytest.mark.parametrize("where", ["start", "after_the_checked_prefix"])
def test_a_corpus_that_is_not_utf8_is_named_with_its_file_before_ray_or_by_the_reader(tmp_path, where):
    from orchestrator.launch.preflight import check_data_files
    from tasks.text_sources import FileSlice, file_lines

    corpus = tmp_path / "latin1.txt"
    good = "a line of plain text\n".encode() * (60_000 if where == "after_the_checked_prefix" else 1)
    corpus.write_bytes(good + "caf\xe9 au lait\n".encode("latin-1"))
    spec = validate_spec(_text_spec(tmp_path, corpus))
    if where == "start":
        with pytest.raises(SpecError, match=rf"task.files.train: {corpus} is not UTF-8 text \(byte 0xe9 at offset"):
            check_data_files(spec)
        return
    check_data_files(spec)  # the first MiB is clean: the readers name the file where the bad byte is
    with pytest.raises(ValueError, match=rf"{corpus} is not UTF-8 text: invalid continuation byte"):
        list(file_lines(corpus))
    with pytest.raises(ValueError, match=rf"{corpus} is not UTF-8 text: .* \(at byte {len(good) + 3}\)"):
        FileSlice(str(corpus), 0, corpus.stat().st_size).documents()


def test_a_byte_level_corpus_may_hold_any_bytes(tmp_path):
    from orchestrator.launch.preflight import check_data_files

    corpus = tmp_path / "bytes.bin"
    corpus.write_bytes(bytes(range(256)) * 4)
    raw = base_raw(run={"storage_path": str(tmp_path / "runs")})
    raw["task"] = {"kind": "bytelm", "seq_len": 16, "batch_size": 4, "files": {"train": str(corpus), "test": str(corpus)},
                   "eval_split": "test"}
    spec = validate_spec(raw)
    check_data_files(spec)


def test_a_checkpoint_spec_of_nested_aliases_is_refused_by_init_from(tmp_path):
    from orchestrator.launch import pretrained

    folder = tmp_path / "checkpoint_000000002"
    folder.mkdir()
    (folder / "spec.yaml").write_text(BILLION_LAUGHS)
    (folder / "state.pt").write_bytes(b"")
    with pytest.raises(SpecError, match=r"has no readable spec.yaml \(YAMLError\)"):
        pretrained._read_spec(str(folder), str(folder))
