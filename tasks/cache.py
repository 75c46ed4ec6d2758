"""On-disk cache helpers shared by the tokenizer cache (tasks/tokenizer.py) and the token-id cache
(tasks/data.py): content-hash keys, an inter-process lock per entry and atomic writes.

They live here, not in either user, because they know nothing of tokenizers or datasets: data.py needs them
without reaching into tokenizer.py, and tokenizer.py needs them without depending on data.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def cache_key(**parts: object) -> str:
    """Stable short hash of JSON-able parts (data fingerprint, settings)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def file_fingerprint(path: Path) -> str:
    """Content hash of a file (name-independent, so a copied dataset still hits the cache)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (flock): one producer per cache entry, the others wait and then reuse."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Run write(tmp) on a temporary path in the same folder, then rename it onto `path` in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remembered_fingerprint(path: Path, memo_dir: Path) -> str:
    """`file_fingerprint`, remembered in `memo_dir` under the file's path, size and modification time: every
    worker of every run asks for the fingerprint of a corpus that may be gigabytes, and reads it only once."""
    memo = _memo(path, memo_dir)
    if memo.is_file():
        return memo.read_text().strip()
    digest = file_fingerprint(path)
    atomic_write(memo, lambda tmp: tmp.write_text(digest))
    return digest


def recalled_fingerprint(path: Path, memo_dir: Path) -> str | None:
    """`remembered_fingerprint` if it was remembered, else None: reads the memo only, never the file, and writes
    nothing (None too for a missing file)."""
    try:
        memo = _memo(path, memo_dir)
    except FileNotFoundError:
        return None
    return memo.read_text().strip() if memo.is_file() else None


def _memo(path: Path, memo_dir: Path) -> Path:
    """The memo of a file's fingerprint: keyed by its path, size and modification time, so an edited file misses."""
    stat = Path(path).stat()
    return Path(memo_dir) / cache_key(path=str(Path(path).resolve()), size=stat.st_size, mtime=stat.st_mtime_ns)
