"""Preparing a corpus: text streamed in chunks, tokenised on every core, written as memory-mapped shards.

The pipeline is nanoGPT's `data/openwebtext/prepare.py` (tokenise on `num_proc` processes, append eot to every
document, write the ids into one flat uint16 file) made streaming: the text is cut into chunks
(tasks/text_sources.py; a plain file into byte ranges that each worker reads itself, `FileSlice`), a pool of
forked processes encodes them with the sentencepiece model, and the main process writes the results in order
into bounded shards (tasks/corpus_format.py), so memory holds only a few chunks at any time whatever the
corpus size. Chunks are submitted ahead by at most two per worker and taken
back in submission order, which keeps the output identical to encoding the whole split in one call.

Why a process pool on one machine and not `datasets.map(num_proc=...)` or Ray Data: `map` first converts the
whole text into an Arrow cache on disk (a second copy of the corpus) and then a third as token lists; Ray Data
would spread the tokenising over a cluster, but encoding runs at ~20 MB/s per core, so one 8-core node prepares
the 16 GB of BookCorpus + Wikipedia in about two hours, once, and every node then maps the result. Workers are
forked, as torch's DataLoader does inside Ray Train workers, so they start in milliseconds and share the
parent's imported modules.

Atomic and restartable: a corpus is written into `<folder>.partial-<pid>` under an exclusive lock and renamed
onto `<folder>` only after its manifest is written, so a killed preparation leaves no folder that a run would
read; the next preparation takes the lock, removes the unfinished folder, says so, and starts again.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from tasks import corpus_format
from tasks.cache import locked
from tasks.corpus_format import (
    MANIFEST,
    ColumnWriter,
    DamagedCorpus,
    PreparedCorpus,
    open_corpus,
    write_manifest,
)
from tasks.text_sources import FileSlice, Source

_SP: Any = None  # the sentencepiece model of a pool worker (set by _start_worker)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """A killed preparation takes its pool with it: a forked worker holds both ends of its task pipe, so it
    would otherwise never see the parent go and keep encoding queued chunks for nobody (Linux prctl)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pool's own shutdown is all there is
        pass


def _start_worker(model_path: str) -> None:
    global _SP
    import sentencepiece as spm

    _die_with_parent()

    _SP = spm.SentencePieceProcessor(model_file=model_path)


