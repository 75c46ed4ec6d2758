"""Prepared corpora: ids equal to tokenising in memory, the batch order of the in-memory path, exact resume,
disjoint ranks, atomic preparation, damaged shards refused, dtype choice, `orchestrator prepare`.

Small generated corpora cut into many shards (tiny SHARD_BYTES and chunks), so blocks and documents cross
shard borders and the pool of encoding processes returns many chunks that must come back in order."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from pydantic import TypeAdapter

from models import ModelConfig
from tasks import WorkerContext, build_task
from tasks import corpus_format, text_sources
from tasks.config import BuiltinCorpusConfig, TaskConfig
from tasks.corpora import builtin_lm_corpus, builtin_parallel_corpus
from tasks.corpus_format import ColumnWriter, DamagedCorpus, open_corpus, token_dtype, write_manifest
from tasks.data import epoch_permutation, lm_texts, parallel_texts, prepare_all, prepare_lm, prepare_parallel, token_stream
from tasks.lm import num_blocks, pack_blocks
from tasks.tokenizer import EOS_ID

TASK = TypeAdapter(TaskConfig)
MODEL = ModelConfig.model_validate({"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 32,
                                    "attention": {"kind": "mha", "heads": 2}})


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of ~2 KB and chunks of ~2 KB of text (or 50 rows): dozens of both from a small corpus. (Every read
    releases its pages, so reads of released pages are checked too.)"""
    monkeypatch.setattr(corpus_format, "SHARD_BYTES", 2048)
    monkeypatch.setattr(text_sources, "CHUNK_CHARS", 2048)
    monkeypatch.setattr(text_sources, "CHUNK_ROWS", 50)


def _lm_files(tmp_path: Path, **task) -> object:
    corpus = builtin_lm_corpus(BuiltinCorpusConfig(train_sentences=1500, eval_sentences=60, lexicon_size=12))
    for split in ("train", "validation"):
        (tmp_path / f"{split}.txt").write_text("\n".join(["", *corpus[split]]) + "\n")
    return TASK.validate_python({"kind": "clm", "vocab_size": 80, "seq_len": 16, "batch_size": 4,
                                 "prepare_workers": 2, "files": {"train": str(tmp_path / "train.txt"),
                                                                 "validation": str(tmp_path / "validation.txt")},
                                 **task})


def _folder(prepared: Path, prefix: str) -> Path:
    """The one finished corpus folder named prefix-<key> (not its lock, not an unfinished one)."""
    (found,) = [p for p in prepared.glob(f"{prefix}-*") if p.is_dir() and "." not in p.name]
    return found


def _in_memory_stream(tokenizer, cfg, split: str, cache_dir: Path) -> np.ndarray:
    """What earlier versions computed: every document encoded in one call, joined by eos."""
    seqs = tokenizer.encode(lm_texts(cfg, (split,), cache_dir)[split])
    flat = np.array([t for s in seqs for t in s], dtype=np.int64)
    return token_stream(flat, np.concatenate([[0], np.cumsum([len(s) for s in seqs])]), EOS_ID)


