"""Data layer: builtin corpora, tokenizer cache, local files, offline errors, sharded resumable order, config checks."""

from __future__ import annotations

import gzip
import threading
from pathlib import Path

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from models import ModelConfig
from tasks import check_compatible
from tasks.config import BuiltinCorpusConfig, TaskConfig
from tasks.corpora import builtin_lm_corpus, builtin_parallel_corpus
from tasks.data import lm_texts, parallel_texts, prepare_lm, sharded_batches
from tasks.tokenizer import EOS_ID, train_or_load

TASK = TypeAdapter(TaskConfig)
SMALL = {"train_sentences": 300, "eval_sentences": 20, "lexicon_size": 12}


def test_builtin_corpora_are_seeded_and_aligned():
    cfg = BuiltinCorpusConfig(**SMALL)
    assert builtin_lm_corpus(cfg) == builtin_lm_corpus(cfg)
    assert builtin_lm_corpus(cfg) != builtin_lm_corpus(cfg.model_copy(update={"seed": cfg.seed + 1}))
    pair = builtin_parallel_corpus(cfg, "xa", "xb")
    reverse = builtin_parallel_corpus(cfg, "xb", "xa")
    assert pair["test"][0] == reverse["test"][1] and pair["test"][1] == reverse["test"][0]
    src, tgt = pair["train"]
    assert len(src) == len(tgt) == SMALL["train_sentences"]
    # different vocabularies and word order: no target sentence is a copy of its source
    assert all(set(s.split()) - {"."} != set(t.split()) - {"."} for s, t in zip(src[:50], tgt[:50]))


def test_tokenizer_cache_hit_and_miss(tmp_path):
    calls = []
    texts = builtin_lm_corpus(BuiltinCorpusConfig(**SMALL))["train"]

    def load():
        calls.append(1)
        return texts

    settings = dict(data_fingerprint="corpus-a", model_type="unigram", cache_dir=tmp_path)
    first, hit_first = train_or_load(load, vocab_size=64, **settings)
    second, hit_second = train_or_load(load, vocab_size=64, **settings)
    assert (hit_first, hit_second) == (False, True)
    assert len(calls) == 1, "a cache hit must not load the corpus"
    assert first.model_path == second.model_path
    assert first.encode(texts[:3]) == second.encode(texts[:3])
    other, hit_other = train_or_load(load, vocab_size=80, **settings)
    assert not hit_other and other.model_path != first.model_path
    moved, hit_moved = train_or_load(load, vocab_size=64, **{**settings, "data_fingerprint": "corpus-b"})
    assert not hit_moved and moved.model_path != first.model_path
    assert not list((tmp_path / "tokenizers").glob("*.tmp")), "atomic writes leave no temporary files"


def test_a_vocabulary_below_the_corpus_characters_names_task_vocab_size(tmp_path):
    # sentencepiece said only "INTERNAL: ... Vocabulary size is smaller than required_chars. 16 vs 37"
    texts = ["abcdefghijklmnopqrstuvwxyz ABCDE"] * 20  # 31 letters and the space: 32 + 5 special pieces
    with pytest.raises(ValueError, match=r"^task.vocab_size=16 is below the 37 pieces .* at least 37$"):
        train_or_load(lambda: texts, data_fingerprint="chars", vocab_size=16, model_type="unigram", cache_dir=tmp_path)
    train_or_load(lambda: texts, data_fingerprint="chars", vocab_size=37, model_type="unigram", cache_dir=tmp_path)


def test_concurrent_builds_share_one_tokenizer(tmp_path):
    texts = builtin_lm_corpus(BuiltinCorpusConfig(**SMALL))["train"]
    results = []

    def build():
        results.append(train_or_load(lambda: texts, data_fingerprint="same", vocab_size=64, model_type="bpe",
                                     cache_dir=tmp_path))

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(hit for _, hit in results) == [False, True, True], "exactly one worker trains"
    assert len({tok.model_path for tok, _ in results}) == 1


