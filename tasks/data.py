"""Prepared corpora for the tasks, and the sharded, resumable batch order every task uses.

Sources (tasks/text_sources.py): the generated offline corpus (tasks/corpora.py), local files, or a Hugging Face
hub dataset, all read in chunks. The tokenizer is trained on a bounded sample of the training split
(tasks/tokenizer.py); every split is then prepared once into memory-mapped shards (tasks/corpus_prepare.py,
format: tasks/corpus_format.py) under a key of the data's fingerprint and the tokenizer, in task.prepared_path
or the run's cache folder. `build_task` on a worker finds them there and maps them: a few file reads, and no
copy of the corpus in the worker's memory. `orchestrator prepare` runs the same preparation ahead of a run.

Batch order: each epoch is a seeded permutation split into batches; rank r of w takes batches r, r + w, ...,
so the ranks together see every example exactly once per epoch. A position {"epoch", "step"} resumes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np

from tasks.cache import cache_key, recalled_fingerprint, remembered_fingerprint
from tasks.config import CausalLMTaskConfig, MLMTaskConfig, TranslationTaskConfig
from tasks.corpus_format import FORMAT_VERSION, Items, PreparedCorpus, Stream, Texts, token_dtype
from tasks.corpus_prepare import ColumnSpec, default_workers, prepared, write_columns
from tasks.text_sources import _parallel_file, _resolve, lm_source, parallel_source, sample
from tasks.tokenizer import EOS_ID, Tokenizer, tokenizer_path, train_or_load

LMConfig = MLMTaskConfig | CausalLMTaskConfig
T = TypeVar("T")


# --- raw text in memory (small splits: word counts, tests) ------------------------------------------------------


def lm_texts(cfg: LMConfig, splits: Sequence[str], cache_dir: Path) -> dict[str, list[str]]:
    """Raw lines (documents) per split, in memory; empty lines dropped."""
    return {s: [doc for chunk in lm_source(cfg, s, cache_dir).chunks() for doc in chunk.items] for s in splits}


def parallel_texts(cfg: TranslationTaskConfig, splits: Sequence[str], cache_dir: Path) -> dict[str, tuple[list[str], list[str]]]:
    """(sources, targets) per split, line-aligned, in memory."""
    out = {}
    for s in splits:
        chunks = list(parallel_source(cfg, s, cache_dir).chunks())
        out[s] = ([a for c in chunks for a in c.items[0]], [b for c in chunks for b in c.items[1]])
    return out


def _fingerprint(cfg: LMConfig | TranslationTaskConfig, split: str, root: Path,
                 digest: Callable[[Path, Path], str | None] = remembered_fingerprint) -> str | None:
    """Identity of one split's raw data, computed without loading it (a file's hash is remembered in `root`); None
    only where `digest` (`recalled_fingerprint`) has no hash of a file."""
    if cfg.files is not None:
        prefix = getattr(cfg.files, split)
        if prefix is None:
            raise ValueError(f"task.files.{split} is not given")
        if isinstance(cfg, TranslationTaskConfig):
            paths = [_parallel_file(prefix, lang, f"task.files.{split}") for lang in (cfg.source_lang, cfg.target_lang)]
        else:
            paths = [_resolve(prefix, f"task.files.{split}")]
        digests = [digest(p, root / "fingerprints") for p in paths]
        return None if None in digests else cache_key(files=digests)
    if cfg.dataset == "builtin":
        langs = (cfg.source_lang, cfg.target_lang) if isinstance(cfg, TranslationTaskConfig) else None
        return cache_key(builtin=cfg.builtin.model_dump(), split=split, langs=langs)
    langs = (cfg.source_lang, cfg.target_lang) if isinstance(cfg, TranslationTaskConfig) else None
    return cache_key(hub=cfg.dataset, config=cfg.config, split=split, langs=langs)


# --- prepared corpora -----------------------------------------------------------------------------------------

REBUILD = "orchestrator prepare SPEC [overrides]  (the run's spec and overrides)"


def data_root(cfg: LMConfig | TranslationTaskConfig, cache_dir: Path) -> Path:
    """Where tokenizers and prepared corpora live: task.prepared_path, else the run's cache folder."""
    return Path(cfg.prepared_path) if cfg.prepared_path else Path(cache_dir)


