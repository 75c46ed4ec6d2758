"""TaskConfig: the `task:` block of a spec, one pydantic model per kind joined on `kind`.

A task block names where the text comes from (the generated offline corpus, a Hugging Face hub dataset, or
local files), how it is tokenised (sentencepiece), how it is batched and how it is evaluated. Each kind also
declares, as class attributes, the metric names its `evaluate` returns, so the spec can check that
`tune.metric` is something the task actually produces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, field_validator, model_validator

from tasks.data_files import DataFiles, _Config, check_eval_split
from tasks.pretrained_config import PretrainedLMTaskConfig


class BuiltinCorpusConfig(_Config):
    """Size and seed of the generated offline corpus (tasks/corpora.py), used when task.dataset is "builtin"."""

    train_sentences: int = 20000
    """Sentences (LM) or sentence pairs (translation) in the training split."""
    eval_sentences: int = 500
    """Sentences or pairs in each of the validation and test splits."""
    seed: int = 1234
    """Seed of the generator; fixed apart from the run seed so every trial sees the same data."""
    lexicon_size: int = 60
    """Nouns per language (verbs, adjectives and adverbs scale with it); small values make a quick smoke task."""

    @model_validator(mode="after")
    def _check(self) -> "BuiltinCorpusConfig":
        if self.train_sentences < 1 or self.eval_sentences < 1:
            raise ValueError("task.builtin.train_sentences and task.builtin.eval_sentences must be >= 1")
        if self.lexicon_size < 6:
            raise ValueError(f"task.builtin.lexicon_size={self.lexicon_size} must be >= 6 (one noun per semantic class)")
        return self


class _TaskConfig(_Config):
    dataset: str = "builtin"
    """"builtin" for the generated offline corpus, or a Hugging Face hub name such as "wikitext"."""
    config: str | None = None
    """Hub configuration name, e.g. "wikitext-103-raw-v1" or "de-en"."""
    files: DataFiles | None = None
    """Local files {train, validation, test}; used instead of the hub when given."""
    builtin: BuiltinCorpusConfig = Field(default_factory=BuiltinCorpusConfig)
    """Size and seed of the generated corpus (only read when dataset is "builtin" and files are not given)."""
    vocab_size: int = 8000
    """Sentencepiece vocabulary size (an upper bound: small corpora may yield fewer pieces)."""
    tokenizer: Literal["unigram", "bpe"] = "unigram"
    """Sentencepiece model type."""
    eval_split: Literal["validation", "test"] = "validation"
    """Split that `evaluate` scores."""
    eval_batches: int | None = None
    """Score only the first N evaluation batches (fast checks); None scores the whole split."""

    metrics: ClassVar[tuple[str, ...]] = ("val/loss", "val/ppl")
    default_metric: ClassVar[str] = "val/ppl"
    default_mode: ClassVar[Literal["min", "max"]] = "min"

    @model_validator(mode="after")
    def _check_common(self) -> "_TaskConfig":
        if self.vocab_size < 16:
            raise ValueError(f"task.vocab_size={self.vocab_size} is too small; use at least 16")
        if self.dataset == "builtin" and self.files is None:
            _check_builtin_corpus(self, self._builtin_sides())
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"task.eval_batches={self.eval_batches} must be >= 1, or leave it unset")
        if self.files is not None and getattr(self.files, self.eval_split) is None:
            raise ValueError(
                f"task.eval_split={self.eval_split!r} but task.files.{self.eval_split} is not given; "
                f"add task.files.{self.eval_split} or change task.eval_split"
            )
        return self

    def _builtin_sides(self) -> tuple[str, ...]:
        """The builtin corpus's languages this kind reads: the xa text (LM, classification)."""
        return ("xa",)

    @property
    def source_label(self) -> str:
        """Short human name of the data source for logs and errors."""
        if self.files is not None:
            return f"files:{self.files.train}"
        return self.dataset if self.config is None else f"{self.dataset}/{self.config}"


def _check_builtin_corpus(cfg: _TaskConfig, languages: tuple[str, ...]) -> None:
    """The builtin corpus has the languages asked for, and task.vocab_size holds its characters (sentencepiece
    refuses a smaller vocabulary in the worker); from the lexicon, without building the corpus."""
    from tasks.corpora import builtin_language_problem, builtin_vocab_floor  # corpora imports this module

    if len(languages) == 2 and (problem := builtin_language_problem(*languages)):
        raise ValueError(problem)
    floor = builtin_vocab_floor(cfg.builtin, languages)
    if cfg.vocab_size < floor:
        raise ValueError(f"task.vocab_size={cfg.vocab_size} is too small for the builtin corpus: sentencepiece needs "
                         f"a piece for each of its characters and 5 special pieces, {floor} here; set "
                         f"task.vocab_size >= {floor}")


