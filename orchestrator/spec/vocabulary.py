"""The vocabulary a trial's model is counted at: `orchestrator plan`'s parameters, FLOPs and memory, and the FLOPs
per token a run logs (orchestrator/spec/counting.py).

A corpus task's model has one embedding per piece of its sentencepiece tokenizer (tasks/lm.py, translation.py,
classify.py `vocab_size`), and sentencepiece stops short of task.vocab_size where the corpus has fewer pieces to
give (tasks/tokenizer.py trains with hard_vocab_limit=False): the smoke spec asks for 1,000 and its builtin corpus
yields 179, so a count at task.vocab_size gave 135,656 parameters to a model of 82,291. The size is read from the
tokenizer the run loads, found under the run's own cache key (tasks/data.py and classify.py `tokenizer_file`, in
the cache of run.storage_path or task.prepared_path). A builtin corpus small enough to train its tokenizer in about
a second has it trained here, as the run will train it, in a temporary folder: `plan`, `validate` and `sweep`
count before storage is checked (a path that cannot hold runs is refused after the plan, by name), and validate
writes nothing. Otherwise (a hub or local corpus no run
or `orchestrator prepare` has tokenised yet, a larger builtin corpus) the count stays at task.vocab_size, an upper
bound, and `source` says so and why.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.spec.models import ExperimentSpec, SpecError

_TRAINED: dict[str, int] = {}
"""Sizes of the builtin tokenizers this process trained, by their cache file's name (its key): once each."""

CHEAP_BUILTIN_SENTENCES = 40_000
"""Builtin training sentences (a pair counts two) up to which plan trains the tokenizer itself. CPU seconds to
generate the corpus and train sentencepiece on it, 2 shared cores: 0.16 at 4,000 (the smoke spec), 0.8 at 20,000
(the default), 1.1 at 30,000; 0.21 and 0.8 at 4,000 and 15,000 pairs (docs/plan.md)."""


@dataclass(frozen=True)
class Vocabulary:
    """The vocabulary size a trial is counted at, and where it came from."""

    size: int
    source: str
    """Where the size came from, as plan prints it."""
    exact: bool
    """False: task.vocab_size stands in for a tokenizer that plan cannot read (`source` says why)."""
    tokenizer: Path | None = None
    """The sentencepiece model in the cache the size was read from (None: trained by plan, or none)."""
    trained_s: float | None = field(default=None, compare=False)
    """Seconds this process spent training that tokenizer; None where it was read (or there is none)."""


def vocabulary(spec: ExperimentSpec) -> Vocabulary:
    """The size of the vocabulary `spec`'s run will have, where it is known without reading a corpus; else
    task.vocab_size, said to be a stand-in."""
    task = spec.task
    if task.kind not in ("mlm", "clm", "translation", "classify"):
        return _fixed(task)
    if spec.pretrain is not None:  # the fine-tuned model takes the pretraining stage's tokenizer
        stage = vocabulary(spec.pretraining_spec())
        return replace(stage, source=f"the pretrain: stage's, whose model the run fine-tunes; {stage.source}")
    if spec.model.init_from is not None:
        return Vocabulary(task.vocab_size, "task.vocab_size, a stand-in: the model takes the vocabulary of "
                          "model.init_from's tokenizer, which plan does not read", False)
    from orchestrator.storage.layout import cache_dir_of
    from tasks.classify import tokenizer_file as classify_tokenizer_file
    from tasks.data import data_root, tokenizer_file, train_tokenizer
    from tasks.tokenizer import Tokenizer

    cache_dir = Path(cache_dir_of(spec.run.storage_path))  # the runs' ctx.cache_dir (orchestrator/launch/run.py)
    try:
        path = (classify_tokenizer_file if task.kind == "classify" else tokenizer_file)(task, cache_dir)
    except FileNotFoundError as err:  # a missing task.files entry, which validate names too
        return _bound(task, str(err))
    if path is not None and path.is_file():
        return Vocabulary(Tokenizer(path).vocab_size, f"the tokenizer the runs load, {path}", True, path)
    sentences = _builtin_sentences(task)
    if sentences is not None and sentences <= CHEAP_BUILTIN_SENTENCES:
        start, known = time.perf_counter(), path.name in _TRAINED
        if not known:
            with tempfile.TemporaryDirectory(prefix="orchestrator-plan-") as folder:
                _TRAINED[path.name] = train_tokenizer(task.model_copy(update={"prepared_path": None}),
                                                      Path(folder)).vocab_size
        return Vocabulary(_TRAINED[path.name], f"the builtin corpus's tokenizer, trained as the run will train it "
                          f"(not kept: the run trains it into {path.parent})", True, None,
                          None if known else time.perf_counter() - start)
    if sentences is not None:
        why = (f"the builtin corpus's {sentences:,} training sentences take seconds to train a tokenizer on, which "
               "plan leaves to the run")
    elif path is None:
        why = "task.files.train has not been prepared in this cache (its key is a hash of the whole file)"
    else:
        why = f"the tokenizer of {task.source_label} is not trained yet"
    folder = path.parent if path is not None else data_root(task, cache_dir) / "tokenizers"
    who = "a run trains it" if task.kind == "classify" else "a run or `orchestrator prepare` trains it"
    return _bound(task, f"{why}; {who} into {folder}, where plan reads it from then on")


