"""The prepared-corpus format: token ids written once, read by memory map from every worker.

A prepared corpus is a folder with a `manifest.json` and, per column (`tokens` for a language model; `src`,
`tgt` and `references` for translation), shards of two raw little-endian files:
- `<column>-<k>.bin`: the flat data in the smallest dtype that holds it (token ids: uint16 up to a vocabulary of
  65,536, uint32 above; raw text: uint8);
- `<column>-<k>.idx`: int64 [n_items, 2], each item's (start, length) inside its shard's `.bin`.

This is the layout of fairseq's and Megatron-LM's memory-mapped indexed datasets (fairseq
`data/indexed_dataset.py`: `best_fitting_int_dtype`, `MMapIndexedDataset` with a `.bin` of flat tokens and an
`.idx` of sizes and pointers) and of nanoGPT's `data/openwebtext/prepare.py` (one flat uint16 file that training
slices through `np.memmap`), cut into shards of a bounded size so that a corpus of any length is written
and copied piece by piece. Items need not touch: a language model's column holds the stream
`eos doc1 eos doc2 eos ...` (tasks/data.py `token_stream`), whose documents are the items between the eos ids.

Reading maps every shard (`mmap`, advised random access) and hands out views: `Column.stream` slices the
concatenated data across shard borders, `Column.items` returns one item at a time. Nothing copies a whole
column into the process, so N workers on a node share one copy of the corpus in the page cache.

The manifest holds counts, dtype, the source's fingerprint, the tokenizer and a CRC-32 of every file;
`open_corpus` checks sizes, CRCs and index bounds before anything is mapped, and a damaged corpus is refused with
the file's name and the command that rebuilds it.
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_BYTES = 256 << 20
"""A shard is closed once its data file reaches this size (plus at most one chunk): big enough that a 16 GB
corpus is ~64 files, small enough to copy, checksum and rewrite one at a time."""


class DamagedCorpus(RuntimeError):
    """A prepared corpus whose files do not match its manifest; the message names the file and the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id of the vocabulary (ids 0..vocab_size-1); fairseq's
    best_fitting_int_dtype, without its 65,500 safety margin since our ids are known exactly."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"task.vocab_size={vocab_size} does not fit 32-bit token ids; use a smaller vocabulary")


def _crc32(path: Path) -> int:
    """CRC-32 read in buffered chunks (not through a map: a check must not leave the file in this process's RSS)."""
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


# --- writing --------------------------------------------------------------------------------------------------


class ColumnWriter:
    """Appends chunks of items to shards of one column in `folder`; `finish()` returns the manifest entry."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype, shard_bytes: int = SHARD_BYTES):
        self.folder, self.name, self.dtype, self.shard_bytes = Path(folder), name, np.dtype(dtype), shard_bytes
        self.shards: list[dict[str, Any]] = []
        self._data: Any = None
        self._index: Any = None
        self._n_data = 0
        self._n_items = 0

    def _open_shard(self) -> None:
        k = len(self.shards)
        self.shards.append({"data": f"{self.name}-{k:05d}.bin", "index": f"{self.name}-{k:05d}.idx"})
        self._data = open(self.folder / self.shards[-1]["data"], "wb")
        self._index = open(self.folder / self.shards[-1]["index"], "wb")
        self._n_data = self._n_items = 0

    def _close_shard(self) -> None:
        if self._data is None:
            return
        self._data.close()
        self._index.close()
        shard = self.shards[-1]
        shard.update(n_data=self._n_data, n_items=self._n_items,
                     crc_data=_crc32(self.folder / shard["data"]), crc_index=_crc32(self.folder / shard["index"]))
        self._data = self._index = None

    def write(self, data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Append `data` and its items (item i = data[starts[i]:starts[i] + lengths[i]])."""
        if self._data is None or self._n_data * self.dtype.itemsize >= self.shard_bytes:
            self._close_shard()
            self._open_shard()
        if data.size and (data.min() < 0 or data.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"column {self.name!r}: values outside {self.dtype} (max {int(data.max())})")
        self._data.write(np.ascontiguousarray(data, dtype=self.dtype).tobytes())
        index = np.stack([np.asarray(starts, np.int64) + self._n_data, np.asarray(lengths, np.int64)], axis=1)
        self._index.write(np.ascontiguousarray(index, dtype="<i8").tobytes())
        self._n_data += len(data)
        self._n_items += len(starts)

    def finish(self) -> dict[str, Any]:
        if self._data is None:  # an empty column still has one (empty) shard, so a reader needs no special case
            self._open_shard()
        self._close_shard()
        return {"dtype": self.dtype.name, "n_data": sum(s["n_data"] for s in self.shards),
                "n_items": sum(s["n_items"] for s in self.shards), "shards": self.shards}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Written last: a folder without it is an unfinished preparation and is never read."""
    with open(Path(folder) / MANIFEST, "w") as f:
        json.dump({"format": FORMAT_VERSION, **manifest}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# --- reading --------------------------------------------------------------------------------------------------


RELEASE_SPAN = 2 << 20
"""After copying a block out of the map, the 2 MB-aligned span around it is handed back to the page cache
(madvise(MADV_DONTNEED)): mapped pages that were read stay in the process's RSS (as RssFile) until unmapped,
and a read fault maps more than the block (64 KB of `fault_around_bytes`, or a whole large folio, up to 2 MB,
where the page cache holds the file in large folios; measured here: ~0.5 MB a block). Without this a worker
sampling a 16 GB corpus would look as if it held whatever it had touched; nanoGPT re-creates its np.memmap
every batch for the same reason. The next read of such a page is a minor fault from the page cache."""


def _map(path: Path, dtype: np.dtype) -> tuple[np.ndarray, mmap.mmap | None]:
    """Read-only view of a whole file through mmap, advised for random access (blocks are read in shuffled
    order; readahead would pull in pages nobody asked for), and the map itself."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype), None
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype), mapped