def token_stream(flat: np.ndarray, offsets: np.ndarray, eos: int) -> np.ndarray:
    """Documents joined into one stream: eos, doc 1, eos, doc 2, eos, ... The leading eos is the context of the
    first token, so a causal LM predicts every token of the split (and every document end) exactly once.
    (`flat` and `offsets`: the documents' ids end to end and where each starts; the prepared column holds
    exactly this stream.)"""
    return np.append(np.insert(flat, offsets[:-1], eos), eos).astype(np.int64)


def _tokenizer(cfg: LMConfig | TranslationTaskConfig, root: Path, cache_dir: Path) -> tuple[Tokenizer, bool]:
    """The spec's tokenizer, trained on a bounded sample of the training split on a miss."""
    budget = cfg.tokenizer_sample_mb << 20
    if isinstance(cfg, TranslationTaskConfig):
        source = parallel_source(cfg, "train", cache_dir)

        def lines() -> Iterator[str]:  # all sources, then all targets (one pass over the data for each side)
            for side in (0, 1):
                yield from sample((t for c in source.chunks() for t in c.items[side]), source.text_bytes, budget)
    else:
        source = lm_source(cfg, "train", cache_dir)

        def lines() -> Iterator[str]:
            yield from sample((t for c in source.chunks() for t in c.items), source.text_bytes, budget)

    return train_or_load(lines, data_fingerprint=_tokenizer_data(cfg, _fingerprint(cfg, "train", root)),
                         vocab_size=cfg.vocab_size, model_type=cfg.tokenizer, cache_dir=root)


def _tokenizer_data(cfg: LMConfig | TranslationTaskConfig, train_fingerprint: str | None) -> str:
    """The data a tokenizer is keyed by: the training split and the size of the sample it learns from."""
    return cache_key(data=train_fingerprint, sample_mb=cfg.tokenizer_sample_mb)


def tokenizer_file(cfg: LMConfig | TranslationTaskConfig, cache_dir: Path) -> Path | None:
    """Where `_tokenizer` keeps the spec's tokenizer, trained yet or not, found without reading the corpus or writing
    anything; None where that needs a local file's hash that no preparation has remembered yet. (`orchestrator
    plan` reads the size of a run's vocabulary there; `cache_dir` is the run's.)"""
    root = data_root(cfg, cache_dir)
    data = _fingerprint(cfg, "train", root, recalled_fingerprint)
    if data is None:
        return None
    return tokenizer_path(data_fingerprint=_tokenizer_data(cfg, data), vocab_size=cfg.vocab_size,
                          model_type=cfg.tokenizer, cache_dir=root)


def train_tokenizer(cfg: LMConfig | TranslationTaskConfig, cache_dir: Path) -> Tokenizer:
    """The spec's tokenizer, trained on a miss into the run's cache as a run's first worker trains it (`orchestrator
    plan` trains a small builtin corpus's, which the run then loads)."""
    root = data_root(cfg, cache_dir)
    return _tokenizer(cfg, root, cache_dir)[0]


def _prepare(cfg: LMConfig | TranslationTaskConfig, split: str, tokenizer: Tokenizer, root: Path, cache_dir: Path,
             rebuild: str, replace_damaged: bool) -> tuple[PreparedCorpus, bool]:
    pairs = isinstance(cfg, TranslationTaskConfig)
    kind = "pair" if pairs else "lm"
    data = _fingerprint(cfg, split, root)
    folder = root / "prepared" / f"{kind}-{split}-{cache_key(tokenizer=tokenizer.model_path.name, data=data, format=FORMAT_VERSION)}"
    dtype = token_dtype(tokenizer.vocab_size)
    workers = cfg.prepare_workers or default_workers()

    def build(tmp: Path) -> dict[str, Any]:
        if pairs:
            source = parallel_source(cfg, split, cache_dir)
            columns = [ColumnSpec("src", dtype), ColumnSpec("tgt", dtype)]
        else:
            source = lm_source(cfg, split, cache_dir)
            columns = [ColumnSpec("tokens", dtype, leading_eos=True)]
        written = write_columns(tmp, source, columns, tokenizer.model_path, EOS_ID, workers,
                                texts="references" if pairs else None)
        return {"kind": kind, "split": split, "source": source.label, "fingerprint": data,
                "tokenizer": tokenizer.model_path.name, "vocab_size": tokenizer.vocab_size,
                "command": None if rebuild == REBUILD else rebuild, "workers": workers, **written}

    return prepared(folder, build, rebuild, replace_damaged=replace_damaged)