def _write(path: Path, lines: list[str], gz: bool) -> None:
    data = ("\n".join(lines) + "\n").encode()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def test_local_lm_files_gz_and_plain(tmp_path):
    corpus = builtin_lm_corpus(BuiltinCorpusConfig(**SMALL))
    _write(tmp_path / "train.txt.gz", corpus["train"], gz=True)
    _write(tmp_path / "valid.txt", ["", *corpus["validation"], "   "], gz=False)
    cfg = TASK.validate_python({"kind": "clm", "vocab_size": 64, "files": {
        "train": str(tmp_path / "train.txt.gz"), "validation": str(tmp_path / "valid.txt")}})
    texts = lm_texts(cfg, ("train", "validation"), tmp_path / "cache")
    assert texts["train"] == corpus["train"]
    assert texts["validation"] == corpus["validation"], "blank lines are dropped, the rest kept in order"
    tokenizer, hit, streams = prepare_lm(cfg, ("train", "validation"), tmp_path / "cache")
    assert not hit
    docs = [d.tolist() for d in _split_on(np.asarray(streams["validation"]), EOS_ID)]
    assert tokenizer.decode(docs) == corpus["validation"], "the cached stream decodes back to the text"
    _, hit_again, again = prepare_lm(cfg, ("train", "validation"), tmp_path / "cache")
    assert hit_again and (np.asarray(again["validation"]) == np.asarray(streams["validation"])).all()


def _split_on(stream, sep):
    """Documents of an eos-separated stream (which starts and ends with eos)."""
    ends = (stream == sep).nonzero()[0]
    return [stream[a + 1:b] for a, b in zip(ends[:-1], ends[1:])]


def test_local_parallel_files_by_prefix(tmp_path):
    pair = builtin_parallel_corpus(BuiltinCorpusConfig(**SMALL), "xa", "xb")
    for split, prefix in (("train", "train"), ("validation", "val")):
        _write(tmp_path / f"{prefix}.xa.gz", pair[split][0], gz=True)
        _write(tmp_path / f"{prefix}.xb", pair[split][1], gz=False)
    cfg = TASK.validate_python({"kind": "translation", "source_lang": "xb", "target_lang": "xa", "vocab_size": 64,
                                "files": {"train": str(tmp_path / "train"), "validation": str(tmp_path / "val")}})
    texts = parallel_texts(cfg, ("train", "validation"), tmp_path / "cache")
    assert texts["validation"] == (pair["validation"][1], pair["validation"][0])


def test_misaligned_parallel_files_fail_clearly(tmp_path):
    _write(tmp_path / "train.xa", ["a b .", "c d ."], gz=False)
    _write(tmp_path / "train.xb", ["e f ."], gz=False)
    cfg = TASK.validate_python({"kind": "translation", "source_lang": "xa", "target_lang": "xb",
                                "files": {"train": str(tmp_path / "train"), "validation": str(tmp_path / "train")}})
    with pytest.raises(ValueError, match="line-aligned"):
        parallel_texts(cfg, ("train",), tmp_path / "cache")


def test_missing_file_names_the_field(tmp_path):
    cfg = TASK.validate_python({"kind": "mlm", "files": {"train": str(tmp_path / "nope.txt"),
                                                         "validation": str(tmp_path / "nope.txt")}})
    with pytest.raises(FileNotFoundError, match="task.files.train"):
        prepare_lm(cfg, ("train", "validation"), tmp_path)