def test_prepared_ids_equal_the_in_memory_tokenisation(tmp_path, small_shards):
    cfg = _lm_files(tmp_path)
    tokenizer, _, streams = prepare_lm(cfg, ("train", "validation"), tmp_path / "cache")
    corpus = open_corpus(_folder(tmp_path / "cache" / "prepared", "lm-train"), "rebuild")
    assert len(corpus.manifest["columns"]["tokens"]["shards"]) > 5, "the test must cross shard borders"
    for split in ("train", "validation"):
        expected = _in_memory_stream(tokenizer, cfg, split, tmp_path / "cache")
        np.testing.assert_array_equal(np.asarray(streams[split]), expected)
        # slices across shard borders, as blocks read them
        for start in range(0, len(expected), 37):
            np.testing.assert_array_equal(streams[split][start:start + 53], expected[start:start + 53])
    docs = corpus.columns["tokens"].items
    texts = lm_texts(cfg, ("train",), tmp_path / "cache")["train"]
    assert len(docs) == len(texts)
    assert [d.tolist() for d in docs] == tokenizer.encode(texts), "each document's index entry is its own ids"


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 7, 16, 64, 10_000])
def test_file_slices_hold_exactly_the_documents_of_the_text_mode_reader(tmp_path, chunk_bytes):
    """The slices a pool worker reads itself give the documents `file_lines` gives (the path that the in-memory
    reference reads), in order, whatever the cut: CRLF and lone CR endings, blank and space-only lines,
    multi-byte characters, no final newline."""
    text = ("ein Satz\r\nzwei\rdrei \u00e4\u00f6\u00fc\n\n   \nvier\u20ac\u20ac\r\n\r\n"
            "f\u00fcnf \U0001f600 ende\nsechs\r\rsieben")
    path = tmp_path / "nasty.txt"
    path.write_bytes(text.encode("utf-8"))
    expected = text_sources.documents_of([line for lines, _ in text_sources.file_lines(path) for line in lines])
    slices = list(text_sources.file_slices(path, chunk_bytes))
    assert [s.start for s, _ in slices] == [0] + [s.end for s, _ in slices[:-1]], "slices tile the file"
    assert slices[-1][0].end == slices[-1][1] == path.stat().st_size
    assert [doc for piece, _ in slices for doc in piece.documents()] == expected
    assert expected == ["ein Satz", "zwei", "drei \u00e4\u00f6\u00fc", "vier\u20ac\u20ac", "f\u00fcnf \U0001f600 ende",
                        "sechs", "sieben"]


def test_a_worker_reads_the_old_batch_order_and_resumes_exactly(tmp_path, small_shards):
    cfg = _lm_files(tmp_path)
    task = build_task(cfg, MODEL, WorkerContext(seed=5, rank=1, world_size=2, cache_dir=tmp_path / "cache"))
    stream = _in_memory_stream(task.tokenizer, cfg, "train", tmp_path / "cache")
    n = num_blocks(len(stream), 16, 1)
    old = []  # the order of the in-memory path: epoch permutation, batches of 4, rank 1 takes every other one
    for epoch in range(2):
        order = epoch_permutation(n, 5, epoch)
        batches = [order[i:i + 4] for i in range(0, n, 4)][1::2]
        old += [pack_blocks(stream, blocks, 16, 1)[0] for blocks in batches]
    got = list(itertools.islice(task.train_batches(), len(old)))
    for (batch, _), tokens in zip(got, old):
        np.testing.assert_array_equal(batch.tensors["tokens"].numpy(), tokens[:, :-1])
    k = len(old) // 2 + 3  # mid-epoch 1: a fresh task resumes from the position a checkpoint would hold
    resumed = build_task(cfg, MODEL, WorkerContext(seed=5, rank=1, world_size=2, cache_dir=tmp_path / "cache"))
    for (batch, after), (want, want_after) in zip(resumed.train_batches(got[k - 1][1]), got[k:]):
        assert after == want_after
        np.testing.assert_array_equal(batch.tensors["tokens"].numpy(), want.tensors["tokens"].numpy())
        np.testing.assert_array_equal(batch.tensors["targets"].numpy(), want.tensors["targets"].numpy())


def test_two_ranks_see_disjoint_blocks_that_cover_the_epoch(tmp_path, small_shards):
    cfg = _lm_files(tmp_path)
    seen = []
    for rank in range(2):
        task = build_task(cfg, MODEL, WorkerContext(seed=1, rank=rank, world_size=2, cache_dir=tmp_path / "cache"))
        for batch, after in task.train_batches():
            tokens, targets = batch.tensors["tokens"].numpy(), batch.tensors["targets"].numpy()
            # the block itself: its first token, then its targets (an unscored, padded tail reads as padding)
            blocks = np.concatenate([tokens[:, :1], np.where(targets == -100, 0, targets)], axis=1)
            seen += [tuple(row) for row in blocks.tolist()]
            if after["step"] == len(range(rank, len(task._epoch_batches(0)), 2)):
                break
    n = task.n_train_blocks
    every = pack_blocks(np.asarray(task.train_stream), np.arange(n), 16, 1)[0]
    assert len(seen) == n and sorted(seen) == sorted(tuple(r) for r in every.tolist())


