"""Long-range tasks: ListOps and multi-query associative recall (generated offline), and byte-level LM of files.

The short tasks of this project (sentences of 20-30 tokens, LM blocks of 64-128) are where Linformer's k,
Reformer's buckets and HyperAttention's blocks change neither cost nor quality; these tasks run at any length
(up to 16k and beyond), where they do:

- `listops` (tasks/listops.py): LRA's ListOps, 10-way classification of a nested expression's value by a
  bidirectional encoder with a classification head (models/classifier.py). Chance is the majority class.
- `mqar` (tasks/mqar.py): Zoology's multi-query associative recall; the model predicts the value at each query
  position (only those positions go through the output layer) and is scored by accuracy over them.
  Chance is 1 / (vocab_size / 2), a guess among the values.
- `bytelm`: causal LM of the raw bytes of local text files (256 ids, no tokenizer), scored in bits per byte,
  loss / ln 2, as enwik8 results are (Reformer, Transformer-XL). It is the causal LM task (tasks/lm.py) with a
  byte stream in place of a tokenised one.

Generated splits are cached under the worker's cache folder, keyed by every generator field, so the first
worker generates and every later trial reads one file. The seed of the data is `task.seed`; the run seed only
orders the batches, so every trial and seed of a study sees the same examples. Accuracy's loss is the mean
cross entropy per example (ListOps) or per answer (MQAR); `Batch.n_tokens` counts those, so the trainer's
`train/tokens_per_s` is examples or answers per second (input tokens per second: that times the mean input
length, or times seq_len / num_kv_pairs).
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import LanguageModel, ModelConfig
from models.classifier import SequenceClassifier
from tasks import listops, mqar
from tasks.base import Batch, WorkerContext, scored_positions, scored_targets
from tasks.cache import atomic_write, cache_key, locked
from tasks.classify import pad_batch
from tasks.config import ByteLMTaskConfig, ListOpsTaskConfig, MQARTaskConfig
from tasks.data import epoch_permutation, sharded_batches
from tasks.text_sources import _resolve
from tasks.lm import CausalLMTask, num_blocks

SPLITS = ("train", "validation", "test")
BYTE_VOCAB = 256


def check_long_range(task_cfg: ListOpsTaskConfig | MQARTaskConfig | ByteLMTaskConfig, model_cfg: ModelConfig) -> None:
    """The spec-level checks of a long-range task against its model (ValueError naming the fields)."""
    if task_cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"task.seq_len={task_cfg.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}: the "
                         f"positional table (and Linformer's projection) covers {model_cfg.max_seq_len} positions; "
                         "lower task.seq_len or raise model.max_seq_len")


def _cached_arrays(path: Path, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Generated examples, built once per settings (one producer at a time) and read back whole: they are small
    next to a corpus (tasks/data.py maps those instead)."""
    if not path.exists():
        with locked(path.with_suffix(".lock")):
            if not path.exists():
                arrays = build()
                atomic_write(path, lambda tmp: np.savez(open(tmp, "wb"), **arrays))
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _unflatten(arrays: dict[str, np.ndarray], prefix: str) -> list[np.ndarray]:
    flat, offsets = arrays[f"{prefix}flat"], arrays[f"{prefix}offsets"]
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def _split_sizes(cfg: ListOpsTaskConfig | MQARTaskConfig) -> tuple[int, int, int]:
    return cfg.train_examples, cfg.eval_examples, cfg.eval_examples


def _generator_fields(cfg: ListOpsTaskConfig | MQARTaskConfig) -> dict[str, Any]:
    """The fields the examples depend on (not batch size, split choice or pooling)."""
    return cfg.model_dump(exclude={"batch_size", "eval_split", "eval_batches", "pooling", "causal"})


