"""Text sources, tokenised and cached, and the sharded, resumable batch order every task uses.

Sources: the generated offline corpus (tasks/corpora.py), local files, or a Hugging Face hub dataset. Files and
hub names go through the same `datasets` code path (`load_dataset("text", data_files=...)` for files). The
tokenizer is trained on the training split (tasks/tokenizer.py) and every split's token ids are cached next to
it, keyed by a hash of the data and the tokenizer, so `build_task` on a worker is a few file reads.

Batch order: each epoch is a seeded permutation split into batches; rank r of w takes batches r, r + w, ...,
so the ranks together see every example exactly once per epoch. A position {"epoch", "step"} resumes exactly.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np

from tasks.cache import atomic_write, cache_key, file_fingerprint, locked
from tasks.config import CausalLMTaskConfig, ClassifyTaskConfig, MLMTaskConfig, TranslationTaskConfig
from tasks.corpora import builtin_lm_corpus, builtin_parallel_corpus
from tasks.tokenizer import EOS_ID, Tokenizer, train_or_load

LMConfig = MLMTaskConfig | CausalLMTaskConfig
T = TypeVar("T")


# --- raw text -------------------------------------------------------------------------------------------------


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


def _load_text_files(data_files: dict[str, Path], cache_dir: Path) -> dict[str, list[str]]:
    """One line per row through `datasets`' text builder (handles .gz)."""
    import datasets  # heavy import, only on a cache miss

    ds = datasets.load_dataset("text", data_files={k: str(v) for k, v in data_files.items()},
                               cache_dir=_hf_cache(cache_dir))
    return {split: list(ds[split]["text"]) for split in data_files}


