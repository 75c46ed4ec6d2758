"""Task, storage and tracking inputs that `orchestrator validate` used to accept and that failed later (torch's
negative-dimension error, sentencepiece's INTERNAL error in a Ray worker, a bare OSError from the name lock) or
that `train` refused only after validate had passed them. Each is refused before Ray, naming the field and the
fix, and the nearest valid value still passes. No Ray; no network but 127.0.0.1."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.launch.preflight import check_storage, check_tracking_uri
from orchestrator.spec import SpecError, validate_spec
from tests.test_spec import base_raw, write

TRANSLATION = {"kind": "translation", "max_tokens": 256, "max_source_len": 24, "vocab_size": 120,
               "builtin": {"train_sentences": 50, "eval_sentences": 10, "lexicon_size": 6}}


def _raw(tmp_path: Path, **sections) -> dict:
    """base_raw with storage and tracking inside tmp_path (so nothing lands in the working tree); a task block
    with its own kind replaces the masked LM's, one without is merged into it."""
    task = sections.pop("task", {})
    sections = {"run": {"storage_path": str(tmp_path / "runs")},
                "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}, **sections}
    raw = base_raw(**sections)
    raw["task"] = task if "kind" in task else {**raw["task"], **task}
    return raw


def _validate(tmp_path: Path, monkeypatch, capsys, raw: dict) -> tuple[int, str]:
    """`orchestrator validate` of `raw` in tmp_path: (exit code, stderr)."""
    monkeypatch.chdir(tmp_path)
    code = cli.main(["validate", str(write(tmp_path, raw))])
    return code, capsys.readouterr().err


# --- a4/b15: task length fields must be positive ------------------------------------------------------------


@pytest.mark.parametrize("value", [-5, 0])
def test_a_nonpositive_max_source_len_is_refused_naming_the_field(tmp_path, monkeypatch, capsys, value):
    raw = _raw(tmp_path, task={**TRANSLATION, "max_source_len": value})
    with pytest.raises(SpecError, match=rf"task.max_source_len={value} must be >= 1"):
        validate_spec(raw)
    code, err = _validate(tmp_path, monkeypatch, capsys, raw)
    assert code == 2 and f"task.max_source_len={value} must be >= 1" in err and "Traceback" not in err
    assert validate_spec(_raw(tmp_path, task={**TRANSLATION, "max_source_len": 1})).task.max_source_len == 1


# --- b17: the builtin pair's languages, checked in the spec ------------------------------------------------


def test_builtin_translation_in_other_languages_is_refused_in_the_spec(tmp_path, monkeypatch, capsys):
    raw = _raw(tmp_path, task={**TRANSLATION, "source_lang": "de", "target_lang": "en"})
    code, err = _validate(tmp_path, monkeypatch, capsys, raw)
    assert code == 2, err
    assert "task.source_lang='de': the builtin pair has languages ('xa', 'xb')" in err
    assert "use those codes or point task.files at real parallel data" in err
    reverse = validate_spec(_raw(tmp_path, task={**TRANSLATION, "source_lang": "xb", "target_lang": "xa"}))
    assert (reverse.task.source_lang, reverse.task.target_lang) == ("xb", "xa")


# --- b13: a vocabulary too small for the builtin corpus's characters -----------------------------------------


def test_a_vocab_below_the_builtin_corpus_characters_is_refused_with_the_number(tmp_path, monkeypatch, capsys):
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, task={"vocab_size": 16}))
    assert code == 2 and "task.vocab_size=16 is too small for the builtin corpus" in err
    assert "set task.vocab_size >= 23" in err  # the xa text: 18 characters (word boundary included) + 5 special
    assert validate_spec(_raw(tmp_path, task={"vocab_size": 23})).task.vocab_size == 23
    with pytest.raises(SpecError, match=r"task.vocab_size=29 .* set task.vocab_size >= 30"):  # xa + xb, joint
        validate_spec(_raw(tmp_path, task={**TRANSLATION, "vocab_size": 29}))
    assert validate_spec(_raw(tmp_path, task={**TRANSLATION, "vocab_size": 30})).task.vocab_size == 30


def test_the_builtin_vocab_floor_is_what_sentencepiece_needs(tmp_path):
    """Trained as tasks/tokenizer.py trains: the floor succeeds, one less is sentencepiece's INTERNAL error (which
    tasks/tokenizer.py words as task.vocab_size and the floor)."""
    from tasks.config import BuiltinCorpusConfig
    from tasks.corpora import builtin_lm_corpus, builtin_vocab_floor
    from tasks.tokenizer import train_or_load

    cfg = BuiltinCorpusConfig(train_sentences=300, eval_sentences=10, lexicon_size=6)
    floor = builtin_vocab_floor(cfg, ("xa",))
    lines = builtin_lm_corpus(cfg)["train"]
    settings = dict(data_fingerprint="floor", model_type="unigram", cache_dir=tmp_path / "cache")
    tokenizer, _ = train_or_load(lambda: lines, vocab_size=floor, **settings)
    assert tokenizer.vocab_size >= floor - 1
    with pytest.raises(ValueError, match=rf"task.vocab_size={floor - 1} is below the {floor} pieces"):
        train_or_load(lambda: lines, vocab_size=floor - 1, **settings)


# --- b18: validate runs train's labelled-data check ------------------------------------------------------------


def test_validate_refuses_a_missing_label_column_as_train_does_and_writes_nothing(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "validation"):
        (data / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"film {i} .\t{i % 2}\n" for i in range(8)))
    task = {"kind": "classify", "max_len": 16, "vocab_size": 120, "label_column": "sentiment",
            "files": {"train": str(data / "train.tsv"), "validation": str(data / "validation.tsv")}}
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, task=task))
    assert code == 2, err
    assert "not ['sentiment']; set task.label_column (now 'sentiment') to the file's column names" in err
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, task={**task, "label_column": "label"}))
    assert code == 0, err
    assert not (tmp_path / "runs").exists()  # parsed into a throwaway cache, not the run's