def prepare_lm(cfg: LMConfig, splits: Sequence[str], cache_dir: Path, *, rebuild: str = REBUILD,
               replace_damaged: bool = False) -> tuple[Tokenizer, bool, dict[str, Stream]]:
    """(tokenizer, tokenizer cache hit, memory-mapped token stream per split; see `token_stream`)."""
    root = data_root(cfg, cache_dir)
    tokenizer, hit = _tokenizer(cfg, root, cache_dir)
    return tokenizer, hit, {s: _prepare(cfg, s, tokenizer, root, cache_dir, rebuild, replace_damaged)[0]
                            .columns["tokens"].stream for s in splits}


@dataclass(frozen=True)
class ParallelSplit:
    """Token ids of each pair (no bos/eos; int64 arrays read from the map) and the raw target sentences that
    BLEU is scored against."""

    src: Items
    tgt: Items
    references: Texts


def prepare_parallel(cfg: TranslationTaskConfig, splits: Sequence[str], cache_dir: Path, *, rebuild: str = REBUILD,
                     replace_damaged: bool = False) -> tuple[Tokenizer, bool, dict[str, ParallelSplit]]:
    """(joint source+target tokenizer, cache hit, tokenised pairs per split)."""
    root = data_root(cfg, cache_dir)
    tokenizer, hit = _tokenizer(cfg, root, cache_dir)
    out = {}
    for split in splits:
        columns = _prepare(cfg, split, tokenizer, root, cache_dir, rebuild, replace_damaged)[0].columns
        out[split] = ParallelSplit(columns["src"].items, columns["tgt"].items, Texts(columns["references"]))
    return tokenizer, hit, out


def prepare_all(cfg: LMConfig | TranslationTaskConfig, cache_dir: Path, rebuild: str) -> list[dict[str, Any]]:
    """Prepare every split the spec's data has (`orchestrator prepare`), replacing a damaged one; per split its
    folder, counts and whether it was prepared before."""
    root = data_root(cfg, cache_dir)
    splits = [s for s in ("train", "validation", "test") if cfg.files is None or getattr(cfg.files, s) is not None]
    tokenizer, hit = _tokenizer(cfg, root, cache_dir)
    out = []
    for split in splits:
        corpus, existed = _prepare(cfg, split, tokenizer, root, cache_dir, rebuild, replace_damaged=True)
        columns = corpus.manifest["columns"]
        main = columns["src"] if "src" in columns else columns["tokens"]
        out.append({"split": split, "folder": corpus.folder, "existed": existed, "tokens": main["n_data"],
                    "documents": main["n_items"], "dtype": main["dtype"],
                    "target_tokens": columns["tgt"]["n_data"] if "tgt" in columns else None,
                    "seconds": corpus.manifest.get("seconds"), "tokenizer": tokenizer.model_path,
                    "tokenizer_existed": hit})
    return out


# --- sharded, resumable batch order ---------------------------------------------------------------------------


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of epoch `epoch`; the same on every rank (all ranks draw from one permutation)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def sharded_batches(
    epoch_batches: Callable[[int], Sequence[T]], rank: int, world_size: int, position: dict[str, Any] | None,
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
        batches = epoch_batches(epoch)
        mine = range(rank, len(batches), world_size)  # indices only: `batches` may be a lazy sequence
        if not mine:
            raise ValueError(f"an epoch has fewer batches than the {world_size} workers; lower the batch size "
                             "(task.batch_size / task.max_tokens) or the number of workers")
        for i in range(step, len(mine)):
            yield batches[mine[i]], {"epoch": epoch, "step": i + 1}
        epoch, step = epoch + 1, 0
