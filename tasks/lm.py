"""Masked and causal language modelling over packed blocks of a token stream.

Training text is one stream of documents separated by eos (tasks/data.py `token_stream`), cut into blocks of
seq_len tokens: a causal block carries one extra token so that its seq_len targets are the next tokens, and
consecutive causal blocks overlap by that token, so every token is a target exactly once. Only the last block of
a split can be short; it is padded and masked. Evaluation runs over the whole split and weights every target
token equally (sum of losses / number of targets), so perplexity does not depend on the batch size.

Masked LM follows BERT (Devlin et al., 2019, arXiv 1810.04805): mask_prob of the tokens are selected; of those
80% become <mask>, 10% a random token and 10% stay unchanged, and the loss is over the selected tokens only:
only their hidden states go through the output layer (as fairseq's RoBERTa head does), which skips ~85% of its work.
The masking of a training batch is seeded by its position in the stream, so a resumed run masks identically;
evaluation seeds each block's masks by the block, so masked-LM perplexities are comparable across runs and batch
sizes (the same tokens are masked whatever task.batch_size is).

A causal LM with `model.memory` (Transformer-XL) reads ordered segments instead of shuffled blocks and carries
the cached states from step to step and through checkpoints; tasks/recurrence.py holds that machinery.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import LanguageModel, ModelConfig
from tasks.base import Batch, WorkerContext, scored_positions, scored_targets
from tasks.config import CausalLMTaskConfig, MLMTaskConfig
from tasks.data import epoch_permutation, prepare_lm, sharded_batches
from tasks.recurrence import (
    SegmentMemory,
    covering_rows,
    num_segments,
    ordered_positions,
    ordered_rows,
    segment,
)
from tasks.tokenizer import MASK_ID, PAD_ID

IGNORE = -100
"""Target value of positions without a loss (F.cross_entropy's ignore_index)."""
_FIRST_ORDINARY_ID = MASK_ID + 1  # random replacement tokens are drawn from the ordinary pieces
_EVAL_MASK_SEED = 20191810  # fixed, so every run masks the evaluation split identically


def num_blocks(n_tokens: int, seq_len: int, overlap: int) -> int:
    """Blocks of seq_len (+ overlap) tokens with stride seq_len that cover a stream of n_tokens."""
    return max(0, math.ceil((n_tokens - overlap) / seq_len))


def pack_blocks(stream: np.ndarray, indices: np.ndarray, seq_len: int, overlap: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks `indices` of the stream as a [B, seq_len + overlap] array padded with PAD_ID, and their lengths."""
    width = seq_len + overlap
    out = np.full((len(indices), width), PAD_ID, dtype=np.int64)
    lengths = np.zeros(len(indices), dtype=np.int64)
    for row, i in enumerate(indices):
        piece = stream[i * seq_len: i * seq_len + width]
        out[row, : len(piece)] = piece
        lengths[row] = len(piece)
    return out, lengths


def apply_bert_masking(tokens_BT: np.ndarray, lengths_B: np.ndarray, mask_prob: float, vocab_size: int,
                       rng: np.random.Generator | Sequence[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets): selected positions get targets, and inputs 80% <mask> / 10% random / 10% unchanged.
    `rng` draws for the whole batch, or is one generator per row: evaluation seeds each block's by the block, so
    which tokens a block scores does not depend on task.batch_size (two trials of a study that differ in it are
    scored on the same masked tokens)."""
    B, T = tokens_BT.shape
    real_BT = np.arange(T)[None, :] < lengths_B[:, None]
    if isinstance(rng, np.random.Generator):
        selected_BT = (rng.random((B, T)) < mask_prob) & real_BT
        first = rng
    else:
        draws = [(row.random(T), row.random(T), row.integers(_FIRST_ORDINARY_ID, vocab_size, size=T)) for row in rng]
        selected_BT = (np.stack([d[0] for d in draws]) < mask_prob) & real_BT
        first = rng[0]
    if not selected_BT.any():  # a tiny batch may draw no position; predict one so the loss is defined
        row = int(first.integers(B))
        selected_BT[row, int(first.integers(max(1, lengths_B[row])))] = True
    action_BT = rng.random((B, T)) if first is rng else np.stack([d[1] for d in draws])
    inputs_BT = tokens_BT.copy()
    inputs_BT[selected_BT & (action_BT < 0.8)] = MASK_ID
    randomise_BT = selected_BT & (action_BT >= 0.8) & (action_BT < 0.9)
    inputs_BT[randomise_BT] = (rng.integers(_FIRST_ORDINARY_ID, vocab_size, size=int(randomise_BT.sum()))
                               if first is rng else np.stack([d[2] for d in draws])[randomise_BT])
    targets_BT = np.where(selected_BT, tokens_BT, IGNORE)
    return inputs_BT, targets_BT


def _padding_mask(lengths_B: np.ndarray, T: int) -> torch.Tensor | None:
    """True = padding, or None when the batch has none (lets attention skip the mask)."""
    if (lengths_B == T).all():
        return None
    return torch.from_numpy(np.arange(T)[None, :] >= lengths_B[:, None])


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class _EpochBatches(Sequence):
    """Batch j of an epoch is (epoch, j, blocks order[j*bs:(j+1)*bs]); made when asked for, so a corpus of
    millions of blocks costs one permutation, not a list of batches."""

    def __init__(self, epoch: int, order: np.ndarray, batch_size: int):
        self.epoch, self.order, self.batch_size = epoch, order, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.order) / self.batch_size)

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        j = j + len(self) if j < 0 else j
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self.epoch, j, self.order[j * self.batch_size:(j + 1) * self.batch_size]