class _CorpusTaskConfig(_TaskConfig):
    """Where and how a pretraining or translation corpus is prepared (tasks/corpus_prepare.py)."""

    prepared_path: str | None = None
    """Folder of tokenizers and prepared corpora; default: the run's cache (<run.storage_path>/.cache, local
    storage) or the user's cache (remote storage). On a cluster, a folder every node mounts."""
    streaming: bool = False
    """Read a hub dataset with `datasets`' streaming=True: rows arrive as they are tokenised, nothing is downloaded
    first (for sets larger than the disk)."""
    prepare_workers: int | None = None
    """Processes that tokenise while preparing; None: one per core of the preparing machine."""
    tokenizer_sample_mb: int = 32
    """Megabytes of training text the sentencepiece model learns from (an evenly spread sample when the corpus
    is larger); bounds the training's memory, which is about 20x the sample."""

    @field_validator("prepared_path")
    @classmethod
    def _absolute_path(cls, value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().resolve())

    @model_validator(mode="after")
    def _check_corpus(self) -> "_CorpusTaskConfig":
        if self.prepare_workers is not None and self.prepare_workers < 1:
            raise ValueError(f"task.prepare_workers={self.prepare_workers} must be >= 1, or leave it unset (every core)")
        if self.tokenizer_sample_mb < 1:
            raise ValueError(f"task.tokenizer_sample_mb={self.tokenizer_sample_mb} must be >= 1")
        if self.streaming and (self.files is not None or self.dataset == "builtin"):
            raise ValueError("task.streaming reads a Hugging Face hub dataset; local files (task.files) and the builtin "
                             "corpus are read in chunks anyway: remove task.streaming")
        return self


class _LMTaskConfig(_CorpusTaskConfig):
    seq_len: int = 128
    """Tokens per packed training block (and per evaluation block)."""
    batch_size: int = 32
    """Blocks per worker step."""

    @model_validator(mode="after")
    def _check_lm(self) -> "_LMTaskConfig":
        if self.seq_len < 2:
            raise ValueError(f"task.seq_len={self.seq_len} must be >= 2")
        if self.batch_size < 1:
            raise ValueError(f"task.batch_size={self.batch_size} must be >= 1")
        return self


class MLMTaskConfig(_LMTaskConfig):
    """Masked language modelling (Devlin et al., 2019, arXiv 1810.04805) with a bidirectional encoder."""

    kind: Literal["mlm"] = "mlm"
    mask_prob: float = 0.15
    """Fraction of tokens selected for prediction; of those 80% become <mask>, 10% random, 10% kept."""

    @model_validator(mode="after")
    def _check_mlm(self) -> "MLMTaskConfig":
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"task.mask_prob={self.mask_prob} must be in (0, 1)")
        return self


class CausalLMTaskConfig(_LMTaskConfig):
    """Causal (next-token) language modelling with a decoder-only model."""

    kind: Literal["clm"] = "clm"


