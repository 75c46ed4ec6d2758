"""Sentence and sentence-pair classification (GLUE style), usually fine-tuned from a masked-LM run.

Data: local TSV / CSV / JSONL files (gzipped or not) with named columns, read through `datasets`' csv and json
builders; a Hugging Face hub dataset (`glue` / `sst2`); or, offline, a generated corpus (`builtin`: sentences of
the builtin grammar labelled by the semantic class of their object, which the masked LM learns from verb
selection). Labels are checked against task.num_classes before any training.

Input format: the masked LM reads documents between eos pieces (tasks/data.py `token_stream`), so a single
sentence is `eos a eos` and a pair `eos a eos b eos`; an example longer than task.max_len is cut, a pair's longer
side first. With `model.init_from` the tokenizer is the pretraining run's (`WorkerContext.tokenizer_path`);
without it one is trained on the training texts.

The loss is the mean cross entropy over the examples of a batch, so `Batch.n_tokens` counts examples here and
the trainer's `train/tokens_per_s` is examples per second. Evaluation reports accuracy and macro-averaged F1
(over the classes present in the labels or the predictions, as scikit-learn's f1_score(average="macro")), and
writes the predicted labels, one per line in the split's order, for artifacts().
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import ModelConfig
from models.classifier import SequenceClassifier
from tasks.base import Batch, EvaluationFiles, WorkerContext
from tasks.cache import cache_key, file_fingerprint
from tasks.config import ClassifyTaskConfig
from tasks.corpora import SyntheticGrammar
from tasks.data import epoch_permutation, sharded_batches
from tasks.text_sources import _hf_cache, _hub_split, _load_hub, _resolve
from tasks.tokenizer import EOS_ID, PAD_ID, Tokenizer, tokenizer_path, train_or_load

_BUILTIN_CLASSES = 6  # semantic noun classes of the builtin grammar (tasks/corpora.py)
_FORMATS = {".tsv": ("csv", {"delimiter": "\t", "quoting": 3}), ".csv": ("csv", {}),
            ".jsonl": ("json", {}), ".json": ("json", {})}


@dataclass(frozen=True)
class LabelledSplit:
    """Texts per column (one list, or two for pairs) and integer labels, row-aligned."""

    texts: tuple[list[str], ...]
    labels: np.ndarray


# --- reading ----------------------------------------------------------------------------------------------


def _file_format(path: Path, field: str) -> tuple[str, dict[str, Any]]:
    suffixes = [s.lower() for s in path.suffixes if s.lower() != ".gz"]
    if suffixes and suffixes[-1] in _FORMATS:
        return _FORMATS[suffixes[-1]]
    raise ValueError(f"{field}={str(path)!r}: cannot tell the format from the name; classification files are "
                     ".tsv, .csv or .jsonl (optionally .gz) with a header row naming the columns")


def _columns(table: dict[str, list[Any]], cfg: ClassifyTaskConfig, where: str) -> LabelledSplit:
    wanted = [*cfg.text_columns, cfg.label_column]
    missing = [c for c in wanted if c not in table]
    if missing:
        # each field once, with its whole value: a pair's text_columns is a list, not the one name missing
        fields = {"task.text_columns": list(cfg.text_columns), "task.label_column": cfg.label_column}
        named = [f for f, value in fields.items() if set(missing) & set(value if isinstance(value, list) else [value])]
        raise ValueError(f"{where} has columns {sorted(table)}, not {missing}; set "
                         + " and ".join(f"{f} (now {fields[f]!r})" for f in named) + " to the file's column names")
    texts = tuple([("" if t is None else str(t)) for t in table[c]] for c in cfg.text_columns)
    return LabelledSplit(texts, label_ids(table[cfg.label_column], cfg, where))


def label_ids(raw: list[Any], cfg: ClassifyTaskConfig, where: str) -> np.ndarray:
    """Integer class ids of a label column; a clear error for a label outside the classes."""
    names = {name: i for i, name in enumerate(cfg.label_names)} if cfg.label_names else None
    out = np.empty(len(raw), dtype=np.int64)
    for row, value in enumerate(raw):
        label = names.get(str(value)) if names is not None else _as_int(value)
        if label is None or not 0 <= label < cfg.num_classes:
            if value == -1 or value == "-1":
                raise ValueError(f"{where} row {row} has label -1: the split is unlabelled (GLUE's hidden test "
                                 "labels); score a labelled split, or give labelled files in task.files")
            expected = (f"one of task.label_names {list(cfg.label_names)}" if names is not None
                        else f"an integer in 0..{cfg.num_classes - 1} (task.num_classes={cfg.num_classes})")
            raise ValueError(f"{where} row {row}: label {value!r} is not {expected}; fix task.num_classes or "
                             "task.label_names, or the data")
        out[row] = label
    return out


def _as_int(value: Any) -> int | None:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return None
    return int(as_float) if as_float.is_integer() else None


def _load_files(cfg: ClassifyTaskConfig, splits: tuple[str, ...], cache_dir: Path) -> dict[str, LabelledSplit]:
    import datasets  # heavy import, only when data is read

    out = {}
    for split in splits:
        field = f"task.files.{split}"
        path = _resolve(getattr(cfg.files, split), field)
        builder, options = _file_format(path, field)
        ds = datasets.load_dataset(builder, data_files={split: str(path)}, cache_dir=_hf_cache(cache_dir), **options)
        out[split] = _columns(ds[split].to_dict(), cfg, f"{field}={str(path)!r}")
    return out


def _from_hub(cfg: ClassifyTaskConfig, splits: tuple[str, ...], cache_dir: Path) -> dict[str, LabelledSplit]:
    ds = _load_hub(cfg, cache_dir)
    return {split: _columns(_hub_split(ds, split, cfg).to_dict(), cfg, f"task.dataset={cfg.dataset!r} split {split!r}")
            for split in splits}


def builtin_classification(cfg: ClassifyTaskConfig) -> dict[str, LabelledSplit]:
    """Sentences of the builtin grammar (the same vocabulary as the builtin LM corpus), labelled by their
    object noun's semantic class modulo task.num_classes (which must divide the grammar's 6 classes)."""
    if _BUILTIN_CLASSES % cfg.num_classes:
        raise ValueError(f"task.num_classes={cfg.num_classes}: the builtin classification corpus labels the 6 "
                         "object classes of its grammar, so num_classes must be 2, 3 or 6")
    if len(cfg.text_columns) != 1:
        raise ValueError("task.dataset: builtin has single sentences; give one task.text_columns entry")
    grammar = SyntheticGrammar(cfg.builtin.seed, cfg.builtin.lexicon_size)
    sizes = {"train": cfg.builtin.train_sentences, "validation": cfg.builtin.eval_sentences,
             "test": cfg.builtin.eval_sentences}
    out = {}
    for i, (split, n) in enumerate(sizes.items()):
        rng = random.Random(cfg.builtin.seed * 1000 + 200 + i)
        trees = [grammar.sample(rng) for _ in range(n)]
        labels = np.array([grammar.noun_class[tree[2][2]] % cfg.num_classes for tree in trees], dtype=np.int64)
        out[split] = LabelledSplit(([grammar.render(t, "xa") for t in trees],), labels)
    return out


def classification_data(cfg: ClassifyTaskConfig, splits: tuple[str, ...], cache_dir: Path) -> dict[str, LabelledSplit]:
    """Texts and labels of `splits` from files, the hub or the builtin generator."""
    if cfg.files is not None:
        return _load_files(cfg, splits, cache_dir)
    if cfg.dataset == "builtin":
        data = builtin_classification(cfg)
        return {s: data[s] for s in splits}
    return _from_hub(cfg, splits, cache_dir)


def _train_fingerprint(cfg: ClassifyTaskConfig) -> str:
    if cfg.files is not None:
        return cache_key(files=[file_fingerprint(_resolve(cfg.files.train, "task.files.train"))],
                         columns=cfg.text_columns)
    if cfg.dataset == "builtin":
        return cache_key(builtin_classify=cfg.builtin.model_dump())
    return cache_key(hub=cfg.dataset, config=cfg.config, columns=cfg.text_columns)


def tokenizer_file(cfg: ClassifyTaskConfig, cache_dir: Path) -> Path:
    """Where a worker keeps the tokenizer it trains for `cfg` (one without model.init_from), trained yet or not:
    `orchestrator plan` reads the size of a run's vocabulary there. A local file is hashed, as the worker hashes it."""
    return tokenizer_path(data_fingerprint=_train_fingerprint(cfg), vocab_size=cfg.vocab_size, model_type=cfg.tokenizer,
                          cache_dir=cache_dir)