class _LanguageModelTask:
    """Shared machinery; subclasses say how a block becomes (inputs, targets)."""

    causal: bool
    overlap: int
    metrics: tuple[str, ...] = ("val/loss", "val/ppl")
    scores_targets_only: bool = False
    """Project only the positions with a target onto the vocabulary (worth it when few have one)."""

    def __init__(self, cfg: MLMTaskConfig | CausalLMTaskConfig, model_cfg: ModelConfig, ctx: WorkerContext):
        self.cfg, self.model_cfg, self.ctx = cfg, model_cfg, ctx
        self.tokenizer, self.tokenizer_cache_hit, streams = prepare_lm(cfg, ("train", cfg.eval_split), ctx.cache_dir)
        self.train_stream, self.eval_stream = streams["train"], streams[cfg.eval_split]
        self.n_train_blocks = num_blocks(len(self.train_stream), cfg.seq_len, self.overlap)
        if self.n_train_blocks == 0:
            raise ValueError(f"the training split of {cfg.source_label} has no tokens")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def build_model(self) -> nn.Module:
        return LanguageModel(self.model_cfg, self.vocab_size, causal=self.causal)

    def _epoch_batches(self, epoch: int) -> "_EpochBatches":
        return _EpochBatches(epoch, epoch_permutation(self.n_train_blocks, self.ctx.seed, epoch), self.cfg.batch_size)

    def train_batches(self, position: dict[str, Any] | None = None) -> Iterator[tuple[Batch, dict[str, Any]]]:
        for (epoch, index, blocks), after in sharded_batches(self._epoch_batches, self.ctx.rank,
                                                             self.ctx.world_size, position):
            tokens_BL, lengths_B = pack_blocks(self.train_stream, blocks, self.cfg.seq_len, self.overlap)
            # seeded by the batch's identity, not by a running generator, so resuming reproduces it
            rng = np.random.default_rng([self.ctx.seed, 1, epoch, index])
            yield self._make_batch(tokens_BL, lengths_B, rng), after

    def _make_batch(self, tokens_BL: np.ndarray, lengths_B: np.ndarray,
                    rng: np.random.Generator | Sequence[np.random.Generator] | None) -> Batch:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self._loss_sum(model, batch) / max(batch.n_tokens, 1)

    def _loss_sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        t = batch.tensors
        targets_BT = t["targets"]
        if self.scores_targets_only:
            # The same sum as below without computing logits nobody scores (cross_entropy would ignore them).
            logits_NV = model(t["tokens"], t.get("padding_mask"), t["scored"])
            return F.cross_entropy(logits_NV.float(), scored_targets(targets_BT, t["scored"]), reduction="sum")
        logits_BTV = model(t["tokens"], t.get("padding_mask"))
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(), ignore_index=IGNORE,
                               reduction="sum")

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Token-weighted loss over the evaluation split (or its first task.eval_batches batches)."""
        model = getattr(model, "module", model)  # a DDP wrapper: score the module itself, on this rank alone
        was_training = model.training
        model.eval()
        device = _model_device(model)
        n_blocks = num_blocks(len(self.eval_stream), self.cfg.seq_len, self.overlap)
        starts = range(0, n_blocks, self.cfg.batch_size)
        if self.cfg.eval_batches is not None:
            starts = starts[: self.cfg.eval_batches]
        total, count = 0.0, 0
        for start in starts:
            blocks = np.arange(start, min(start + self.cfg.batch_size, n_blocks))
            tokens_BL, lengths_B = pack_blocks(self.eval_stream, blocks, self.cfg.seq_len, self.overlap)
            # masked LM: each block's masks from its own seed (apply_bert_masking), whatever the batch size
            rows = [np.random.default_rng([_EVAL_MASK_SEED, int(block)]) for block in blocks]
            batch = self._make_batch(tokens_BL, lengths_B, rows).to(device)
            total += float(self._loss_sum(model, batch))
            count += batch.n_tokens
        model.train(was_training)
        return self._eval_metrics(total, count)

    def _eval_metrics(self, total: float, count: int) -> dict[str, float]:
        """Token-weighted loss and perplexity from a summed loss over `count` scored tokens."""
        if count == 0:
            raise ValueError(f"the {self.cfg.eval_split} split of {self.cfg.source_label} has no tokens to score")
        loss = total / count
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}

    def artifacts(self) -> dict[str, Path]:
        return {"tokenizer": self.tokenizer.model_path}


class MaskedLMTask(_LanguageModelTask):
    """BERT-style masked LM with a bidirectional encoder; val/ppl is the exp of the masked-token loss."""

    causal = False
    overlap = 0
    scores_targets_only = True  # mask_prob (~15%) of the tokens: the output layer skips the other ~85%

    def __init__(self, cfg: MLMTaskConfig, model_cfg: ModelConfig, ctx: WorkerContext):
        super().__init__(cfg, model_cfg, ctx)
        self.mask_prob = cfg.mask_prob

    def _make_batch(self, tokens_BL: np.ndarray, lengths_B: np.ndarray,
                    rng: np.random.Generator | Sequence[np.random.Generator] | None) -> Batch:
        inputs_BT, targets_BT = apply_bert_masking(tokens_BL, lengths_B, self.mask_prob, self.vocab_size, rng)
        tensors = {"tokens": torch.from_numpy(inputs_BT), "targets": torch.from_numpy(targets_BT),
                   "scored": scored_positions(targets_BT, IGNORE)}
        mask_BT = _padding_mask(lengths_B, tokens_BL.shape[1])
        if mask_BT is not None:
            tensors["padding_mask"] = mask_BT
        return Batch(tensors, int((targets_BT != IGNORE).sum()))


class CausalLMTask(_LanguageModelTask):
    """Next-token prediction with a decoder-only model."""

    causal = True
    overlap = 1

    def _make_batch(self, tokens_BL: np.ndarray, lengths_B: np.ndarray,
                    rng: np.random.Generator | Sequence[np.random.Generator] | None) -> Batch:
        inputs_BT, targets_BT = tokens_BL[:, :-1], tokens_BL[:, 1:].copy()
        T = inputs_BT.shape[1]
        target_lengths_B = lengths_B - 1
        targets_BT[np.arange(T)[None, :] >= target_lengths_B[:, None]] = IGNORE
        tensors = {"tokens": torch.from_numpy(np.ascontiguousarray(inputs_BT)), "targets": torch.from_numpy(targets_BT)}
        # causal attention never looks right, so trailing padding needs no key mask: the padded positions'
        # outputs are simply not scored
        return Batch(tensors, int(target_lengths_B.sum()))

    # --- segment-level recurrence (model.memory) ------------------------------------------------------------

    def __init__(self, cfg: CausalLMTaskConfig, model_cfg: ModelConfig, ctx: WorkerContext):
        super().__init__(cfg, model_cfg, ctx)
        self.memory = SegmentMemory() if model_cfg.memory is not None else None
        if self.memory is not None:
            B = cfg.batch_size
            self.train_rows = ordered_rows(self.train_stream, B * ctx.world_size)[ctx.rank * B:(ctx.rank + 1) * B]
            self.n_train_segments = num_segments(self.train_rows.shape[1], cfg.seq_len)

    def train_batches(self, position: dict[str, Any] | None = None) -> Iterator[tuple[Batch, dict[str, Any]]]:
        if self.memory is None:
            yield from super().train_batches(position)
            return
        full_B = np.full(len(self.train_rows), self.train_rows.shape[1])
        for epoch, index, after in ordered_positions(self.n_train_segments, position):
            tokens_BL, lengths_B = segment(self.train_rows, full_B, index, self.cfg.seq_len)
            batch = self._make_batch(tokens_BL, lengths_B, None)
            batch.segment = (epoch, index)
            yield batch, after

    def _loss_sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        if self.memory is None:
            return super()._loss_sum(model, batch)
        assert batch.segment is not None, "train_batches gives every Transformer-XL batch its segment"
        epoch, index = batch.segment
        tokens_BT, targets_BT = batch.tensors["tokens"], batch.tensors["targets"]
        memory = self.memory.for_segment(model, epoch, index, tokens_BT.shape[0], tokens_BT.device)
        logits_BTV, new_memory = model(tokens_BT, memory=memory)
        self.memory.keep(epoch, index, new_memory)
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(), ignore_index=IGNORE,
                               reduction="sum")

    def stream_state(self) -> dict[str, Any] | None:
        """The training memory (None without model.memory): checkpointed with the data position."""
        return self.memory.state() if self.memory is not None else None

    def restore_stream_state(self, state: dict[str, Any] | None) -> None:
        if self.memory is not None:
            self.memory.load(state)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """With model.memory: the whole split as batch_size rows of ordered segments, each segment attending
        to its row's cached states (task.eval_batches caps the segments); otherwise independent blocks."""
        if self.memory is None:
            return super().evaluate(model)
        model = getattr(model, "module", model)
        was_training = model.training
        model.eval()
        device = _model_device(model)
        rows_BN, lengths_B = covering_rows(self.eval_stream, self.cfg.batch_size)
        n_segments = num_segments(rows_BN.shape[1], self.cfg.seq_len)
        if self.cfg.eval_batches is not None:
            n_segments = min(n_segments, self.cfg.eval_batches)
        memory = model.empty_memory(len(rows_BN), device)
        total, count = 0.0, 0
        for index in range(n_segments):
            tokens_BL, seg_lengths_B = segment(rows_BN, lengths_B, index, self.cfg.seq_len)
            batch = self._make_batch(tokens_BL, np.maximum(seg_lengths_B, 1), None).to(device)
            logits_BTV, memory = model(batch.tensors["tokens"], memory=memory)
            total += float(F.cross_entropy(logits_BTV.flatten(0, 1).float(), batch.tensors["targets"].flatten(),
                                           ignore_index=IGNORE, reduction="sum"))
            count += batch.n_tokens
        model.train(was_training)
        return self._eval_metrics(total, count)
