"""Raw text of every source, read in chunks: local files (plain or gzipped), the generated corpus, and Hugging Face
hub datasets (downloaded in full, or with `task.streaming` read row by row without a download).

Every reader yields `Chunk`s (a list of documents or pairs, and how far into the source it is) so that a corpus
of any size passes through a bounded window of memory: tasks/corpus_prepare.py tokenises the chunks, tasks/data.py
`lm_texts` lists them for the small splits that are wanted in memory (word counts, tests).

Local files are split into lines exactly as `datasets`' text builder does (datasets
`packaged_modules/text/text.py` `_generate_tables`: the file opened in text mode, so "\r\n" and "\r" become "\n",
read 10 MB at a time completed to the end of a line, split on "\n" only), so a line here is the row the
in-memory path of earlier versions read through `load_dataset("text")`.
"""

from __future__ import annotations

import gzip
import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from tasks.config import CausalLMTaskConfig, ClassifyTaskConfig, MLMTaskConfig, TranslationTaskConfig
from tasks.corpora import builtin_lm_corpus, builtin_parallel_corpus

LMConfig = MLMTaskConfig | CausalLMTaskConfig
CHUNK_CHARS = 4 << 20
"""Characters of text per chunk: large enough to amortise a worker round trip, small enough that a few chunks in
flight per worker stay within tens of MB."""
CHUNK_ROWS = 20000
"""Rows per chunk for sources read row by row (the generated corpus, hub datasets)."""


# --- files and the hub ----------------------------------------------------------------------------------------


def _resolve(path: str, field: str) -> Path:
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"{field}={path!r} does not exist (relative paths are resolved against the "
                                f"working directory {Path.cwd()}); fix the path in the spec")
    return resolved


def _parallel_file(prefix: str, lang: str, field: str) -> Path:
    """`<prefix>.<lang>` or `<prefix>.<lang>.gz`."""
    for candidate in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if candidate.expanduser().exists():
            return candidate.expanduser()
    raise FileNotFoundError(f"{field}={prefix!r}: neither {prefix}.{lang} nor {prefix}.{lang}.gz exists (relative to "
                            f"{Path.cwd()}); give the path prefix without the language suffix")


def _hf_cache(cache_dir: Path) -> str:
    return str(Path(cache_dir) / "hf_datasets")


def _hub_error(cfg: LMConfig | TranslationTaskConfig | ClassifyTaskConfig, err: Exception) -> RuntimeError:
    """Offline, unknown name, gated: all end in the same advice."""
    if isinstance(cfg, TranslationTaskConfig):
        example = "{train: data/train, validation: data/val, test: data/test}  (prefixes of <prefix>.<lang>[.gz])"
    elif isinstance(cfg, ClassifyTaskConfig):
        example = ("{train: data/train.tsv, validation: data/dev.tsv, test: data/test.tsv}  (TSV/CSV/JSONL with "
                   "a header row)")
    else:
        example = "{train: data/train.txt, validation: data/valid.txt, test: data/test.txt}"
    return RuntimeError(
        f"task.dataset={cfg.dataset!r} (task.config={cfg.config!r}) could not be loaded from the Hugging Face "
        f"hub: {type(err).__name__}: {err}. Offline or behind a firewall, point the spec at local files with "
        f"task.files: {example}, or use task.dataset: builtin for the generated corpus"
    )


def _load_hub(cfg: LMConfig | TranslationTaskConfig | ClassifyTaskConfig, cache_dir: Path) -> Any:
    import datasets  # heavy import, only on a cache miss

    try:
        return datasets.load_dataset(cfg.dataset, cfg.config, cache_dir=_hf_cache(cache_dir))
    except Exception as err:  # noqa: BLE001 - every failure gets the advice
        raise _hub_error(cfg, err) from err


def _hub_endpoint() -> str:
    import os

    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connection to the hub's host, so an offline machine is known in seconds, not after the hub
    client's five retries (about 25 s); HF_HUB_OFFLINE / HF_DATASETS_OFFLINE count as unreachable."""
    import os
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(name, "").lower() in ("1", "true", "yes") for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    url = urlparse(_hub_endpoint())
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
    except OSError:
        return False
    return True


def _in_local_cache(name: str, cache_dir: Path) -> bool:
    """`name` was downloaded before: into this project's datasets cache (`datasets` names the folder
    <namespace>___<name>) or into the hub's own cache (datasets--<namespace>--<name>)."""
    return ((Path(_hf_cache(cache_dir)) / name.replace("/", "___")).is_dir()
            or (hub_cache() / f"datasets--{name.replace('/', '--')}").is_dir())