def _load_hub(cfg: LMConfig | TranslationTaskConfig | ClassifyTaskConfig, cache_dir: Path) -> Any:
    import datasets  # heavy import, only on a cache miss

    try:
        return datasets.load_dataset(cfg.dataset, cfg.config, cache_dir=_hf_cache(cache_dir))
    except Exception as err:  # offline, unknown name, gated: all end in the same advice
        if isinstance(cfg, TranslationTaskConfig):
            example = "{train: data/train, validation: data/val, test: data/test}  (prefixes of <prefix>.<lang>[.gz])"
        elif isinstance(cfg, ClassifyTaskConfig):
            example = ("{train: data/train.tsv, validation: data/dev.tsv, test: data/test.tsv}  (TSV/CSV/JSONL with "
                       "a header row)")
        else:
            example = "{train: data/train.txt, validation: data/valid.txt, test: data/test.txt}"
        raise RuntimeError(
            f"task.dataset={cfg.dataset!r} (task.config={cfg.config!r}) could not be loaded from the Hugging Face "
            f"hub: {type(err).__name__}: {err}. Offline or behind a firewall, point the spec at local files with "
            f"task.files: {example}, or use task.dataset: builtin for the generated corpus"
        ) from err


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
    import os

    hub_cache = Path(os.environ.get("HF_HUB_CACHE", Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"))
    return ((Path(_hf_cache(cache_dir)) / name.replace("/", "___")).is_dir()
            or (hub_cache / f"datasets--{name.replace('/', '--')}").is_dir())


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
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi(endpoint=_hub_endpoint()).dataset_info(cfg.dataset, timeout=10)
    except GatedRepoError:
        return (f"task.dataset={cfg.dataset!r} is gated on the hub: accept its terms on the hub and log in "
                f"(`hf auth login`, or HF_TOKEN on every node), or {advice}")
    except RepositoryNotFoundError:
        return f"task.dataset={cfg.dataset!r}: the Hugging Face hub has no such dataset (check the spelling); or {advice}"
    except Exception:  # noqa: BLE001 - a flaky answer is not a verdict: the worker's own load will say more
        return None
    return None


def _hub_split(ds: Any, split: str, cfg: Any) -> Any:
    if split not in ds:
        raise ValueError(f"task.dataset={cfg.dataset!r} has splits {list(ds)}, not {split!r}; "
                         "change task.eval_split or use task.files")
    return ds[split]


def lm_texts(cfg: LMConfig, splits: Sequence[str], cache_dir: Path) -> dict[str, list[str]]:
    """Raw lines (documents) per split; empty lines dropped."""
    if cfg.files is not None:
        files = {s: _resolve(getattr(cfg.files, s), f"task.files.{s}") for s in splits}
        raw = _load_text_files(files, cache_dir)
    elif cfg.dataset == "builtin":
        raw = builtin_lm_corpus(cfg.builtin)
    else:
        ds = _load_hub(cfg, cache_dir)
        raw = {}
        for s in splits:
            part = _hub_split(ds, s, cfg)
            if "text" not in part.column_names:
                raise ValueError(f"task.dataset={cfg.dataset!r} has columns {part.column_names}, no 'text' column "
                                 "for language modelling; export the text and use task.files")
            raw[s] = list(part["text"])
    return {s: [line for line in raw[s] if line.strip()] for s in splits}


def parallel_texts(cfg: TranslationTaskConfig, splits: Sequence[str], cache_dir: Path) -> dict[str, tuple[list[str], list[str]]]:
    """(sources, targets) per split, line-aligned."""
    src_lang, tgt_lang = cfg.source_lang, cfg.target_lang
    if cfg.files is not None:
        out = {}
        for s in splits:
            prefix, field = getattr(cfg.files, s), f"task.files.{s}"
            paths = {lang: _parallel_file(prefix, lang, field) for lang in (src_lang, tgt_lang)}
            src = _load_text_files({s: paths[src_lang]}, cache_dir)[s]
            tgt = _load_text_files({s: paths[tgt_lang]}, cache_dir)[s]
            if len(src) != len(tgt):
                raise ValueError(f"{field}: {paths[src_lang]} has {len(src)} lines but {paths[tgt_lang]} has "
                                 f"{len(tgt)}; parallel files must be line-aligned")
            out[s] = (src, tgt)
    elif cfg.dataset == "builtin":
        out = builtin_parallel_corpus(cfg.builtin, src_lang, tgt_lang)
    else:
        ds = _load_hub(cfg, cache_dir)
        out = {}
        for s in splits:
            part = _hub_split(ds, s, cfg)
            if "translation" not in part.column_names:
                raise ValueError(f"task.dataset={cfg.dataset!r} has columns {part.column_names}, no 'translation' "
                                 "column; export the two sides as files and use task.files")
            rows = part["translation"]
            missing = {src_lang, tgt_lang} - set(rows[0]) if len(rows) else set()
            if missing:
                raise ValueError(f"task.source_lang/target_lang: {sorted(missing)} not in {sorted(rows[0])} of "
                                 f"{cfg.dataset!r}; choose languages the dataset has")
            out[s] = ([r[src_lang] for r in rows], [r[tgt_lang] for r in rows])
    cleaned = {}
    for s in splits:  # drop a pair only when either side is empty, which keeps the two sides aligned
        pairs = [(a, b) for a, b in zip(*out[s]) if a.strip() and b.strip()]
        cleaned[s] = ([a for a, _ in pairs], [b for _, b in pairs])
    return cleaned


def _fingerprint(cfg: LMConfig | TranslationTaskConfig, split: str) -> str:
    """Identity of one split's raw data, computed without loading it."""
    if cfg.files is not None:
        prefix = getattr(cfg.files, split)
        if prefix is None:
            raise ValueError(f"task.files.{split} is not given")
        if isinstance(cfg, TranslationTaskConfig):
            paths = [_parallel_file(prefix, lang, f"task.files.{split}") for lang in (cfg.source_lang, cfg.target_lang)]
        else:
            paths = [_resolve(prefix, f"task.files.{split}")]
        return cache_key(files=[file_fingerprint(p) for p in paths])
    if cfg.dataset == "builtin":
        langs = (cfg.source_lang, cfg.target_lang) if isinstance(cfg, TranslationTaskConfig) else None
        return cache_key(builtin=cfg.builtin.model_dump(), split=split, langs=langs)
    langs = (cfg.source_lang, cfg.target_lang) if isinstance(cfg, TranslationTaskConfig) else None
    return cache_key(hub=cfg.dataset, config=cfg.config, split=split, langs=langs)


# --- tokenised, cached splits ---------------------------------------------------------------------------------


def _cached_arrays(path: Path, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if not path.exists():
        with locked(path.with_suffix(".lock")):
            if not path.exists():
                arrays = build()
                atomic_write(path, lambda tmp: np.savez(open(tmp, "wb"), **arrays))
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _encode_flat(tokenizer: Tokenizer, texts: list[str], chunk: int = 20000) -> dict[str, np.ndarray]:
    """Token ids of every line as one int32 array plus offsets; encoded in chunks so that a large corpus
    never sits in memory as Python lists of ints (about 30x the size of the array)."""
    flats, lengths = [], []
    for start in range(0, len(texts), chunk):
        seqs = tokenizer.encode(texts[start:start + chunk])
        lengths.append(np.fromiter((len(x) for x in seqs), dtype=np.int64, count=len(seqs)))
        flats.append(np.fromiter((t for x in seqs for t in x), dtype=np.int32, count=int(lengths[-1].sum())))
    length = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    flat = np.concatenate(flats) if flats else np.zeros(0, np.int32)
    return {"flat": flat, "offsets": np.concatenate([[0], np.cumsum(length)])}


def _unflatten(arrays: dict[str, np.ndarray], prefix: str) -> list[np.ndarray]:
    flat, offsets = arrays[f"{prefix}flat"], arrays[f"{prefix}offsets"]
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def token_stream(flat: np.ndarray, offsets: np.ndarray, eos: int) -> np.ndarray:
    """Documents joined into one stream: eos, doc 1, eos, doc 2, eos, ... The leading eos is the context of the
    first token, so a causal LM predicts every token of the split (and every document end) exactly once."""
    return np.append(np.insert(flat, offsets[:-1], eos), eos).astype(np.int64)


def prepare_lm(cfg: LMConfig, splits: Sequence[str], cache_dir: Path) -> tuple[Tokenizer, bool, dict[str, np.ndarray]]:
    """(tokenizer, tokenizer cache hit, token stream per split; see `token_stream`)."""
    texts = functools.cache(lambda: lm_texts(cfg, ("train", *[s for s in splits if s != "train"]), cache_dir))
    tokenizer, hit = train_or_load(lambda: texts()["train"], data_fingerprint=_fingerprint(cfg, "train"),
                                   vocab_size=cfg.vocab_size, model_type=cfg.tokenizer, cache_dir=cache_dir)
    out = {}
    for split in splits:
        key = cache_key(tokenizer=tokenizer.model_path.name, data=_fingerprint(cfg, split))
        arrays = _cached_arrays(Path(cache_dir) / "prepared" / f"lm-{split}-{key}.npz",
                                lambda: _encode_flat(tokenizer, texts()[split]))
        out[split] = token_stream(arrays["flat"], arrays["offsets"], EOS_ID)
    return tokenizer, hit, out


@dataclass(frozen=True)
class ParallelSplit:
    """Token ids of each pair (no bos/eos) and the raw target sentences that BLEU is scored against."""

    src: list[np.ndarray]
    tgt: list[np.ndarray]
    references: list[str]


def prepare_parallel(cfg: TranslationTaskConfig, splits: Sequence[str], cache_dir: Path) -> tuple[Tokenizer, bool, dict[str, ParallelSplit]]:
    """(joint source+target tokenizer, cache hit, tokenised pairs per split)."""
    texts = functools.cache(lambda: parallel_texts(cfg, ("train", *[s for s in splits if s != "train"]), cache_dir))
    tokenizer, hit = train_or_load(lambda: texts()["train"][0] + texts()["train"][1],
                                   data_fingerprint=_fingerprint(cfg, "train"),
                                   vocab_size=cfg.vocab_size, model_type=cfg.tokenizer, cache_dir=cache_dir)
    out = {}
    for split in splits:
        key = cache_key(tokenizer=tokenizer.model_path.name, data=_fingerprint(cfg, split))

        def build(split: str = split) -> dict[str, np.ndarray]:
            src, tgt = texts()[split]
            s, t = _encode_flat(tokenizer, src), _encode_flat(tokenizer, tgt)
            refs = np.frombuffer(json.dumps(tgt).encode(), dtype=np.uint8)
            return {"src_flat": s["flat"], "src_offsets": s["offsets"], "tgt_flat": t["flat"],
                    "tgt_offsets": t["offsets"], "references": refs}

        arrays = _cached_arrays(Path(cache_dir) / "prepared" / f"pair-{split}-{key}.npz", build)
        out[split] = ParallelSplit(_unflatten(arrays, "src_"), _unflatten(arrays, "tgt_"),
                                   json.loads(arrays["references"].tobytes().decode()))
    return tokenizer, hit, out


# --- sharded, resumable batch order ---------------------------------------------------------------------------


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of epoch `epoch`; the same on every rank (all ranks draw from one permutation)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def sharded_batches(
    epoch_batches: Callable[[int], list[T]], rank: int, world_size: int, position: dict[str, Any] | None,
) -> Iterator[tuple[T, dict[str, Any]]]:
    """Endless stream of this rank's batches with the position after each.

    `epoch_batches(epoch)` lists every batch of the epoch in order, identically on every rank; this rank takes
    every world_size-th one starting at `rank`. The position {"epoch", "step"} counts this rank's batches.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    epoch = int(position["epoch"]) if position else 0
    step = int(position["step"]) if position else 0
    while True:
        mine = epoch_batches(epoch)[rank::world_size]
        if not mine:
            raise ValueError(f"an epoch has fewer batches than the {world_size} workers; lower the batch size "
                             "(task.batch_size / task.max_tokens) or the number of workers")
        for i in range(step, len(mine)):
            yield mine[i], {"epoch": epoch, "step": i + 1}
        epoch, step = epoch + 1, 0