def test_offline_hub_name_points_to_task_files(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    # offline mode makes the hub lookup fail at once, as it does on a machine without network access
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = TASK.validate_python({"kind": "clm", "dataset": "wikitext", "config": "wikitext-2-raw-v1"})
    with pytest.raises(RuntimeError, match=r"task\.files") as info:
        prepare_lm(cfg, ("train", "validation"), tmp_path)
    assert "wikitext" in str(info.value)


def test_sharded_order_covers_each_item_once_and_resumes():
    def epoch_batches(epoch: int) -> list[tuple[int, ...]]:
        items = [(epoch * 1000 + i) for i in range(23)]
        return [tuple(items[i:i + 4]) for i in range(0, 23, 4)]  # 6 batches, the last one short

    seen: list[int] = []
    for rank in range(4):
        stream = sharded_batches(epoch_batches, rank, 4, None)
        n_mine = len(epoch_batches(0)[rank::4])
        for _ in range(n_mine):
            batch, position = next(stream)
            seen.extend(batch)
        assert position == {"epoch": 0, "step": n_mine}
        assert next(stream)[0][0] >= 1000, "after its share of epoch 0, a rank moves on to epoch 1"
    assert sorted(seen) == list(range(23))

    full = sharded_batches(epoch_batches, 1, 2, None)
    taken = [next(full) for _ in range(6)]
    resumed = sharded_batches(epoch_batches, 1, 2, taken[1][1])
    assert [next(resumed)[0] for _ in range(4)] == [b for b, _ in taken[2:]]


def test_config_rejects_unknown_fields_and_missing_eval_files():
    with pytest.raises(ValidationError, match="extra"):
        TASK.validate_python({"kind": "mlm", "seq_length": 128})
    with pytest.raises(ValidationError, match="task.files.test"):
        TASK.validate_python({"kind": "clm", "eval_split": "test", "files": {"train": "a", "validation": "b"}})
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        TASK.validate_python({"kind": "summarisation"})
    translation = TASK.validate_python({"kind": "translation"})
    assert (translation.source_lang, translation.target_lang) == ("xa", "xb")
    assert translation.default_metric in translation.metrics and translation.default_mode == "max"
    lm = TASK.validate_python({"kind": "clm"})
    assert lm.default_metric == "val/ppl" and lm.default_mode == "min"


def test_check_compatible_names_the_fields():
    model = ModelConfig(d_model=32, layers=1, ffn=64, max_seq_len=64, attention={"kind": "mha", "heads": 2})
    with pytest.raises(ValueError, match=r"task\.seq_len=128 exceeds model\.max_seq_len=64"):
        check_compatible(TASK.validate_python({"kind": "mlm", "seq_len": 128}), model)
    with pytest.raises(ValueError, match=r"task\.max_source_len=100 exceeds model\.max_seq_len=64"):
        check_compatible(TASK.validate_python({"kind": "translation", "max_source_len": 100}), model)
    linformer = ModelConfig(d_model=32, layers=1, ffn=64, max_seq_len=64,
                            attention={"kind": "linformer", "heads": 2, "k": 16})
    check_compatible(TASK.validate_python({"kind": "mlm", "seq_len": 64}), linformer)
    for kind in ("clm", "translation"):
        with pytest.raises(ValueError, match=r"model\.attention\.kind='linformer'.*task\.kind"):
            check_compatible(TASK.validate_python({"kind": kind, "seq_len": 64} if kind == "clm" else
                                                  {"kind": kind, "max_source_len": 64}), linformer)


def test_a_tokenizer_is_cached_on_another_file_system_than_the_temporary_folder(tmp_path, monkeypatch):
    """The work folder is in $TMPDIR; the cache may be on another file system (an NFS storage path), where a
    rename between them fails with EXDEV. /dev/shm (tmpfs) is another file system than tmp_path here when the
    machine has one; the test says which it used."""
    import os
    import tempfile

    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK) and os.stat(shm).st_dev != os.stat(tmp_path).st_dev):
        pytest.skip("no second file system (a writable /dev/shm on another device than the test's folder)")
    work = Path(tempfile.mkdtemp(dir=shm, prefix="tokenizer-test-"))
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    try:
        settings = dict(data_fingerprint="exdev", model_type="unigram", cache_dir=tmp_path / "cache")
        tokenizer, hit = train_or_load(lambda: [f"line {i} of a small corpus" for i in range(200)], vocab_size=40,
                                       **settings)
        assert not hit and os.stat(tmp_path / "cache").st_dev != os.stat(work).st_dev
        assert train_or_load(lambda: [], vocab_size=40, **settings)[1]
        assert list(work.iterdir()) == []  # the work folder was cleaned up, its model moved out
    finally:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