def listops_split(cfg: ListOpsTaskConfig, split: str, cache_dir: Path) -> tuple[list[np.ndarray], np.ndarray]:
    """(token ids per example, CLS first; values) of one split, generated once and cached."""
    settings = listops.ListOpsSettings(seed=cfg.seed, sizes=_split_sizes(cfg), min_len=cfg.min_len,
                                       max_len=cfg.seq_len - 1, max_depth=cfg.max_depth, max_args=cfg.max_args)
    path = Path(cache_dir) / "prepared" / f"listops-{cache_key(**_generator_fields(cfg))}.npz"
    arrays = _cached_arrays(path, lambda: {f"{split}_{name}": value
                                           for split, data in listops.generate_splits(settings).items()
                                           for name, value in data.items()})
    return _unflatten(arrays, f"{split}_"), arrays[f"{split}_labels"]


def mqar_split(cfg: MQARTaskConfig, split: str, cache_dir: Path) -> dict[str, np.ndarray]:
    """{"inputs", "positions", "answers"} of one split (tasks/mqar.py), generated once and cached."""
    n = dict(zip(SPLITS, _split_sizes(cfg)))[split]
    path = Path(cache_dir) / "prepared" / f"mqar-{split}-{cache_key(**_generator_fields(cfg))}.npz"
    return _cached_arrays(path, lambda: mqar.generate([cfg.seed, SPLITS.index(split)], n, cfg.seq_len,
                                                      cfg.num_kv_pairs, cfg.vocab_size, cfg.power_a,
                                                      cfg.random_non_queries))


class _ExampleTask:
    """Shared machinery of tasks made of fixed examples: sharded epochs, loss and accuracy over scored outputs.
    Subclasses give the model, a batch of example rows, and the (logits, labels) a batch is scored on."""

    metrics: tuple[str, ...] = ("val/loss", "val/acc")
    cfg: ListOpsTaskConfig | MQARTaskConfig

    def __init__(self, cfg: ListOpsTaskConfig | MQARTaskConfig, model_cfg: ModelConfig, ctx: WorkerContext,
                 n_train: int, n_eval: int):
        self.cfg, self.model_cfg, self.ctx = cfg, model_cfg, ctx
        self.n_train, self.n_eval = n_train, n_eval

    def _batch(self, rows: np.ndarray, split: str) -> Batch:
        raise NotImplementedError

    def _scored(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [N, C], labels [N]) of the N scored outputs of a batch."""
        raise NotImplementedError

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        order = epoch_permutation(self.n_train, self.ctx.seed, epoch)
        return [order[i:i + self.cfg.batch_size] for i in range(0, len(order), self.cfg.batch_size)]

    def train_batches(self, position: dict[str, Any] | None = None) -> Iterator[tuple[Batch, dict[str, Any]]]:
        for rows, after in sharded_batches(self._epoch_batches, self.ctx.rank, self.ctx.world_size, position):
            yield self._batch(rows, "train"), after

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits_NC, labels_N = self._scored(model, batch)
        return F.cross_entropy(logits_NC.float(), labels_N, reduction="sum") / max(batch.n_tokens, 1)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Mean loss and accuracy over every scored output of the evaluation split (or its first
        task.eval_batches batches)."""
        model = getattr(model, "module", model)
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        starts = range(0, self.n_eval, self.cfg.batch_size)
        if self.cfg.eval_batches is not None:
            starts = starts[: self.cfg.eval_batches]
        total, correct, count = 0.0, 0, 0
        for start in starts:
            batch = self._batch(np.arange(start, min(start + self.cfg.batch_size, self.n_eval)), "eval").to(device)
            logits_NC, labels_N = self._scored(model, batch)
            total += float(F.cross_entropy(logits_NC.float(), labels_N, reduction="sum"))
            correct += int((logits_NC.argmax(dim=-1) == labels_N).sum())
            count += len(labels_N)
        model.train(was_training)
        if count == 0:
            raise ValueError(f"the {self.cfg.eval_split} split of {self.cfg.source_label} has nothing to score")
        return {"val/loss": total / count, "val/acc": correct / count}

    def artifacts(self) -> dict[str, Path]:
        return {}  # no tokenizer: the ids are the generator's own