@dataclass(frozen=True)
class _Shard:
    data: np.ndarray
    index: np.ndarray  # [n_items, 2] int64: start, length
    maps: tuple[mmap.mmap, ...] = ()


class Column:
    """One column of a prepared corpus, mapped: `stream` and `items` are views, never copies."""

    def __init__(self, shards: list[_Shard], dtype: np.dtype):
        self.shards, self.dtype = shards, dtype
        self.data_starts = np.cumsum([0] + [len(s.data) for s in shards])
        self.item_starts = np.cumsum([0] + [len(s.index) for s in shards])

    def release(self, shard: "_Shard", start: int, stop: int) -> None:
        """Unmap the pages around data[start:stop] of `shard` (already copied out) from this process."""
        if not shard.maps:
            return
        size = len(shard.maps[0])
        lo = (start * self.dtype.itemsize) // RELEASE_SPAN * RELEASE_SPAN
        hi = min(size, -(-(stop * self.dtype.itemsize) // RELEASE_SPAN) * RELEASE_SPAN)
        if hi > lo:
            shard.maps[0].madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    @property
    def stream(self) -> "Stream":
        return Stream(self)

    @property
    def items(self) -> "Items":
        return Items(self)


class Stream:
    """The column's data as one sequence: len(), slices (int64 arrays, across shard borders) and np.asarray."""

    def __init__(self, column: Column):
        self.column = column

    def __len__(self) -> int:
        return int(self.column.data_starts[-1])

    def __getitem__(self, key: slice | int) -> np.ndarray | int:
        if isinstance(key, (int, np.integer)):
            n = len(self)
            i = int(key) + n if key < 0 else int(key)
            if not 0 <= i < n:
                raise IndexError(f"index {key} out of a stream of {n}")
            return int(self.read(i, i + 1)[0])
        start, stop, step = key.indices(len(self))
        out = self.read(start, max(start, stop))
        return out if step == 1 else out[::step]

    def read(self, start: int, stop: int) -> np.ndarray:
        """data[start:stop] as int64, gathered from the shards it spans."""
        starts = self.column.data_starts
        if stop <= start:
            return np.zeros(0, np.int64)
        first = int(np.searchsorted(starts, start, side="right")) - 1
        pieces, spans = [], []
        k = first
        while k < len(self.column.shards) and starts[k] < stop:
            base = int(starts[k])
            lo, hi = max(start - base, 0), min(stop - base, len(self.column.shards[k].data))
            pieces.append(self.column.shards[k].data[lo:hi])
            spans.append((self.column.shards[k], lo, hi))
            k += 1
        out = np.concatenate(pieces).astype(np.int64) if len(pieces) > 1 else pieces[0].astype(np.int64)
        for shard, lo, hi in spans:
            self.column.release(shard, lo, hi)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.read(0, len(self))  # a full copy: for tests and small evaluation splits only
        return out if dtype is None else out.astype(dtype)


class Items(Sequence):
    """The column's items (documents, sentences): items[i] is an int64 array (a view with `cast` None),
    `lengths` all their lengths."""

    def __init__(self, column: Column, cast: np.dtype | None = np.dtype(np.int64)):
        self.column, self.cast = column, cast

    def __len__(self) -> int:
        return int(self.column.item_starts[-1])

    def _locate(self, i: int) -> tuple[_Shard, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of {n}")
        i = i + n if i < 0 else i
        k = int(np.searchsorted(self.column.item_starts, i, side="right")) - 1
        return self.column.shards[k], i - int(self.column.item_starts[k])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return [self[i] for i in range(*key.indices(len(self)))]
        shard, j = self._locate(int(key))
        start, length = shard.index[j]
        item = shard.data[start:start + length]
        if self.cast is None:  # a view: the caller copies it and releases (Texts)
            return item
        out = item.astype(self.cast)
        self.column.release(shard, start, start + length)
        return out

    def copy(self, i: int) -> bytes:
        """Item i's raw bytes, copied out of the map, whose pages are then released."""
        shard, j = self._locate(i)
        start, length = shard.index[j]
        out = shard.data[start:start + length].tobytes()
        self.column.release(shard, start, start + length)
        return out

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def pick(self, indices: np.ndarray) -> "Picked":
        """The items at `indices`, in that order, as a view."""
        return Picked(self, np.asarray(indices, np.int64))

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([s.index[:, 1] for s in self.column.shards]) if self.column.shards else np.zeros(0, np.int64)


class Picked(Sequence):
    """A subset of a column's items, by index."""

    def __init__(self, items: Items, indices: np.ndarray):
        self.items, self.indices = items, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return [self[i] for i in range(*key.indices(len(self)))]
        return self.items[int(self.indices[key])]


class Texts(Sequence):
    """A uint8 column read back as str items (the raw reference sentences of translation)."""

    def __init__(self, column: Column):
        self.items = Items(column, cast=None)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return [self[i] for i in range(*key.indices(len(self)))]
        return self.items.copy(int(key)).decode("utf-8")


@dataclass(frozen=True)
class PreparedCorpus:
    folder: Path
    manifest: dict[str, Any]
    columns: dict[str, Column]


def _damaged(folder: Path, what: str, rebuild: str) -> DamagedCorpus:
    return DamagedCorpus(f"prepared corpus {folder}: {what}. Rebuild it with `{rebuild}` (it replaces a damaged "
                         f"corpus), or delete {folder} and the next run prepares it again")


def open_corpus(folder: Path, rebuild: str, *, verify: bool = True) -> PreparedCorpus:
    """Map every shard of a finished corpus after checking it against its manifest (sizes always; CRC-32 of
    every file with `verify`). DamagedCorpus names the bad file and `rebuild`, the command that remakes it."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise _damaged(folder, f"{MANIFEST} cannot be read ({err})", rebuild) from None
    rebuild = manifest.get("command") or rebuild  # the command that made it, when `orchestrator prepare` did
    if manifest.get("format") != FORMAT_VERSION:
        raise _damaged(folder, f"format {manifest.get('format')} is not this version's {FORMAT_VERSION}", rebuild)
    columns = {}
    for name, entry in manifest["columns"].items():
        dtype = np.dtype(entry["dtype"])
        shards = []
        for shard in entry["shards"]:
            for key, size, crc in (("data", shard["n_data"] * dtype.itemsize, "crc_data"),
                                   ("index", shard["n_items"] * 16, "crc_index")):
                path = folder / shard[key]
                if not path.is_file():
                    raise _damaged(folder, f"{path.name} is missing", rebuild)
                if path.stat().st_size != size:
                    raise _damaged(folder, f"{path.name} has {path.stat().st_size} bytes, the manifest says {size} "
                                           "(truncated or overwritten)", rebuild)
                if verify and _crc32(path) != shard[crc]:
                    raise _damaged(folder, f"{path.name} does not match its CRC-32 (corrupted)", rebuild)
            index, index_map = _map(folder / shard["index"], np.dtype("<i8"))
            index = index.reshape(-1, 2)
            # the CRC vouches for every entry; the ends catch a manifest paired with another corpus's files
            # without touching the whole index (its pages would count in this process's RSS)
            if len(index) and (index[0, 0] < 0 or int(index[-1, 0] + index[-1, 1]) > shard["n_data"]):
                raise _damaged(folder, f"{shard['index']} points outside {shard['data']}", rebuild)
            data, data_map = _map(folder / shard["data"], dtype)
            shards.append(_Shard(data, index, tuple(m for m in (data_map, index_map) if m is not None)))
        columns[name] = Column(shards, dtype)
    return PreparedCorpus(folder, manifest, columns)