def encode_documents(sp: Any, docs: list[str], eos: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids with eos after every document, each document's start, each document's length): one column chunk."""
    seqs = sp.encode(docs, out_type=int, num_threads=1)  # one thread: parallelism comes from the processes
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    ends = np.cumsum(lengths + 1) - 1  # where each document's eos goes
    out = np.empty(int(ends[-1]) + 1 if len(ends) else 0, dtype=dtype)
    out[ends] = eos
    body = np.ones(len(out), dtype=bool)
    body[ends] = False
    out[body] = np.fromiter(itertools.chain.from_iterable(seqs), dtype=dtype, count=int(lengths.sum()))
    return out, ends - lengths, lengths


def _encode_task(columns: tuple[list[str] | FileSlice, ...], eos: int,
                 dtype: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [encode_documents(_SP, docs.documents() if isinstance(docs, FileSlice) else docs, eos, np.dtype(dtype))
            for docs in columns]


def default_workers() -> int:
    """Cores this process may run on (the container's share, not the host's count)."""
    return len(os.sched_getaffinity(0))


def encoded_chunks(model_path: Path, chunks: Iterator[tuple[tuple[list[str] | FileSlice, ...], int]], eos: int,
                   dtype: np.dtype, workers: int) -> Iterator[tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray]], int]]:
    """(encoded columns, progress) per chunk, in the order the chunks came; `workers` processes encode them."""
    if workers <= 1:
        _start_worker(str(model_path))
        for columns, done in chunks:
            yield _encode_task(columns, eos, dtype.name), done
        return
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                             initargs=(str(model_path),)) as pool:
        pending: deque = deque()
        for columns, done in chunks:
            pending.append((pool.submit(_encode_task, columns, eos, dtype.name), done))
            if len(pending) >= 2 * workers:  # bounded read-ahead: the reader never runs away with the corpus
                future, progress = pending.popleft()
                yield future.result(), progress
        while pending:
            future, progress = pending.popleft()
            yield future.result(), progress


class Progress:
    """Progress of one split: a tqdm bar with tokens/s on a terminal, otherwise a line every 30 s (a Ray
    worker's log); the ETA comes from the source's progress unit (bytes of a file, rows of a dataset)."""

    def __init__(self, label: str, unit: str, total: int | None):
        self.label, self.unit, self.total, self.start, self.tokens = label, unit, total, time.monotonic(), 0
        self.last_line, self.done = self.start, 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, unit_scale=True, desc=f"prepare {label}", mininterval=1.0)

    def update(self, done: int, tokens: int) -> None:
        self.tokens += tokens
        now = time.monotonic()
        rate = self.tokens / max(now - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(done - self.done)
            self.bar.set_postfix_str(f"{rate / 1e6:.2f}M tok/s", refresh=False)
        elif now - self.last_line >= 30:
            self.last_line = now
            share = f"{100 * done / self.total:.0f}%" if self.total else f"{done:,} {self.unit} read"
            eta = (now - self.start) * (self.total - done) / max(done, 1) if self.total else None
            print(f"prepare {self.label}: {share}, {self.tokens / 1e6:.1f}M tokens, {rate / 1e6:.2f}M tok/s"
                  + (f", ETA {eta:.0f} s" if eta is not None else ""), file=sys.stderr, flush=True)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass(frozen=True)
class ColumnSpec:
    """A column the chunks fill: its name, dtype, and whether the stream opens with eos (a language model's
    stream `eos doc1 eos doc2 eos ...`: the first token then has a context and is a target)."""

    name: str
    dtype: np.dtype
    leading_eos: bool = False


def write_columns(folder: Path, source: Source, columns: list[ColumnSpec], model_path: Path, eos: int,
                  workers: int, texts: str | None = None) -> dict[str, Any]:
    """Encode every chunk of `source` into the columns (one per element of a chunk's items: one for documents,
    two for pairs; `texts` names an extra column keeping the raw text of the last element, utf-8); returns the
    manifest's columns and counts. A source of one or two chunks is encoded in this process (a pool would
    cost more to start than it saves)."""
    if source.chunks_at_most(2):
        workers = 1
    shard_bytes = corpus_format.SHARD_BYTES  # read now, not at import: tests shrink it to get many shards
    writers = [ColumnWriter(folder, c.name, c.dtype, shard_bytes) for c in columns]
    for writer, column in zip(writers, columns):
        if column.leading_eos:
            writer.write(np.array([eos]), np.zeros(0, np.int64), np.zeros(0, np.int64))
    text_writer = ColumnWriter(folder, texts, np.dtype(np.uint8), shard_bytes) if texts else None
    progress = Progress(source.label, source.unit, source.total)

    def chunks() -> Iterator[tuple[tuple[list[str] | FileSlice, ...], int]]:
        if source.slices is not None and len(columns) == 1 and text_writer is None:
            for piece, done in source.slices():  # the encoding process reads the lines (FileSlice's docstring)
                yield (piece,), done
            return
        for chunk in source.chunks():
            items = chunk.items if len(columns) > 1 else (chunk.items,)
            if text_writer is not None:
                encoded = [line.encode("utf-8") for line in items[-1]]
                lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
                text_writer.write(np.frombuffer(b"".join(encoded), np.uint8), np.cumsum(lengths) - lengths, lengths)
            yield items, chunk.done

    try:
        for encoded, done in encoded_chunks(model_path, chunks(), eos, columns[0].dtype, workers):
            for writer, (data, starts, lengths) in zip(writers, encoded):
                writer.write(data, starts, lengths)
            progress.update(done, int(sum(len(data) for data, _, _ in encoded)))
    finally:
        progress.close()
    out = {w.name: w.finish() for w in writers}
    if text_writer is not None:
        out[texts] = text_writer.finish()
    return {"columns": out, "seconds": round(time.monotonic() - progress.start, 3)}


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepared(folder: Path, build: Callable[[Path], dict[str, Any]], rebuild: str, *,
             replace_damaged: bool = False) -> tuple[PreparedCorpus, bool]:
    """(the corpus at `folder`, whether it was there already), building it with `build(tmp_folder)` (which
    returns the manifest) when missing. One process builds under an exclusive lock while the others wait
    and then map its result. A damaged corpus raises DamagedCorpus, unless `replace_damaged` (the rebuild
    command) says to build it again."""
    folder = Path(folder)
    if (folder / MANIFEST).exists():
        try:
            return open_corpus(folder, rebuild), True
        except DamagedCorpus as err:
            if not replace_damaged:
                raise
            _say(f"{err}\nrebuilding it")
    with locked(folder.parent / f"{folder.name}.lock"):
        if (folder / MANIFEST).exists():  # another process built (or rebuilt) it while we waited
            try:
                return open_corpus(folder, rebuild), True
            except DamagedCorpus:
                if not replace_damaged:
                    raise
        for stale in folder.parent.glob(f"{folder.name}.partial-*"):  # we hold the lock: its writer is gone
            _say(f"removing {stale}: an unfinished preparation (the process was stopped); preparing again")
            shutil.rmtree(stale, ignore_errors=True)
        tmp = folder.parent / f"{folder.name}.partial-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            write_manifest(tmp, build(tmp))
            if folder.exists():  # a damaged corpus being replaced: out of the way first, then the new one in
                old = folder.parent / f"{folder.name}.damaged-{os.getpid()}"
                os.replace(folder, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return open_corpus(folder, rebuild, verify=False), False  # just written and checksummed