def counted_spec(spec: ExperimentSpec) -> tuple[ExperimentSpec, Vocabulary]:
    """`spec` with task.vocab_size set to the vocabulary its run will have (`vocabulary`), which `workload` builds
    the model at; and that vocabulary."""
    vocab = vocabulary(spec)
    embedding = spec.model.embedding
    if vocab.exact and hasattr(embedding, "check_vocab"):  # adaptive input's bands must fit the real vocabulary
        try:
            embedding.check_vocab(vocab.size)
        except ValueError:
            raise SpecError(f"model.embedding.cutoffs={embedding.cutoffs} must stay below the vocabulary size of the "
                            f"run's tokenizer, {vocab.size}: task.vocab_size={spec.task.vocab_size} asks for more "
                            f"pieces than its corpus gives ({vocab.source}); drop or lower the last cutoff") from None
    return with_vocab_size(spec, vocab.size), vocab


def check_adaptive_bands(spec: ExperimentSpec) -> None:
    """Adaptive-input cutoffs against the vocabulary the run will have, before Ray (train, and every trial of
    validate and sweep: check_study_adaptive_bands): counted_spec checks them for plan and the GPU fit check only,
    so a CPU spec whose builtin corpus gives fewer pieces than task.vocab_size passed validate and failed in the
    run's model build. A tokenizer the run has not trained is left to the run (`vocabulary`)."""
    if getattr(spec.model.embedding, "kind", None) == "adaptive":
        counted_spec(spec)


def check_study_adaptive_bands(study: Any) -> None:
    """check_adaptive_bands for every trial `validate` checks; at no cost for a study with no adaptive embedding."""
    from orchestrator.spec.search_space import raw_holds, validation_points

    if not raw_holds(study.raw, lambda block: block.get("kind") == "adaptive"):
        return
    for point in validation_points(study.domains, search=study.base.tune.search) if study.domains else [{}]:
        check_adaptive_bands(study.spec_for(point) if point else study.base)


def with_vocab_size(spec: ExperimentSpec, size: int) -> ExperimentSpec:
    """`spec` with task.vocab_size = `size`, for a task that has that field (bytelm's ids are its bytes)."""
    if getattr(spec.task, "vocab_size", size) == size:
        return spec
    return spec.model_copy(update={"task": spec.task.model_copy(update={"vocab_size": size})})


def _fixed(task: Any) -> Vocabulary:
    """The vocabulary of a task without a tokenizer: its ids are the vocabulary (tasks/long_range.py)."""
    from tasks import listops
    from tasks.long_range import BYTE_VOCAB

    if task.kind == "bytelm":
        return Vocabulary(BYTE_VOCAB, "bytelm's 256 byte values", True)
    if task.kind == "listops":
        return Vocabulary(listops.VOCAB_SIZE, "ListOps' fixed token set (tasks/listops.py)", True)
    return Vocabulary(task.vocab_size, f"task.vocab_size, the ids {task.kind} draws its tokens from", True)


def _bound(task: Any, why: str) -> Vocabulary:
    return Vocabulary(task.vocab_size, f"task.vocab_size, an upper bound (sentencepiece may make fewer pieces) on "
                      f"params, FLOPs and memory: {why}", False)


def _builtin_sentences(task: Any) -> int | None:
    """Sentences the builtin corpus trains a tokenizer on (both sides of a pair), or None: not a builtin corpus
    that plan may train on (classify trains on its own labelled sentences, in the task)."""
    if task.kind == "classify" or task.files is not None or task.dataset != "builtin":
        return None
    return task.builtin.train_sentences * (2 if task.kind == "translation" else 1)
