"""Sentence-level translation: length-bucketed batches, label-smoothed cross entropy, beam search, BLEU.

Batches follow the token-budget bucketing of fairseq (Ott et al., 2019, arXiv 1904.01038): pairs sorted by
length (ties broken by the epoch's permutation) are cut into batches whose padded source + target tokens stay
within task.max_tokens, and the batches are then shuffled, so padding is small and steps have similar cost.
Training uses label smoothing (Szegedy et al., 2016, arXiv 1512.00567) over non-padding targets; validation loss
and perplexity are unsmoothed and token-weighted. BLEU (Papineni et al., 2002) and chrF (Popovic, 2015) come
from sacrebleu on detokenised hypotheses against the raw reference sentences, so scores are comparable with
published sacrebleu numbers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import sacrebleu
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import ModelConfig, Seq2SeqTransformer
from tasks.base import Batch, EvaluationFiles, WorkerContext
from tasks.beam_search import DecodeSpecials, beam_search, max_lengths
from tasks.config import TranslationTaskConfig
from tasks.data import ParallelSplit, epoch_permutation, prepare_parallel, sharded_batches
from tasks.tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID

IGNORE = -100
"""Target value of padded positions (F.cross_entropy's ignore_index)."""


def length_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, order: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Cut `order` (already sorted by length) into batches of at most max_tokens padded source + target tokens.

    Target tokens count the bos-shifted input (length + 1). A single pair over budget still gets its own batch.
    """
    batches: list[np.ndarray] = []
    start, max_src, max_tgt = 0, 0, 0
    for i, idx in enumerate(order):
        s, t = int(src_lengths[idx]), int(tgt_lengths[idx]) + 1
        new_src, new_tgt = max(max_src, s), max(max_tgt, t)
        if i > start and (i - start + 1) * (new_src + new_tgt) > max_tokens:
            batches.append(order[start:i])
            start, new_src, new_tgt = i, s, t
        max_src, max_tgt = new_src, new_tgt
    if start < len(order):
        batches.append(order[start:])
    return batches


def collate_pairs(src: list[np.ndarray], tgt: list[np.ndarray]) -> Batch:
    """src [B, S] + mask, decoder input bos + tgt [B, T] + mask, targets tgt + eos with padding ignored."""
    B, T = len(src), max(len(t) for t in tgt) + 1
    src_BS, src_padding_mask_BS = pad_sources(src)
    tgt_in_BT = np.full((B, T), PAD_ID, dtype=np.int64)
    tgt_out_BT = np.full((B, T), IGNORE, dtype=np.int64)
    for b, t in enumerate(tgt):
        tgt_in_BT[b, : len(t) + 1] = np.concatenate([[BOS_ID], t])
        tgt_out_BT[b, : len(t) + 1] = np.concatenate([t, [EOS_ID]])
    tensors = {
        "src": src_BS,
        "src_padding_mask": src_padding_mask_BS,
        "tgt_in": torch.from_numpy(tgt_in_BT),
        "tgt_padding_mask": torch.from_numpy(tgt_out_BT == IGNORE),
        "tgt_out": torch.from_numpy(tgt_out_BT),
    }
    return Batch(tensors, int((tgt_out_BT != IGNORE).sum()))


def pad_sources(src: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources as [B, S] ids padded with PAD_ID, and the padding mask (True = padding)."""
    src_BS = np.full((len(src), max(len(s) for s in src)), PAD_ID, dtype=np.int64)
    for b, s in enumerate(src):
        src_BS[b, : len(s)] = s
    return torch.from_numpy(src_BS), torch.from_numpy(src_BS == PAD_ID)


def corpus_scores(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """sacrebleu corpus BLEU (13a tokenisation) and chrF of detokenised text."""
    return {"val/bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
            "val/chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score}


class TranslationTask:
    """Encoder-decoder translation from task.source_lang to task.target_lang with a joint vocabulary."""

    metrics: tuple[str, ...] = TranslationTaskConfig.metrics

    def __init__(self, cfg: TranslationTaskConfig, model_cfg: ModelConfig, ctx: WorkerContext):
        self.cfg, self.model_cfg, self.ctx = cfg, model_cfg, ctx
        self.tokenizer, self.tokenizer_cache_hit, splits = prepare_parallel(cfg, ("train", cfg.eval_split), ctx.cache_dir)
        self.eval_data: ParallelSplit = splits[cfg.eval_split]
        train = splits["train"]
        # drop over-long training pairs: the target input is bos + target, so it needs one more position
        max_tgt = min(cfg.max_source_len, model_cfg.max_seq_len - 1)
        src_len, tgt_len = train.src.lengths, train.tgt.lengths
        keep = np.flatnonzero((src_len > 0) & (src_len <= cfg.max_source_len) & (tgt_len > 0) & (tgt_len <= max_tgt))
        if not len(keep):
            raise ValueError(f"no training pair of {cfg.source_label} fits task.max_source_len={cfg.max_source_len}")
        # views of the memory-mapped pairs: a batch reads its own pairs, nothing else is copied
        self.train_src, self.train_tgt = train.src.pick(keep), train.tgt.pick(keep)
        self.train_src_len, self.train_tgt_len = src_len[keep], tgt_len[keep]
        self.specials = DecodeSpecials(bos=BOS_ID, eos=EOS_ID, forbidden=(PAD_ID, BOS_ID, MASK_ID, UNK_ID))
        self._epoch_cache: tuple[int, list[np.ndarray]] | None = None
        self._outputs = EvaluationFiles("translation-eval-")
        self.last_hypotheses: list[str] = []

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def build_model(self) -> nn.Module:
        return Seq2SeqTransformer(self.model_cfg, self.vocab_size)

    # --- training ---------------------------------------------------------------------------------------------

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            n = len(self.train_src)
            tie_break = np.empty(n, dtype=np.int64)
            tie_break[epoch_permutation(n, self.ctx.seed, epoch)] = np.arange(n)
            order = np.lexsort((tie_break, self.train_tgt_len, self.train_src_len))
            batches = length_batches(self.train_src_len, self.train_tgt_len, order, self.cfg.max_tokens)
            shuffle = np.random.default_rng([self.ctx.seed, 2, epoch]).permutation(len(batches))
            self._epoch_cache = (epoch, [batches[i] for i in shuffle])
        return self._epoch_cache[1]

    def train_batches(self, position: dict[str, Any] | None = None) -> Iterator[tuple[Batch, dict[str, Any]]]:
        for indices, after in sharded_batches(self._epoch_batches, self.ctx.rank, self.ctx.world_size, position):
            yield collate_pairs([self.train_src[i] for i in indices], [self.train_tgt[i] for i in indices]), after

    def _loss_sum(self, model: nn.Module, batch: Batch, label_smoothing: float) -> torch.Tensor:
        t = batch.tensors
        logits_BTV = model(t["src"], t["tgt_in"], t["src_padding_mask"], t["tgt_padding_mask"])
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), t["tgt_out"].flatten(), ignore_index=IGNORE,
                               label_smoothing=label_smoothing, reduction="sum")

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self._loss_sum(model, batch, self.cfg.label_smoothing) / max(batch.n_tokens, 1)

    # --- evaluation -------------------------------------------------------------------------------------------

    def _eval_pairs(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Evaluation pairs cut to what the model can position: sources to max_source_len, targets to fit."""
        max_tgt = self.model_cfg.max_seq_len - 1
        return ([s[: self.cfg.max_source_len] for s in self.eval_data.src],
                [t[:max_tgt] for t in self.eval_data.tgt])

    def _eval_loss(self, model: nn.Module, device: torch.device) -> float:
        src, tgt = self._eval_pairs()
        src_len, tgt_len = np.array([len(s) for s in src]), np.array([len(t) for t in tgt])
        order = np.lexsort((np.arange(len(src)), tgt_len, src_len))
        batches = length_batches(src_len, tgt_len, order, self.cfg.max_tokens)
        if self.cfg.eval_batches is not None:
            batches = batches[: self.cfg.eval_batches]
        total, count = 0.0, 0
        for indices in batches:
            batch = collate_pairs([src[i] for i in indices], [tgt[i] for i in indices]).to(device)
            total += float(self._loss_sum(model, batch, 0.0))
            count += batch.n_tokens
        return total / max(count, 1)

    def translate(self, model: nn.Module, sources: list[np.ndarray], device: torch.device, *,
                  incremental: bool | None = None, drop_finished: bool = True) -> list[list[int]]:
        """Beam search over sources in length-sorted batches; pieces in the input order.

        `incremental`, `drop_finished` (beam_search's): None uses the decoder's key/value cache whenever the model
        has one; a sentence leaves its batch once its search is done unless drop_finished is False.
        """
        src_len = np.array([len(s) for s in sources])
        order = np.argsort(src_len, kind="stable")
        # the beam multiplies every source by beam_size, so the budget is shared among the beams
        batches = length_batches(src_len, src_len, order, max(self.cfg.max_tokens // self.cfg.beam_size, 1))
        out: list[list[int]] = [[] for _ in sources]
        for indices in batches:
            src_BS, mask_BS = pad_sources([sources[i] for i in indices])
            src_BS, mask_BS = src_BS.to(device), mask_BS.to(device)
            limit_B = max_lengths(torch.as_tensor(src_len[indices], device=device), self.cfg.max_len_a,
                                  self.cfg.max_len_b, self.model_cfg.max_seq_len - 1)
            hyps, _ = beam_search(model, src_BS, mask_BS, limit_B,
                                  self.specials, beam_size=self.cfg.beam_size, length_penalty=self.cfg.length_penalty,
                                  incremental=incremental, drop_finished=drop_finished)
            for i, hyp in zip(indices, hyps):
                out[i] = hyp
        return out

    def score_pieces(self, hypotheses: list[list[int]], references: list[str]) -> dict[str, float]:
        """Detokenise piece ids and score them against raw references; keeps the text for artifacts()."""
        self.last_hypotheses = self.tokenizer.decode(hypotheses)
        return corpus_scores(self.last_hypotheses, references)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Token-weighted unsmoothed loss over the split, then beam search + sacrebleu on (the first
        task.eval_max_sentences of) its sources; the hypotheses are written for artifacts()."""
        model = getattr(model, "module", model)  # a DDP wrapper has no encode/decode: use the module itself
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        loss = self._eval_loss(model, device)
        src, _ = self._eval_pairs()
        n = len(src) if self.cfg.eval_max_sentences is None else min(len(src), self.cfg.eval_max_sentences)
        scores = self.score_pieces(self.translate(model, src[:n], device), self.eval_data.references[:n])
        self._write_hypotheses()
        model.train(was_training)
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0)), **scores}

    def _write_hypotheses(self) -> None:
        self._outputs.write("hypotheses.txt", "\n".join(self.last_hypotheses) + "\n")

    def artifacts(self) -> dict[str, Path]:
        out = {"tokenizer": self.tokenizer.model_path}
        if (hypotheses := self._outputs.get("hypotheses.txt")) is not None:
            out["hypotheses"] = hypotheses
        return out