def hub_cache() -> Path:
    """The Hugging Face hub's cache folder as the environment names it now (huggingface_hub reads it once, at
    import)."""
    import os

    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return Path(os.environ.get("HF_HUB_CACHE", home / "hub"))


def hub_dataset_problem(cfg: LMConfig | TranslationTaskConfig | ClassifyTaskConfig, cache_dir: Path) -> str | None:
    """Why `task.dataset` cannot be loaded, found without downloading it (the launcher asks before Ray starts;
    the worker would find out only after a cluster start); None when it is cached or the hub knows it."""
    if cfg.files is not None or cfg.dataset == "builtin":
        return None
    advice = "point the spec at local files with task.files, or use task.dataset: builtin for the generated corpus"
    if not hub_reachable():
        if _in_local_cache(cfg.dataset, cache_dir):
            return None
        return (f"task.dataset={cfg.dataset!r} is not in the local cache ({_hf_cache(cache_dir)}) and the Hugging "
                f"Face hub ({_hub_endpoint()}) cannot be reached from this machine; {advice}")
    return hub_repo_problem("task.dataset", cfg.dataset, "dataset", advice)


def hub_repo_problem(field: str, name: str, kind: str, advice: str) -> str | None:
    """Why the reachable hub cannot give repository `name` (a "dataset" or a "model", named by spec field
    `field`): gated or unknown, from one info request; None when it knows it, or when its answer is no verdict."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    api = HfApi(endpoint=_hub_endpoint())
    try:
        (api.dataset_info if kind == "dataset" else api.model_info)(name, timeout=10)
    except GatedRepoError:
        return (f"{field}={name!r} is gated on the hub: accept its terms on the hub and log in (`hf auth login`, or "
                f"HF_TOKEN on every node), or {advice}")
    except RepositoryNotFoundError:
        return f"{field}={name!r}: the Hugging Face hub has no such {kind} (check the spelling); or {advice}"
    except Exception:  # noqa: BLE001 - a flaky answer is not a verdict: the worker's own load will say more
        return None
    return None


def _hub_split(ds: Any, split: str, cfg: Any) -> Any:
    if split not in ds:
        raise ValueError(f"task.dataset={cfg.dataset!r} has splits {list(ds)}, not {split!r}; "
                         "change task.eval_split or use task.files")
    return ds[split]



@dataclass(frozen=True)
class Chunk:
    """Documents (LM: list[str]) or pairs (translation: (sources, targets)) and the progress after them, in
    the source's `unit`."""

    items: Any
    done: int


@dataclass(frozen=True)
class Source:
    """One split of one source: `chunks()` reads it from the start; `total` (in `unit`) drives the progress bar
    and `text_bytes` (an estimate, or None when unknown) the tokenizer's sample."""

    label: str
    unit: str
    total: int | None
    text_bytes: int | None
    chunks: Callable[[], Iterator[Chunk]]
    slices: Callable[[], Iterator[tuple["FileSlice", int]]] | None = None
    """For a plain local file: the same documents as `chunks`, as byte ranges that the encoding process reads
    itself (`FileSlice.documents`)."""

    def chunks_at_most(self, n: int) -> bool:
        """Whether the source is known to read as at most n chunks."""
        per_chunk = {"B": CHUNK_CHARS}.get(self.unit, CHUNK_ROWS)
        return self.total is not None and self.unit != "row" and self.total <= n * per_chunk


def file_lines(path: Path, chunk_chars: int | None = None) -> Iterator[tuple[list[str], int]]:
    """(lines, bytes of the file read so far) per chunk; .gz decompressed on the fly."""
    chunk_chars = chunk_chars or CHUNK_CHARS
    with open(path, "rb") as raw:
        binary = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
        text = io.TextIOWrapper(binary, encoding="utf-8")  # universal newlines, as the text builder's open()
        while True:
            try:
                batch = text.read(chunk_chars)
            except UnicodeDecodeError as err:
                raise not_utf8(path, err, f"after about {raw.tell()} bytes") from None
            if not batch:
                return
            batch += text.readline()  # finish the current line
            yield split_lines(batch), raw.tell()


def not_utf8(path: Path, err: UnicodeDecodeError, where: str) -> ValueError:
    """A corpus file with a byte that is not UTF-8, named with where it is (a bare UnicodeDecodeError names no
    file, and surfaces from a Ray worker minutes after the launch)."""
    return ValueError(f"{path} is not UTF-8 text: {err.reason} ({where}); convert it, e.g. iconv -f latin1 -t utf-8")