def _prepare_and_die(cfg, cache_dir: Path) -> None:
    """In a child: prepare, and be killed (SIGKILL, no cleanup) after a few chunks were written."""
    calls = itertools.count()
    write = ColumnWriter.write

    def dying(self, *args):
        if next(calls) == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        write(self, *args)

    ColumnWriter.write = dying
    prepare_lm(cfg, ("train",), cache_dir)


def test_a_killed_prepare_is_never_used_and_the_next_one_starts_again(tmp_path, small_shards, capfd):
    cfg = _lm_files(tmp_path, prepare_workers=1)
    # the tokenizer first, here: sentencepiece's trainer can hang in a process forked after it ran
    prepare_lm(cfg, ("validation",), tmp_path / "cache")
    child = multiprocessing.get_context("fork").Process(target=_prepare_and_die, args=(cfg, tmp_path / "cache"))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    prepared = tmp_path / "cache" / "prepared"
    assert list(prepared.glob("lm-train-*.partial-*")), "the child died while writing"
    assert not [p for p in prepared.glob("lm-train-*") if p.is_dir() and "." not in p.name]
    tokenizer, _, streams = prepare_lm(cfg, ("train",), tmp_path / "cache")
    assert "an unfinished preparation" in capfd.readouterr().err
    assert not list(prepared.glob("*.partial-*"))
    np.testing.assert_array_equal(np.asarray(streams["train"]), _in_memory_stream(tokenizer, cfg, "train", tmp_path / "cache"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shard_is_refused_with_its_name_and_the_rebuild_command(tmp_path, small_shards, damage):
    cfg = _lm_files(tmp_path)
    rebuild = "orchestrator prepare spec.yaml task.vocab_size=80"
    tokenizer, _, _ = prepare_lm(cfg, ("train",), tmp_path / "cache", rebuild=rebuild)
    folder = _folder(tmp_path / "cache" / "prepared", "lm-train")
    shard = sorted(folder.glob("tokens-*.bin"))[3]
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data) if damage == "flip" else bytes(data[:-2]))
    with pytest.raises(DamagedCorpus) as info:
        prepare_lm(cfg, ("train",), tmp_path / "cache")
    message = str(info.value)
    assert shard.name in message and str(folder) in message and rebuild in message
    assert ("CRC-32" if damage == "flip" else "truncated") in message
    prepare_all(cfg, tmp_path / "cache", rebuild)  # the rebuild command replaces it
    _, _, streams = prepare_lm(cfg, ("train",), tmp_path / "cache")
    np.testing.assert_array_equal(np.asarray(streams["train"]), _in_memory_stream(tokenizer, cfg, "train", tmp_path / "cache"))


def test_a_vocabulary_past_uint16_is_stored_as_uint32(tmp_path):
    assert token_dtype(8000) == np.uint16 and token_dtype(1 << 16) == np.uint16
    assert token_dtype((1 << 16) + 1) == np.uint32
    ids = np.array([3, 65535, 65536, 70000, 3], dtype=np.int64)
    writer = ColumnWriter(tmp_path, "tokens", token_dtype(70001))
    writer.write(ids, np.array([1]), np.array([3]))
    write_manifest(tmp_path, {"columns": {"tokens": writer.finish()}})
    column = open_corpus(tmp_path, "rebuild").columns["tokens"]
    assert column.dtype == np.uint32 and (tmp_path / "tokens-00000.bin").stat().st_size == 4 * len(ids)
    np.testing.assert_array_equal(np.asarray(column.stream), ids)
    assert column.items[0].tolist() == [65535, 65536, 70000]
    with pytest.raises(ValueError, match="outside uint16"):
        ColumnWriter(tmp_path, "narrow", np.dtype(np.uint16)).write(ids, np.array([0]), np.array([5]))