class TranslationTaskConfig(_CorpusTaskConfig):
    """Sentence-level translation with an encoder-decoder, beam search and sacrebleu BLEU / chrF."""

    kind: Literal["translation"] = "translation"
    source_lang: str = "de"
    """Source language code: the file suffix (`<prefix>.de`) or the hub's translation key ("xa" for builtin)."""
    target_lang: str = "en"
    """Target language code ("xb" for builtin)."""
    max_tokens: int = 4096
    """Token budget of one worker batch (padded source + target tokens)."""
    max_source_len: int = 128
    """Training pairs with a longer source or target (in pieces) are dropped; evaluation sources are cut to it."""
    label_smoothing: float = 0.1
    """Label smoothing of the training cross entropy (Szegedy et al., 2016); validation loss is unsmoothed."""
    beam_size: int = 5
    """Beam width at evaluation; 1 is greedy decoding."""
    length_penalty: float = 1.0
    """Hypothesis score = log p / length**length_penalty (0 = raw log-probability)."""
    max_len_a: float = 1.5
    """Decoding stops at max_len_a * source_length + max_len_b target pieces."""
    max_len_b: int = 10
    """See max_len_a."""
    eval_max_sentences: int | None = None
    """Translate only the first N evaluation sentences for BLEU (faster checks); None translates all."""

    metrics: ClassVar[tuple[str, ...]] = ("val/loss", "val/ppl", "val/bleu", "val/chrf")
    default_metric: ClassVar[str] = "val/bleu"
    default_mode: ClassVar[Literal["min", "max"]] = "max"

    @model_validator(mode="before")
    @classmethod
    def _builtin_languages(cls, data):
        """The builtin pair has its own language codes; default to them so a smoke spec stays short."""
        if isinstance(data, dict) and data.get("dataset", "builtin") == "builtin" and data.get("files") is None:
            data = {"source_lang": "xa", "target_lang": "xb", **data}
        return data

    def _builtin_sides(self) -> tuple[str, ...]:
        return (self.source_lang, self.target_lang)  # one joint vocabulary over both sides

    @model_validator(mode="after")
    def _check_translation(self) -> "TranslationTaskConfig":
        if self.source_lang == self.target_lang:
            raise ValueError(f"task.source_lang and task.target_lang are both {self.source_lang!r}; they must differ")
        if self.max_source_len < 1:
            raise ValueError(f"task.max_source_len={self.max_source_len} must be >= 1 (pieces of the longest "
                             "training source or target kept; 128 by default)")
        if self.max_tokens < self.max_source_len:
            raise ValueError(
                f"task.max_tokens={self.max_tokens} is smaller than task.max_source_len={self.max_source_len}; "
                "one pair must fit in a batch: raise max_tokens or lower max_source_len"
            )
        if self.beam_size < 1:
            raise ValueError(f"task.beam_size={self.beam_size} must be >= 1")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"task.label_smoothing={self.label_smoothing} must be in [0, 1)")
        if self.max_len_a < 0 or self.max_len_b < 1:
            raise ValueError("task.max_len_a must be >= 0 and task.max_len_b >= 1")
        if self.eval_max_sentences is not None and self.eval_max_sentences < 1:
            raise ValueError(f"task.eval_max_sentences={self.eval_max_sentences} must be >= 1, or leave it unset")
        return self


class ClassifyTaskConfig(_TaskConfig):
    """Sentence or sentence-pair classification (GLUE style: SST-2, MNLI, ...) with a bidirectional encoder and a
    classification head over its pooled states (models/classifier.py); usually fine-tuned from a masked-LM run
    (model.init_from). Local files are TSV, CSV or JSONL with named columns (a header row for TSV/CSV)."""

    kind: Literal["classify"] = "classify"
    text_columns: tuple[str, ...] = ("sentence",)
    """One column (single sentences) or two (sentence pairs, e.g. [premise, hypothesis])."""
    label_column: str = "label"
    """Column of the class labels: integers 0..num_classes-1, or names listed in `label_names`."""
    num_classes: int = 2
    """Classes of the head; every label must be one of them."""
    label_names: tuple[str, ...] | None = None
    """Names of the classes in id order when the label column holds strings (e.g. [negative, positive])."""
    max_len: int = 128
    """Pieces per example including separators; longer examples are cut (pairs: the longer side first)."""
    batch_size: int = 32
    """Examples per worker step."""
    pooling: Literal["mean", "first"] = "mean"
    """How the encoder's states become one vector: mean over the real positions, or the first position's."""

    metrics: ClassVar[tuple[str, ...]] = ("val/loss", "val/acc", "val/f1")
    default_metric: ClassVar[str] = "val/acc"
    default_mode: ClassVar[Literal["min", "max"]] = "max"

    @model_validator(mode="after")
    def _check_classify(self) -> "ClassifyTaskConfig":
        if len(self.text_columns) not in (1, 2):
            raise ValueError(f"task.text_columns={list(self.text_columns)} must name one column (single sentences) "
                             "or two (sentence pairs)")
        if self.label_column in self.text_columns:
            raise ValueError(f"task.label_column={self.label_column!r} is also in task.text_columns; "
                             "name the label column apart from the text")
        if self.num_classes < 2:
            raise ValueError(f"task.num_classes={self.num_classes} must be >= 2")
        if self.label_names is not None and len(self.label_names) != self.num_classes:
            raise ValueError(f"task.label_names lists {len(self.label_names)} names for task.num_classes="
                             f"{self.num_classes}; give one name per class, in id order")
        if self.max_len < 4:
            raise ValueError(f"task.max_len={self.max_len} must be >= 4 (separators plus text)")
        if self.batch_size < 1:
            raise ValueError(f"task.batch_size={self.batch_size} must be >= 1")
        return self


