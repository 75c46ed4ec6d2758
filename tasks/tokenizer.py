"""Sentencepiece tokenizers (Kudo & Richardson, 2018, arXiv 1808.06226), trained once and cached on disk.

The cache key is a hash of the training data's fingerprint and every tokenizer setting, so a changed corpus or
vocabulary size trains a new model while every worker and trial of the same setting reuses one file. Training
happens under an exclusive file lock and the model is moved into place with an atomic rename, so concurrent
workers never read a half-written model (the helpers: tasks/cache.py).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Literal

import sentencepiece as spm

from tasks.cache import atomic_write, cache_key, locked

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MASK_PIECE = "<mask>"
"""Reserved piece for masked LM; always id 4 (the first user-defined symbol)."""
MASK_ID = 4


class Tokenizer:
    """A loaded sentencepiece model with the project's fixed special ids (pad 0, unk 1, bos 2, eos 3, mask 4)."""

    def __init__(self, model_path: Path):
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor(model_file=str(model_path))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Detokenise; special ids are dropped (sentencepiece decodes control symbols to nothing)."""
        return self.sp.decode([[i for i in seq if i != MASK_ID] for seq in ids])


def tokenizer_path(*, data_fingerprint: str, vocab_size: int, model_type: str, cache_dir: Path) -> Path:
    """Where `train_or_load` keeps the model of this data and these settings, trained yet or not (`orchestrator
    plan` reads the size of the vocabulary a run will have from there)."""
    key = cache_key(data=data_fingerprint, vocab_size=vocab_size, model_type=model_type, version=1)
    return Path(cache_dir) / "tokenizers" / f"spm-{model_type}-{key}.model"


def train_or_load(
    texts: Callable[[], Iterable[str]],
    *,
    data_fingerprint: str,
    vocab_size: int,
    model_type: Literal["unigram", "bpe"],
    cache_dir: Path,
) -> tuple[Tokenizer, bool]:
    """The cached tokenizer for this data + settings, training it on `texts()` on a miss.

    Returns (tokenizer, hit). `texts` is a callable so a cache hit never reads the corpus; its lines are written
    to sentencepiece's input file one at a time, never held as a list (callers bound them: tasks/text_sources.py
    `sample`).
    """
    model_path = tokenizer_path(data_fingerprint=data_fingerprint, vocab_size=vocab_size, model_type=model_type,
                                cache_dir=cache_dir)
    if model_path.exists():
        return Tokenizer(model_path), True
    with locked(model_path.with_suffix(".lock")):
        if model_path.exists():  # another worker trained it while we waited
            return Tokenizer(model_path), True

        def write(tmp: Path) -> None:
            with tempfile.TemporaryDirectory() as work:
                corpus = Path(work) / "corpus.txt"
                written = 0
                with open(corpus, "w", encoding="utf-8") as f:
                    for line in texts():
                        if line.strip():
                            f.write(line + "\n")
                            written += 1
                if not written:
                    raise ValueError("the training split is empty; cannot train a sentencepiece model")
                _train_sentencepiece(
                    input=str(corpus), model_prefix=str(Path(work) / "spm"), vocab_size=vocab_size,
                    model_type=model_type, character_coverage=1.0,
                    pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, user_defined_symbols=[MASK_PIECE],
                    # small corpora (the builtin one, unit tests) have fewer pieces than the requested size
                    hard_vocab_limit=False,
                    # sample at most 2M lines: enough for the piece inventory, bounded memory on large corpora
                    input_sentence_size=2_000_000, shuffle_input_sentence=True, num_threads=2,
                    minloglevel=2,
                )
                # move, not os.replace: the work folder is in $TMPDIR, often another file system than the cache
                # (an NFS storage path, a tmpfs /tmp), where a rename fails with EXDEV; `tmp` is in the cache's
                # own folder, so the final rename into place stays atomic.
                shutil.move(Path(work) / "spm.model", tmp)

        atomic_write(model_path, write)
    return Tokenizer(model_path), False


def _train_sentencepiece(**options: object) -> None:
    """SentencePieceTrainer.train, with its error for a vocabulary below the corpus's characters turned into one
    naming task.vocab_size: with character_coverage=1.0 every character of the training split is a piece, which
    no upper bound (hard_vocab_limit=False) can waive, and sentencepiece says so only as an INTERNAL check."""
    try:
        spm.SentencePieceTrainer.train(**options)
    except RuntimeError as err:
        found = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(err))
        if found is None:
            raise
        raise ValueError(f"task.vocab_size={found[1]} is below the {found[2]} pieces the training split needs (each "
                         f"of its characters, and the special pieces); set task.vocab_size to at least "
                         f"{found[2]}") from None
