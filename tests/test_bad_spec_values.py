"""Spec values that validated into something other than what the user wrote: `run.workers: true` read as one
worker, a key given twice in one block (YAML keeps the last), a grid listing a value twice (the same run trained
twice), and a pretrained model that cannot be loaded (an empty folder, a hub id neither cached nor reachable),
which failed only inside a Ray worker. Each is refused before Ray, naming the field and the fix; the nearest
valid spec still passes. No Ray; no network but 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.launch.preflight import check_data_files
from orchestrator.spec import SpecError, validate_spec
from orchestrator.spec.loading import apply_overrides, bounded_yaml, load_study
from tests.test_spec import base_raw, write

# --- booleans where a number belongs ------------------------------------------------------------------------


@pytest.mark.parametrize(("section", "field"), [("run", "workers"), ("optim", "lr"), ("optim", "max_steps"),
                                                 ("task", "seq_len")])
def test_a_boolean_in_a_number_field_is_refused_naming_the_field(section, field):
    with pytest.raises(SpecError, match=rf"{section}.{field}: true is a boolean, and this field takes a number"):
        validate_spec(base_raw(**{section: {field: True}}))
    with pytest.raises(SpecError, match=rf"{section}.{field}: false is a boolean"):
        validate_spec(base_raw(**{section: {field: False}}))


def test_a_boolean_inside_an_attention_block_and_in_a_grid_value_is_refused(tmp_path):
    with pytest.raises(SpecError, match=r"model.attention.heads: true is a boolean"):
        validate_spec(base_raw(model={"attention": {"kind": "mha", "heads": True}}))
    raw = base_raw(model={"attention": {"grid": [{"kind": "mha", "heads": 2}, {"kind": "sha", "heads": True}]}})
    with pytest.raises(SpecError, match=r"trial \{model.attention=.*'sha'.*\} is invalid:\n  model.attention.heads: "
                                        r"true is a boolean"):
        load_study(write(tmp_path, raw))


def test_a_boolean_among_tune_seeds_is_refused_naming_the_item(tmp_path):
    """`tune.seeds: [true, 2]` validated as seeds 1 and 2 (pydantic's lax ints, and the study's own check took
    a bool for an int): a sweep over a seed nobody wrote. Refused in a study and in a single-run spec alike."""
    with pytest.raises(SpecError, match=r"tune.seeds.0: true is a boolean, and this field takes a list of numbers "
                                        r"\(it would be read as 1\); write the number"):
        load_study(write(tmp_path, base_raw(tune={"seeds": [True, 2]})))
    with pytest.raises(SpecError, match=r"tune.seeds.1: false is a boolean"):
        validate_spec(base_raw(tune={"seeds": [0, False]}))
    assert load_study(write(tmp_path, base_raw(tune={"seeds": [1, 2]}))).base.tune.seeds == [1, 2]


def test_booleans_in_boolean_fields_and_numbers_in_number_fields_pass():
    spec = validate_spec(base_raw(run={"workers": 2, "final_eval": False}, tracking={"offline_ok": True},
                                  optim={"lr": 1}))
    assert (spec.run.workers, spec.run.final_eval, spec.tracking.offline_ok, spec.optim.lr) == (2, False, True, 1.0)


# --- one key twice in a block ---------------------------------------------------------------------------------


def test_a_key_given_twice_in_a_spec_file_is_refused_with_both_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = write(tmp_path, base_raw()).read_text()
    (tmp_path / "twice.yaml").write_text(text.replace("optim:\n", "optim:\n  lr: 0.1\n") + "optim:\n  lr: 0.2\n")
    assert cli.main(["validate", str(tmp_path / "twice.yaml")]) == 2
    err = capsys.readouterr().err
    assert "found the key 'optim' twice; keep one" in err and "line " in err and "Traceback" not in err
    assert cli.main(["validate", str(write(tmp_path, base_raw()))]) == 0


def test_a_key_twice_in_an_override_is_refused_and_yaml_merge_keys_still_override():
    with pytest.raises(SpecError, match=r"found the key 'heads' twice"):
        apply_overrides(base_raw(), ["model.attention={kind: mha, heads: 2, heads: 4}"])
    merged = bounded_yaml("a: &x {kind: mha, heads: 2}\nb:\n  <<: *x\n  heads: 4\n")
    assert merged["b"] == {"kind": "mha", "heads": 4}


# --- a grid value twice ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[1e-3, 2e-3, 1e-3], [{"kind": "mha", "heads": 2}, {"heads": 2, "kind": "mha"}]])
def test_a_grid_listing_a_value_twice_is_refused(tmp_path, values):
    path = "optim.lr" if isinstance(values[0], float) else "model.attention"
    section, field = path.split(".")
    raw = base_raw(**{section: {field: {"grid": values}}})
    with pytest.raises(SpecError, match=rf"{path}: \{{grid: \[...\]\}} lists .* more than once.*tune.seeds"):
        load_study(write(tmp_path, raw))
    raw = base_raw(**{section: {field: {"grid": values[:1]}}})
    assert len(load_study(write(tmp_path, raw)).domains) == 1


def test_repeated_seeds_are_refused_and_a_choice_may_repeat_a_value(tmp_path):
    with pytest.raises(SpecError, match=r"tune.seeds=\[0, 1, 0\] lists seed 0 more than once"):
        load_study(write(tmp_path, base_raw(tune={"seeds": [0, 1, 0]})))
    # choice weights its values: a repeat there is a weight, not a second identical trial
    raw = base_raw(optim={"lr": {"choice": [1e-3, 1e-3, 2e-3]}}, tune={"search": "random", "num_samples": 2})
    assert load_study(write(tmp_path, raw)).domains[0].values == (1e-3, 1e-3, 2e-3)


# --- a pretrained model that cannot be loaded -----------------------------------------------------------------


def _pretrained_raw(tmp_path: Path, pretrained: str) -> dict:
    for split in ("train", "valid"):
        (tmp_path / f"{split}.txt").write_text("some text to score\n" * 20)
    task = {"kind": "pretrained_lm", "pretrained": pretrained, "seq_len": 16, "documents": 1,
            "patch": {"layers": 1, "attention": {"kind": "lsh", "bucket_size": 4}},
            "files": {"train": str(tmp_path / "train.txt"), "validation": str(tmp_path / "valid.txt")}}
    raw = base_raw(optim={"max_steps": 0}, run={"storage_path": str(tmp_path / "runs")},
                   tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    raw["task"] = task
    del raw["model"]  # the pretrained model is the model
    return raw


def test_a_pretrained_folder_without_model_files_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=r"task.pretrained: .*empty is a folder without config.json .* or "
                                        r"model.json"):
        validate_spec(_pretrained_raw(tmp_path, str(tmp_path / "empty")))
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert validate_spec(_pretrained_raw(tmp_path, str(tmp_path / "empty"))).task.pretrained == str(tmp_path / "empty")


def test_a_hub_model_offline_is_refused_unless_it_is_in_the_hub_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    spec_path = write(tmp_path, _pretrained_raw(tmp_path, "someone/tiny-lm"))
    assert cli.main(["validate", str(spec_path)]) == 2
    err = capsys.readouterr().err
    assert "task.pretrained='someone/tiny-lm' is not in the Hugging Face cache" in err and "hf download" in err
    # the hub cache's layout for a downloaded model: a snapshot of its files and the ref naming it
    repo = tmp_path / "hub" / "models--someone--tiny-lm"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert cli.main(["validate", str(spec_path)]) == 0, capsys.readouterr().err


class _Hub(BaseHTTPRequestHandler):
    """The hub's model-info endpoint for one known model; any other id is the hub's 404 for a missing repo."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.split("?")[0] == "/api/models/someone/known-lm":
            body = json.dumps({"id": "someone/known-lm", "sha": "abc123", "siblings": []}).encode()
            self.send_response(200)
        else:
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def local_hub(monkeypatch, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at import
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    yield
    server.shutdown()


def test_a_hub_id_the_hub_does_not_know_is_refused_and_a_known_one_passes(tmp_path, local_hub):
    from orchestrator.spec import load_spec

    with pytest.raises(SpecError, match=r"task.pretrained='someone/missing-lm': the Hugging Face hub has no such "
                                        r"model \(check the spelling\)"):
        check_data_files(load_spec(write(tmp_path, _pretrained_raw(tmp_path, "someone/missing-lm"))))
    check_data_files(load_spec(write(tmp_path, _pretrained_raw(tmp_path, "someone/known-lm"))))