# --- encoding ---------------------------------------------------------------------------------------------


def encode_examples(tokenizer: Tokenizer, texts: tuple[list[str], ...], max_len: int) -> list[np.ndarray]:
    """`eos a eos` (or `eos a eos b eos`) per row, cut to max_len pieces: the longer side of a pair loses its
    last pieces first."""
    sides = [tokenizer.encode(column) for column in texts]
    budget = max_len - (len(sides) + 1)  # separators
    out = []
    for row in zip(*sides):
        row = [list(piece) for piece in row]
        while sum(len(p) for p in row) > budget:
            longest = max(range(len(row)), key=lambda i: len(row[i]))
            row[longest].pop()
        ids = [EOS_ID]
        for piece in row:
            ids += piece + [EOS_ID]
        out.append(np.asarray(ids, dtype=np.int64))
    return out


def pad_batch(examples: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tokens [B, T] padded on the right with PAD_ID, and the padding mask (True = padding; None without)."""
    lengths = np.array([len(e) for e in examples])
    T = int(lengths.max())
    tokens_BT = np.full((len(examples), T), PAD_ID, dtype=np.int64)
    for row, ids in enumerate(examples):
        tokens_BT[row, : len(ids)] = ids
    mask = None if (lengths == T).all() else torch.from_numpy(np.arange(T)[None, :] >= lengths[:, None])
    return torch.from_numpy(tokens_BT), mask


# --- metrics ------------------------------------------------------------------------------------------------


def accuracy_and_macro_f1(labels: np.ndarray, predictions: np.ndarray) -> tuple[float, float]:
    """Accuracy, and the unweighted mean of per-class F1 over the classes that occur in either array."""
    accuracy = float((labels == predictions).mean()) if len(labels) else float("nan")
    f1s = []
    for c in np.union1d(labels, predictions):
        tp = int(((predictions == c) & (labels == c)).sum())
        fp = int(((predictions == c) & (labels != c)).sum())
        fn = int(((predictions != c) & (labels == c)).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return accuracy, float(np.mean(f1s)) if f1s else float("nan")


# --- the task -------------------------------------------------------------------------------------------------


class ClassificationTask:
    """Sequence classification over a bidirectional encoder (models/classifier.py)."""

    metrics: tuple[str, ...] = ClassifyTaskConfig.metrics

    def __init__(self, cfg: ClassifyTaskConfig, model_cfg: ModelConfig, ctx: WorkerContext):
        self.cfg, self.model_cfg, self.ctx = cfg, model_cfg, ctx
        data = classification_data(cfg, ("train", cfg.eval_split), ctx.cache_dir)
        if ctx.tokenizer_path is not None:
            self.tokenizer, self.tokenizer_cache_hit = Tokenizer(Path(ctx.tokenizer_path)), True
        else:
            self.tokenizer, self.tokenizer_cache_hit = train_or_load(
                lambda: [t for column in data["train"].texts for t in column],
                data_fingerprint=_train_fingerprint(cfg), vocab_size=cfg.vocab_size, model_type=cfg.tokenizer,
                cache_dir=ctx.cache_dir)
        self.train_ids = encode_examples(self.tokenizer, data["train"].texts, cfg.max_len)
        self.train_labels = data["train"].labels
        if not self.train_ids:
            raise ValueError(f"the training split of {cfg.source_label} has no examples")
        self.eval_ids = encode_examples(self.tokenizer, data[cfg.eval_split].texts, cfg.max_len)
        self.eval_labels = data[cfg.eval_split].labels
        self._outputs = EvaluationFiles("classify-eval-")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def build_model(self) -> nn.Module:
        return SequenceClassifier(self.model_cfg, self.vocab_size, self.cfg.num_classes, self.cfg.pooling)

    def _batch(self, rows: np.ndarray, ids: list[np.ndarray], labels: np.ndarray) -> Batch:
        tokens_BT, mask_BT = pad_batch([ids[i] for i in rows])
        tensors = {"tokens": tokens_BT, "labels": torch.from_numpy(labels[rows])}
        if mask_BT is not None:
            tensors["padding_mask"] = mask_BT
        return Batch(tensors, len(rows))

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        order = epoch_permutation(len(self.train_ids), self.ctx.seed, epoch)
        return [order[i:i + self.cfg.batch_size] for i in range(0, len(order), self.cfg.batch_size)]

    def train_batches(self, position: dict[str, Any] | None = None) -> Iterator[tuple[Batch, dict[str, Any]]]:
        for rows, after in sharded_batches(self._epoch_batches, self.ctx.rank, self.ctx.world_size, position):
            yield self._batch(rows, self.train_ids, self.train_labels), after

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        t = batch.tensors
        logits_BC = model(t["tokens"], t.get("padding_mask"))
        return F.cross_entropy(logits_BC.float(), t["labels"])

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Loss (mean over examples), accuracy and macro F1 over the whole evaluation split (or its first
        task.eval_batches batches); the predictions are written for artifacts()."""
        model = getattr(model, "module", model)
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        # Batches of similar length pad little; predictions go back to the split's order afterwards.
        order = np.argsort([len(ids) for ids in self.eval_ids], kind="stable")
        starts = range(0, len(order), self.cfg.batch_size)
        if self.cfg.eval_batches is not None:
            starts = starts[: self.cfg.eval_batches]
        rows_scored, predictions, total = [], [], 0.0
        for start in starts:
            rows = order[start:start + self.cfg.batch_size]
            batch = self._batch(rows, self.eval_ids, self.eval_labels).to(device)
            logits_BC = model(batch.tensors["tokens"], batch.tensors.get("padding_mask")).float()
            total += float(F.cross_entropy(logits_BC, batch.tensors["labels"], reduction="sum"))
            predictions.append(logits_BC.argmax(dim=-1).cpu().numpy())
            rows_scored.append(rows)
        model.train(was_training)
        rows = np.concatenate(rows_scored)
        if len(rows) == 0:
            raise ValueError(f"the {self.cfg.eval_split} split of {self.cfg.source_label} has no examples")
        back = np.argsort(rows)  # scored rows in the split's order
        predicted = np.concatenate(predictions)[back]
        labels = self.eval_labels[rows[back]]
        accuracy, f1 = accuracy_and_macro_f1(labels, predicted)
        self._write_predictions(predicted)
        return {"val/loss": total / len(rows), "val/acc": accuracy, "val/f1": f1}

    def _write_predictions(self, predicted: np.ndarray) -> None:
        names = self.cfg.label_names
        lines = [names[p] if names else str(p) for p in predicted]
        self._outputs.write("predictions.txt", "\n".join(lines) + "\n")

    def artifacts(self) -> dict[str, Path]:
        out = {"tokenizer": self.tokenizer.model_path}
        if (predictions := self._outputs.get("predictions.txt")) is not None:
            out["predictions"] = predictions
        return out