class ListOpsTask(_ExampleTask):
    """ListOps value classification over a bidirectional encoder; one scored output per example."""

    vocab_size = listops.VOCAB_SIZE

    def __init__(self, cfg: ListOpsTaskConfig, model_cfg: ModelConfig, ctx: WorkerContext):
        self.examples = {"train": listops_split(cfg, "train", ctx.cache_dir),
                         "eval": listops_split(cfg, cfg.eval_split, ctx.cache_dir)}
        super().__init__(cfg, model_cfg, ctx, len(self.examples["train"][0]), len(self.examples["eval"][0]))

    def build_model(self) -> nn.Module:
        return SequenceClassifier(self.model_cfg, self.vocab_size, listops.NUM_CLASSES, self.cfg.pooling)

    def _batch(self, rows: np.ndarray, split: str) -> Batch:
        ids, labels = self.examples[split]
        tokens_BT, mask_BT = pad_batch([ids[i].astype(np.int64) for i in rows])
        tensors = {"tokens": tokens_BT, "labels": torch.from_numpy(labels[rows])}
        if mask_BT is not None:
            tensors["padding_mask"] = mask_BT
        return Batch(tensors, len(rows))

    def _scored(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        t = batch.tensors
        return model(t["tokens"], t.get("padding_mask")), t["labels"]


class MQARTask(_ExampleTask):
    """Associative recall: the model's prediction at every query position, scored against the key's value."""

    def __init__(self, cfg: MQARTaskConfig, model_cfg: ModelConfig, ctx: WorkerContext):
        self.vocab_size = cfg.vocab_size
        self.examples = {"train": mqar_split(cfg, "train", ctx.cache_dir),
                         "eval": mqar_split(cfg, cfg.eval_split, ctx.cache_dir)}
        super().__init__(cfg, model_cfg, ctx, len(self.examples["train"]["inputs"]),
                         len(self.examples["eval"]["inputs"]))

    def build_model(self) -> nn.Module:
        return LanguageModel(self.model_cfg, self.vocab_size, causal=self.cfg.causal)

    def _batch(self, rows: np.ndarray, split: str) -> Batch:
        data = self.examples[split]
        targets_BT = mqar.targets(data["positions"][rows], data["answers"][rows], self.cfg.seq_len)
        tensors = {"tokens": torch.from_numpy(data["inputs"][rows].astype(np.int64)),
                   "targets": torch.from_numpy(targets_BT), "scored": scored_positions(targets_BT, mqar.IGNORE)}
        return Batch(tensors, len(rows) * self.cfg.num_kv_pairs)

    def _scored(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        t = batch.tensors
        return model(t["tokens"], None, t["scored"]), scored_targets(t["targets"], t["scored"])


def read_bytes(path: str, field: str) -> np.ndarray:
    """The file's bytes as int64 token ids 0-255 (a .gz file decompressed)."""
    resolved = _resolve(path, field)
    raw = gzip.open(resolved, "rb").read() if resolved.suffix == ".gz" else resolved.read_bytes()
    return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)


class ByteLMTask(CausalLMTask):
    """Causal LM over raw bytes: tasks/lm.py's packing, loss and evaluation, with bits per byte added.

    The stream is the file's bytes as they are, with no separator added: every byte after the first is a target
    once, so bits per byte is the mean loss over the file's bytes / ln 2."""

    def __init__(self, cfg: ByteLMTaskConfig, model_cfg: ModelConfig, ctx: WorkerContext):
        # Not CausalLMTask.__init__: no tokenizer and no Transformer-XL memory (check_compatible refuses it).
        self.cfg, self.model_cfg, self.ctx = cfg, model_cfg, ctx
        self.train_stream = read_bytes(cfg.files.train, "task.files.train")
        self.eval_stream = read_bytes(getattr(cfg.files, cfg.eval_split), f"task.files.{cfg.eval_split}")
        self.n_train_blocks = num_blocks(len(self.train_stream), cfg.seq_len, self.overlap)
        if self.n_train_blocks == 0 or len(self.eval_stream) < 2:
            raise ValueError(f"task.files: the training and {cfg.eval_split} files need at least 2 bytes each")
        self.memory = None

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB

    def _eval_metrics(self, total: float, count: int) -> dict[str, float]:
        metrics = super()._eval_metrics(total, count)
        return {**metrics, "val/bpb": metrics["val/loss"] / math.log(2)}

    def artifacts(self) -> dict[str, Path]:
        return {}