# --- b25/b26: local storage that cannot be created or written ----------------------------------------------------


def test_local_storage_under_a_file_or_in_proc_is_refused_naming_the_field(tmp_path, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("x")
    for path, why in [(tmp_path / "a-file" / "runs", f"{tmp_path / 'a-file'} is a file, not a folder"),
                      (Path("/proc/qa-runs"), "/proc cannot be written")]:
        if path.parts[1] == "proc" and not Path("/proc/self").exists():
            continue
        raw = _raw(tmp_path, run={"storage_path": str(path)})
        with pytest.raises(SpecError, match="run.storage_path=.* cannot hold runs"):
            check_storage(validate_spec(raw))  # the first check of train's and sweep's preflight
        code, err = _validate(tmp_path, monkeypatch, capsys, raw)
        assert code == 2 and f"run.storage_path={str(path)!r} cannot hold runs: {why}" in err, err
        assert "choose a folder this user can create and write" in err
    fresh = tmp_path / "not" / "yet" / "runs"
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, run={"storage_path": str(fresh)}))
    assert code == 0, err
    assert not (tmp_path / "not").exists()  # checked at its nearest existing folder; nothing created


# --- b28: a storage scheme pyarrow does not know ---------------------------------------------------------------


def test_an_unknown_storage_scheme_is_refused_with_the_schemes_accepted(tmp_path, monkeypatch, capsys):
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, run={"storage_path": "s4://bucket/runs"}))
    assert code == 2
    assert "run.storage_path='s4://bucket/runs': the scheme 's4' is not one pyarrow's file systems know" in err
    assert "use one of s3://, gs://" in err
    check_storage(validate_spec(_raw(tmp_path, run={"storage_path": "gs://bucket/runs"})))  # known: no contact


# --- b21-b24: tracking URIs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("uri, says", [
    ("htp://127.0.0.1:9", "tracking.uri='htp://127.0.0.1:9': 'htp' is not a tracking store scheme; did you mean "
                          "http?"),
    ("127.0.0.1:9", "tracking.uri='127.0.0.1:9' is a host and port without a scheme (MLflow would read it as a "
                    "folder); write tracking.uri=http://127.0.0.1:9"),
])
def test_a_tracking_uri_mlflow_cannot_use_is_refused_at_validate(tmp_path, monkeypatch, capsys, uri, says):
    raw = _raw(tmp_path, tracking={"uri": uri, "offline_ok": True})  # offline_ok cannot make it answer
    code, err = _validate(tmp_path, monkeypatch, capsys, raw)
    assert code == 2 and says in err, err


def test_a_sqlite_store_that_cannot_be_created_is_refused_and_a_good_one_is_not_created(tmp_path, monkeypatch,
                                                                                        capsys):
    (tmp_path / "a-file").write_text("x")
    uri = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, tracking={"uri": uri}))
    assert code == 2 and f"tracking.uri={uri!r}: the store cannot be written there" in err, err
    check_tracking_uri(validate_spec(_raw(tmp_path)))
    assert not (tmp_path / "mlflow.db").exists()


def test_a_tracking_server_that_does_not_answer_is_refused_at_validate_as_train_refuses_it(tmp_path, monkeypatch,
                                                                                          capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends: nothing answers
    tracking = {"uri": uri, "retries": 1, "timeout_s": 1}
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, tracking=tracking))
    assert code == 1 and f"tracking.uri={uri!r} cannot be reached" in err  # check_tracking's LaunchError
    assert "set tracking.offline_ok=true to train anyway" in err
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, tracking={**tracking, "offline_ok": True}))
    assert code == 0, err


# --- b29: validate's note about the cluster says what checks it ------------------------------------------------


def test_the_gpu_note_says_train_checks_the_cluster_not_ray_address(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cli, "local_gpu_count", lambda: 0)
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, run={"storage_path": str(tmp_path / "runs"),
                                                                             "gpus_per_worker": 1}))
    assert code == 0, err
    assert "asks for 1 GPUs per run but this machine (no RAY_ADDRESS set) has 0" in err
    assert "train and sweep check its GPUs once connected" in err and "set RAY_ADDRESS" not in err


# --- local translation files: a language pair the files do not hold, a whole file name given as the prefix ------


def test_a_translation_side_missing_from_the_files_names_the_language_field_or_the_prefix(tmp_path, monkeypatch,
                                                                                         capsys):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        for lang in ("de", "en"):
            (data / f"{split}.{lang}").write_text("ein Hund\n" if lang == "de" else "a dog\n")
    files = {"train": str(data / "train"), "validation": str(data / "val")}
    pair = {**{k: v for k, v in TRANSLATION.items() if k != "builtin"}, "files": files, "source_lang": "de",
            "target_lang": "en"}
    assert _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, task=pair))[0] == 0
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, task={**pair, "source_lang": "fr"}))
    assert code == 2 and "hold languages ['de', 'en'], not 'fr'; set task.source_lang to one of them" in err
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, task={**pair, "target_lang": "EN"}))
    assert code == 2 and "not 'EN'; set task.target_lang" in err
    whole = {**pair, "files": {**files, "train": str(data / "train.de")}}
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, task=whole))
    assert code == 2 and f"task.files.train is a prefix, read as <prefix>.<lang>[.gz]: give {data / 'train'}" in err
    code, err = _validate(tmp_path, monkeypatch, capsys, _raw(tmp_path, task={**pair, "files": {
        **files, "validation": str(data / "vall")}}))
    assert code == 2 and "vall.de.gz does not exist; fix the path" in err