def split_lines(text: str) -> list[str]:
    """The lines of `text` (newlines already translated to "\n"), as `datasets`' text builder splits them: on
    "\n" only, a final newline ending the last line rather than starting an empty one."""
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines


@dataclass(frozen=True)
class FileSlice:
    """Bytes [start, end) of a plain text file, cut after a newline: a chunk of lines that the process which
    encodes it reads for itself. A pool worker then receives three numbers instead of megabytes of pickled
    strings, and the preparing process, which otherwise reads, splits and pickles every line while its workers
    wait, only writes their output: on 2 cores that serial share was what kept 2 processes from being 2x one."""

    path: str
    start: int
    end: int

    def documents(self) -> list[str]:
        """The slice's documents, exactly the lines `file_lines` gives for these bytes (universal newlines, as
        a text-mode open translates them), then filtered by `documents_of`."""
        with open(self.path, "rb") as raw:
            raw.seek(self.start)
            data = raw.read(self.end - self.start)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise not_utf8(Path(self.path), err, f"at byte {self.start + err.start}") from None
        return documents_of(split_lines(text.replace("\r\n", "\n").replace("\r", "\n")))


def file_slices(path: Path, chunk_bytes: int | None = None) -> Iterator[tuple[FileSlice, int]]:
    """(slice, bytes of the file covered so far) per chunk of about `chunk_bytes`, each ending after a b"\n"
    (or at the end of the file), so no line, and no UTF-8 character or "\r\n" pair, is cut in two."""
    chunk_bytes = chunk_bytes or CHUNK_CHARS
    size = path.stat().st_size
    with open(path, "rb") as raw:
        start = 0
        while start < size:
            raw.seek(min(start + chunk_bytes, size))
            raw.readline()  # on to the end of the line the cut fell in
            end = min(raw.tell(), size)
            yield FileSlice(str(path), start, end), end
            start = end


def documents_of(lines: list[str]) -> list[str]:
    """A language model's documents among a file's lines: the non-blank ones."""
    return [line for line in lines if line and line.strip()]


def _rows(cfg: Any, split: str, cache_dir: Path, column: str) -> tuple[Iterator[tuple[list[Any], int]], int | None]:
    """(chunks of one column's values with the rows read so far, total rows if known) of a hub split."""
    if cfg.streaming:  # no download: rows arrive over the network as they are read
        import datasets

        try:
            ds = datasets.load_dataset(cfg.dataset, cfg.config, split=split, streaming=True,
                                       cache_dir=_hf_cache(cache_dir))
        except ValueError as err:  # an unknown split
            raise ValueError(f"task.dataset={cfg.dataset!r}: {err}; change task.eval_split or use task.files") from None
        except Exception as err:  # noqa: BLE001 - offline, unknown, gated: the advice of _load_hub
            raise _hub_error(cfg, err) from err
        splits = getattr(ds.info, "splits", None) or {}
        total = splits[split].num_examples if split in splits else None
    else:
        ds = _hub_split(_load_hub(cfg, cache_dir), split, cfg)
        total = len(ds)
    names = ds.column_names
    if names is not None and column not in names:
        what = "language modelling" if column == "text" else "translation"
        raise ValueError(f"task.dataset={cfg.dataset!r} has columns {names}, no {column!r} column for {what}; "
                         "export the text and use task.files")

    def read() -> Iterator[tuple[list[Any], int]]:
        done = 0
        for batch in ds.iter(batch_size=CHUNK_ROWS):
            done += len(batch[column])
            yield batch[column], done

    return read(), total


def _in_chunks(items: list[Any]) -> Iterator[tuple[list[Any], int]]:
    for start in range(0, len(items), CHUNK_ROWS):
        yield items[start:start + CHUNK_ROWS], min(start + CHUNK_ROWS, len(items))


def lm_source(cfg: LMConfig, split: str, cache_dir: Path) -> Source:
    """A language-model split as chunks of documents (non-empty lines)."""
    def documents(raw: Iterator[tuple[list[str], int]]) -> Iterator[Chunk]:
        for lines, done in raw:
            yield Chunk(documents_of(lines), done)

    if cfg.files is not None:
        path = _resolve(getattr(cfg.files, split), f"task.files.{split}")
        size = path.stat().st_size
        plain = path.suffix != ".gz"  # a gzipped file is read from its start only: no slices
        return Source(str(path), "B", size, size if plain else None, lambda: documents(file_lines(path)),
                      slices=(lambda: file_slices(path)) if plain else None)
    if cfg.dataset == "builtin":
        lines = builtin_lm_corpus(cfg.builtin)[split]
        return Source(f"builtin {split}", "doc", len(lines), sum(len(t) + 1 for t in lines),
                      lambda: documents(_in_chunks(lines)))
    _, total = _rows(cfg, split, cache_dir, "text")  # fail now, with the advice, not inside the reading loop
    return Source(f"{cfg.source_label} {split}", "row", total, None,
                  lambda: documents(_rows(cfg, split, cache_dir, "text")[0]))