def test_translation_pairs_and_references_read_back_from_the_shards(tmp_path, small_shards):
    pair = builtin_parallel_corpus(BuiltinCorpusConfig(train_sentences=400, eval_sentences=30, lexicon_size=12),
                                   "xa", "xb")
    for split in ("train", "validation"):
        for side, lang in enumerate(("xa", "xb")):
            lines = list(pair[split][side])
            lines[7] = "" if side == 0 else lines[7]  # a pair with an empty side is dropped, keeping alignment
            (tmp_path / f"{split}.{lang}").write_text("\n".join(lines) + "\n")
    cfg = TASK.validate_python({"kind": "translation", "source_lang": "xa", "target_lang": "xb", "vocab_size": 80,
                                "prepare_workers": 2, "files": {"train": str(tmp_path / "train"),
                                                                "validation": str(tmp_path / "validation")}})
    tokenizer, _, splits = prepare_parallel(cfg, ("train", "validation"), tmp_path / "cache")
    texts = parallel_texts(cfg, ("train", "validation"), tmp_path / "cache")
    for split in ("train", "validation"):
        src, tgt = texts[split]
        assert len(src) == len(pair[split][0]) - 1
        assert [s.tolist() for s in splits[split].src] == tokenizer.encode(src)
        assert [t.tolist() for t in splits[split].tgt] == tokenizer.encode(tgt)
        assert splits[split].references[:] == tgt
        np.testing.assert_array_equal(splits[split].src.lengths, [len(s) for s in tokenizer.encode(src)])


def test_a_streamed_hub_dataset_is_prepared_row_by_row(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    lines = builtin_lm_corpus(BuiltinCorpusConfig(train_sentences=300, eval_sentences=20, lexicon_size=12))
    asked = []

    def load_dataset(name, config, *, split, streaming, cache_dir):
        asked.append((name, config, split, streaming))
        rows = ["", *lines[split]]
        return datasets.IterableDataset.from_generator(lambda: ({"text": t} for t in rows))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = TASK.validate_python({"kind": "mlm", "dataset": "someone/huge", "streaming": True, "vocab_size": 64})
    tokenizer, _, streams = prepare_lm(cfg, ("train", "validation"), tmp_path / "cache")
    assert {a[3] for a in asked} == {True} and {a[2] for a in asked} == {"train", "validation"}
    seqs = tokenizer.encode(lines["validation"])
    flat = np.array([t for s in seqs for t in s])
    np.testing.assert_array_equal(np.asarray(streams["validation"]),
                                  token_stream(flat, np.concatenate([[0], np.cumsum([len(s) for s in seqs])]), EOS_ID))


def test_orchestrator_prepare_prints_counts_and_train_reuses_it(tmp_path, capsys):
    from orchestrator.cli import main

    cfg = _lm_files(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"""name: prep
task: {{kind: clm, vocab_size: 80, seq_len: 16, batch_size: 4, files: {{train: {cfg.files.train},
        validation: {cfg.files.validation}}}}}
model: {{d_model: 16, layers: 1, ffn: 32, max_seq_len: 32, attention: {{kind: mha, heads: 2}}}}
run: {{storage_path: {tmp_path / 'runs'}}}
""")
    assert main(["prepare", str(spec), "task.prepared_path=" + str(tmp_path / "shared")]) == 0
    out = capsys.readouterr().out
    corpus = open_corpus(_folder(tmp_path / "shared" / "prepared", "lm-train"), "rebuild")
    assert f"train: {corpus.manifest['columns']['tokens']['n_data']:,} tokens (uint16)" in out
    assert "validation:" in out and str(tmp_path / "shared" / "prepared") in out
    assert f"orchestrator prepare {spec} task.prepared_path=" in corpus.manifest["command"]
    written = (corpus.folder / "manifest.json").stat().st_mtime_ns
    task_cfg = cfg.model_copy(update={"prepared_path": str(tmp_path / "shared")})
    task = build_task(task_cfg, MODEL, WorkerContext(cache_dir=tmp_path / "elsewhere"))
    assert task.tokenizer_cache_hit and (corpus.folder / "manifest.json").stat().st_mtime_ns == written
    assert not (tmp_path / "elsewhere").exists(), "a run with task.prepared_path reads only from it"


@pytest.mark.parametrize("fields, message", [
    ({"prepare_workers": 0}, "task.prepare_workers=0 must be >= 1"),
    ({"tokenizer_sample_mb": 0}, "task.tokenizer_sample_mb=0 must be >= 1"),
    ({"streaming": True}, "task.streaming reads a Hugging Face hub dataset"),
])
def test_corpus_fields_are_checked_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        TASK.validate_python({"kind": "clm", **fields})
    assert TASK.validate_python({"kind": "translation", "prepared_path": "rel/dir"}).prepared_path == str(
        Path("rel/dir").resolve()), "a relative prepared_path is made absolute where the spec is read"