# --- long-range tasks: generated offline (ListOps, MQAR) or read as raw bytes (tasks/long_range.py) ---------------


class _GeneratedTaskConfig(_Config):
    """Examples drawn from a seeded generator: no download, the same data on every worker and every trial."""

    seed: int = 1234
    """Seed of the generator; fixed apart from the run seed (optim.seed orders the batches), like task.builtin.seed."""
    train_examples: int = 20000
    """Examples in the training split."""
    eval_examples: int = 1000
    """Examples in each of the validation and test splits."""
    batch_size: int = 32
    """Examples per worker step."""
    eval_split: Literal["validation", "test"] = "validation"
    """Split that `evaluate` scores."""
    eval_batches: int | None = None
    """Score only the first N evaluation batches (fast checks); None scores the whole split."""

    metrics: ClassVar[tuple[str, ...]] = ("val/loss", "val/acc")
    default_metric: ClassVar[str] = "val/acc"
    default_mode: ClassVar[Literal["min", "max"]] = "max"

    @model_validator(mode="after")
    def _check_generated(self) -> "_GeneratedTaskConfig":
        if self.train_examples < 1 or self.eval_examples < 1:
            raise ValueError("task.train_examples and task.eval_examples must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"task.batch_size={self.batch_size} must be >= 1")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"task.eval_batches={self.eval_batches} must be >= 1, or leave it unset")
        return self

    @property
    def source_label(self) -> str:
        return f"generated {self.kind} (seed {self.seed})"


class ListOpsTaskConfig(_GeneratedTaskConfig):
    """ListOps (Nangia & Bowman, 2018, arXiv 1804.06028) as the Long Range Arena generates it (Tay et al., 2020,
    arXiv 2011.04006): nested MAX / MIN / MED / SM expressions over the digits 0-9, classified into their value
    (10 classes) by a bidirectional encoder. The generator follows LRA's lra_benchmarks/data/listops.py
    (tasks/listops.py says which lines)."""

    kind: Literal["listops"] = "listops"
    seq_len: int = 2000
    """Longest input in tokens, the leading CLS included; expressions are shorter than this (LRA's max_length)."""
    min_len: int = 500
    """Expressions are longer than this many tokens (LRA's min_length)."""
    max_depth: int = 10
    """Deepest nesting of operators (LRA's max_depth)."""
    max_args: int = 10
    """Most arguments of one operator (LRA's max_args); each has at least 2."""
    pooling: Literal["first", "mean"] = "first"
    """first: the state of the leading CLS token (LRA's pooling_mode CLS); mean: the mean over real tokens."""

    @model_validator(mode="after")
    def _check_listops(self) -> "ListOpsTaskConfig":
        if self.max_depth < 1 or self.max_args < 2:
            raise ValueError(f"task.max_depth={self.max_depth} must be >= 1 and task.max_args={self.max_args} >= 2")
        # The shortest operator expression is `[OP d d ]`: 4 tokens, 5 with CLS; lengths lie strictly between.
        if self.min_len < 0 or self.seq_len - 1 <= self.min_len + 1:
            raise ValueError(f"task.min_len={self.min_len} and task.seq_len={self.seq_len} leave no expression "
                             "length strictly between them (seq_len counts the leading CLS); raise task.seq_len "
                             "or lower task.min_len")
        return self


class MQARTaskConfig(_GeneratedTaskConfig):
    """Multi-query associative recall (Arora, Eyuboglu et al., 2023, Zoology, arXiv 2312.04927): key-value pairs,
    then the keys again at power-law distances, each to be answered with its value. Scored as accuracy over the
    answer positions. The generator follows Zoology's zoology/data/multiquery_ar.py (tasks/mqar.py)."""

    kind: Literal["mqar"] = "mqar"
    seq_len: int = 512
    """Tokens per example (Zoology's input_seq_len; even)."""
    num_kv_pairs: int = 8
    """Key-value pairs per example, each queried once; 4 x num_kv_pairs must fit in seq_len."""
    vocab_size: int = 8192
    """Token ids: keys from [1, vocab/2), values from [vocab/2, vocab) (Zoology's split; its default 8192)."""
    power_a: float = 0.01
    """Exponent of the power law of query distances (Zoology's power_a; 1 is uniform)."""
    random_non_queries: bool = True
    """Fill the positions between queries with random tokens (Zoology's default), not zeros (Zoology's Figure 2).
    With random tokens vocab_size must exceed seq_len; with zeros any vocab_size that holds the pairs will do."""
    causal: bool = False
    """Decoder (causal attention), as Zoology trains; false reads the example with a bidirectional encoder, which
    every attention kind can run (the inputs after a query hold no answer either way)."""
    @model_validator(mode="after")
    def _check_mqar(self) -> "MQARTaskConfig":
        if self.seq_len % 2:
            raise ValueError(f"task.seq_len={self.seq_len} must be even (Zoology's input_seq_len: pairs of tokens)")
        if self.num_kv_pairs < 1:
            raise ValueError(f"task.num_kv_pairs={self.num_kv_pairs} must be >= 1")
        if 4 * self.num_kv_pairs > self.seq_len:
            raise ValueError(f"task.num_kv_pairs={self.num_kv_pairs} does not fit task.seq_len={self.seq_len}: the "
                             f"pairs take 2 x {self.num_kv_pairs} tokens and their queries need as many slots of two "
                             f"after them, so seq_len must be >= 4 x num_kv_pairs = {4 * self.num_kv_pairs}; "
                             "raise task.seq_len or lower task.num_kv_pairs")
        keys, values = self.vocab_size // 2 - 1, self.vocab_size - self.vocab_size // 2
        if min(keys, values) < self.num_kv_pairs:
            raise ValueError(f"task.vocab_size={self.vocab_size} is too small for task.num_kv_pairs="
                             f"{self.num_kv_pairs}: keys are drawn without repetition from {keys} ids and values "
                             f"from {values}; raise vocab_size to at least {2 * self.num_kv_pairs + 2}")
        # Zoology asserts this bound whatever the fillers; its reason is the random fillers alone, so with zeros
        # between the queries (a key then recurs only as its query) a small vocabulary is allowed.
        if self.random_non_queries and self.vocab_size <= self.seq_len:
            raise ValueError(f"task.vocab_size={self.vocab_size} must exceed task.seq_len={self.seq_len} (Zoology's "
                             "bound): the random tokens between the queries are drawn from the whole vocabulary, "
                             "and with fewer ids than positions every key recurs among them, each time followed by "
                             f"a wrong value; raise vocab_size above {self.seq_len} (Zoology uses 8192), or set "
                             "task.random_non_queries: false (zeros between the queries)")
        if self.power_a <= 0:
            raise ValueError(f"task.power_a={self.power_a} must be > 0 (Zoology uses 0.01; 1 is uniform)")
        return self


class ByteLMTaskConfig(_Config):
    """Byte-level causal language modelling of local text files (enwik8-style, as Reformer and Transformer-XL
    report it): every byte is a token (256 ids, no tokenizer), scored in bits per byte."""

    kind: Literal["bytelm"] = "bytelm"
    files: DataFiles
    """Local text files {train, validation, test}, read as raw bytes (gzipped files are decompressed)."""
    seq_len: int = 1024
    """Bytes per training and evaluation block."""
    batch_size: int = 16
    """Blocks per worker step."""
    eval_split: Literal["validation", "test"] = "validation"
    """Split that `evaluate` scores."""
    eval_batches: int | None = None
    """Score only the first N evaluation batches (fast checks); None scores the whole split."""

    metrics: ClassVar[tuple[str, ...]] = ("val/loss", "val/bpb", "val/ppl")
    default_metric: ClassVar[str] = "val/bpb"
    default_mode: ClassVar[Literal["min", "max"]] = "min"

    @model_validator(mode="after")
    def _check_bytes(self) -> "ByteLMTaskConfig":
        if self.seq_len < 2:
            raise ValueError(f"task.seq_len={self.seq_len} must be >= 2")
        if self.batch_size < 1:
            raise ValueError(f"task.batch_size={self.batch_size} must be >= 1")
        check_eval_split(self.files, self.eval_split, self.eval_batches)
        return self

    @property
    def source_label(self) -> str:
        return f"bytes:{self.files.train}"


TaskConfig = Annotated[
    Union[MLMTaskConfig, CausalLMTaskConfig, TranslationTaskConfig, ClassifyTaskConfig, ListOpsTaskConfig,
          MQARTaskConfig, ByteLMTaskConfig, PretrainedLMTaskConfig],
    Field(discriminator="kind"),
]

TASK_KINDS: tuple[str, ...] = ("mlm", "clm", "translation", "classify", "listops", "mqar", "bytelm",
                                "pretrained_lm")