def _file_pairs(src: Path, tgt: Path, field: str) -> Iterator[tuple[tuple[list[str], list[str]], int]]:
    """Line-aligned chunks of two files; a length mismatch is an error once either side ends."""
    def lines(path: Path) -> Iterator[tuple[str, int]]:
        for chunk, done in file_lines(path):
            for line in chunk:
                yield line, done

    left, right = lines(src), lines(tgt)
    n, out_src, out_tgt, done = 0, [], [], 0
    while True:
        a, b = next(left, None), next(right, None)  # not zip: it would swallow the longer side's extra line
        if a is None or b is None:
            break
        out_src.append(a[0])
        out_tgt.append(b[0])
        n, done = n + 1, a[1] + b[1]
        if len(out_src) == CHUNK_ROWS:
            yield (out_src, out_tgt), done
            out_src, out_tgt = [], []
    rest_src, rest_tgt = (a is not None) + sum(1 for _ in left), (b is not None) + sum(1 for _ in right)
    if rest_src or rest_tgt:
        raise ValueError(f"{field}: {src} has {n + rest_src} lines but {tgt} has {n + rest_tgt}; parallel files "
                         "must be line-aligned")
    if out_src:
        yield (out_src, out_tgt), done


def parallel_source(cfg: TranslationTaskConfig, split: str, cache_dir: Path) -> Source:
    """A translation split as chunks of (sources, targets); a pair with either side empty is dropped, which
    keeps the two sides aligned."""
    src_lang, tgt_lang = cfg.source_lang, cfg.target_lang

    def cleaned(raw: Iterator[tuple[tuple[list[str], list[str]], int]]) -> Iterator[Chunk]:
        for (src, tgt), done in raw:
            pairs = [(a, b) for a, b in zip(src, tgt) if a.strip() and b.strip()]
            yield Chunk(([a for a, _ in pairs], [b for _, b in pairs]), done)

    if cfg.files is not None:
        field = f"task.files.{split}"
        paths = [_parallel_file(getattr(cfg.files, split), lang, field) for lang in (src_lang, tgt_lang)]
        size = sum(p.stat().st_size for p in paths)
        plain = all(p.suffix != ".gz" for p in paths)
        return Source(str(paths[0]), "B", size, size if plain else None,
                      lambda: cleaned(_file_pairs(paths[0], paths[1], field)))
    if cfg.dataset == "builtin":
        src, tgt = builtin_parallel_corpus(cfg.builtin, src_lang, tgt_lang)[split]
        return Source(f"builtin {split}", "pair", len(src), sum(len(a) + len(b) + 2 for a, b in zip(src, tgt)),
                      lambda: cleaned(((s, t), done) for (s, done), (t, _) in zip(_in_chunks(src), _in_chunks(tgt))))

    def rows() -> Iterator[tuple[tuple[list[str], list[str]], int]]:
        for chunk, done in _rows(cfg, split, cache_dir, "translation")[0]:
            missing = {src_lang, tgt_lang} - set(chunk[0]) if chunk else set()
            if missing:
                raise ValueError(f"task.source_lang/target_lang: {sorted(missing)} not in {sorted(chunk[0])} of "
                                 f"{cfg.dataset!r}; choose languages the dataset has")
            yield ([r[src_lang] for r in chunk], [r[tgt_lang] for r in chunk]), done

    _, total = _rows(cfg, split, cache_dir, "translation")
    return Source(f"{cfg.source_label} {split}", "row", total, None, lambda: cleaned(rows()))


def sample(lines: Iterator[str], text_bytes: int | None, budget_bytes: int) -> Iterator[str]:
    """A bounded sample of lines for the tokenizer: every line, in order, when the text fits the budget (so a
    corpus that fits trains the same model as before); else each line with probability budget / size under a
    fixed seed, spread over the whole corpus; with the size unknown (a gzipped file, a streamed hub set), the
    first lines. Never more than the budget."""
    if text_bytes is not None and text_bytes <= budget_bytes:
        yield from lines
        return
    keep = budget_bytes / text_bytes if text_bytes else 1.0
    rng = random.Random(0)
    taken = 0
    for line in lines:
        if rng.random() >= keep:
            continue
        taken += len(line) + 1
        if taken > budget_bytes:
            return
        yield line
