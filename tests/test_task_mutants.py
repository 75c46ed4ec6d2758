"""Tests written against surviving hand mutants of tasks/ (lm, recurrence, translation, classify, mqar, listops)
and models/classifier.py. Each test names the mistake it catches; expected values come from a direct formula or
from scoring every example on its own, never from the code under test."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import TypeAdapter

from models import ModelConfig, SequenceClassifier
from tasks import WorkerContext, build_task, listops, mqar
from tasks.classify import accuracy_and_macro_f1, encode_examples, pad_batch
from tasks.config import TaskConfig
from tasks.lm import _padding_mask, apply_bert_masking
from tasks.recurrence import SegmentMemory, num_segments, ordered_rows
from tasks.tokenizer import EOS_ID, MASK_ID
from tasks.translation import IGNORE, collate_pairs, length_batches

TASK = TypeAdapter(TaskConfig)
TINY = {"d_model": 16, "layers": 1, "ffn": 32, "dropout": 0.0, "attention": {"kind": "mha", "heads": 2}}
"""A one-layer model without dropout; each test adds its max_seq_len."""


# --- masked and causal LM (tasks/lm.py, tasks/recurrence.py) ---------------------------------------------------


def test_random_replacements_cover_every_ordinary_id_and_no_special_one():
    """Catches the random-token range cut short (integers(first, vocab_size - 1) never draws the last id) or
    widened to the special ids: BERT draws the replacement uniformly from the ordinary vocabulary."""
    vocab = MASK_ID + 4  # ordinary ids 5, 6, 7
    tokens = np.full((64, 64), MASK_ID + 1)
    inputs, targets = apply_bert_masking(tokens, np.full(64, 64), 0.5, vocab, np.random.default_rng(0))
    drawn = inputs[(targets != -100) & (inputs != MASK_ID) & (inputs != tokens)]
    assert set(drawn.tolist()) == {MASK_ID + 2, MASK_ID + 3}, "every ordinary id other than the original is drawn"


def test_padding_mask_marks_exactly_the_positions_past_each_length():
    """Catches an off-by-one (> instead of >=) that lets the first padding position be attended to."""
    got = _padding_mask(np.array([3, 1, 4]), 4)
    assert got.tolist() == [[False, False, False, True], [False, True, True, True], [False] * 4]
    assert _padding_mask(np.array([4, 4]), 4) is None


def test_num_segments_covers_the_targets_of_a_row_and_no_more():
    """Catches ceil(row_len / seq_len) (an extra, empty segment when row_len - 1 is a multiple of seq_len)."""
    # a row of n tokens has n - 1 targets; segments of seq_len targets
    for n, seq_len in [(9, 4), (10, 4), (2, 1), (17, 16), (33, 16), (1, 4)]:
        assert num_segments(n, seq_len) == math.ceil(max(n - 1, 0) / seq_len), (n, seq_len)


def test_a_new_epoch_starts_every_row_with_an_empty_memory():
    """Catches segment 0 reading the memory left by the previous epoch's last segment (which would raise, or
    carry the end of the stream into its start)."""
    memory = SegmentMemory()
    model = nn.Module()
    model.empty_memory = lambda B, device: [torch.zeros(B, 0, 4)]
    memory.keep(0, 5, [torch.ones(2, 3, 4)])
    got = memory.for_segment(model, 1, 0, 2, torch.device("cpu"))
    assert [tuple(s.shape) for s in got] == [(2, 0, 4)]


def test_masked_lm_draws_new_masks_each_epoch(tmp_path):
    """Catches masking seeded by the batch index alone (not the epoch): every epoch would then mask the same
    cells of batch j, where the masking of a batch is documented as seeded by its position (epoch, batch)."""
    cfg = TASK.validate_python({"kind": "mlm", "seq_len": 16, "batch_size": 4, "vocab_size": 96,
                                "builtin": {"train_sentences": 100, "eval_sentences": 10, "lexicon_size": 12}})
    model = ModelConfig(max_seq_len=16, **TINY)
    task = build_task(cfg, model, WorkerContext(seed=3, cache_dir=tmp_path))
    first = next(task.train_batches({"epoch": 0, "step": 0}))[0].tensors["targets"] != -100
    again = next(task.train_batches({"epoch": 1, "step": 0}))[0].tensors["targets"] != -100
    assert first.shape == again.shape and not torch.equal(first, again)


def _xl_task(tmp_path, batch_size: int, rank: int = 0, world_size: int = 1):
    raw = {"kind": "clm", "seq_len": 8, "batch_size": batch_size, "vocab_size": 120,
           "builtin": {"train_sentences": 200, "eval_sentences": 20}}
    model = ModelConfig(d_model=16, layers=1, ffn=32, max_seq_len=16, dropout=0.0, positional="relative",
                        memory={"mem_len": 8}, attention={"kind": "mha", "heads": 2})
    ctx = WorkerContext(seed=0, cache_dir=tmp_path, rank=rank, world_size=world_size)
    return build_task(TASK.validate_python(raw), model, ctx)


def test_workers_read_disjoint_rows_of_the_stream_with_memory(tmp_path):
    """Catches rank r taking rows [r, r + B) instead of [rB, (r + 1)B): two workers would train on overlapping
    rows and never see others."""
    tasks = [_xl_task(tmp_path, 3, rank=r, world_size=2) for r in range(2)]
    every = np.asarray(ordered_rows(tasks[0].train_stream, 6))
    np.testing.assert_array_equal(np.concatenate([np.asarray(t.train_rows) for t in tasks]), every)


def test_evaluation_with_memory_divides_by_the_targets_when_a_row_ends_early(tmp_path, monkeypatch):
    """Catches a row with no token left in a segment counted as -1 targets (lengths - 1 without the floor at 1):
    val/loss must be the summed loss over exactly len(stream) - 1 targets."""
    task = _xl_task(tmp_path, batch_size=25)
    n_targets = len(task.eval_stream) - 1
    span = math.ceil(n_targets / 25)
    last_row_targets = n_targets - 24 * span
    assert span - last_row_targets > 8, "the last row must run out of tokens a whole segment before the others"
    torch.manual_seed(0)
    model = task.build_model()
    sums = []
    original = F.cross_entropy

    def summing(*args, **kw):
        out = original(*args, **kw)
        sums.append(float(out))
        return out

    monkeypatch.setattr(F, "cross_entropy", summing)
    loss = task.evaluate(model)["val/loss"]
    assert loss == pytest.approx(sum(sums) / n_targets, rel=1e-9)


# --- translation (tasks/translation.py) ---------------------------------------------------------------------


def _translation(tmp_path, max_seq_len: int = 64, **overrides):
    cfg = TASK.validate_python({
        "kind": "translation", "vocab_size": 200, "max_tokens": 200, "max_source_len": 48, "beam_size": 2,
        "label_smoothing": 0.1, "builtin": {"train_sentences": 400, "eval_sentences": 12, "lexicon_size": 12},
        **overrides})
    model = ModelConfig(d_model=16, layers=1, ffn=32, max_seq_len=max_seq_len, dropout=0.0,
                        positional="sinusoidal", attention={"kind": "mha", "heads": 2})
    task = build_task(cfg, model, WorkerContext(seed=0, cache_dir=tmp_path))
    torch.manual_seed(0)
    return task, task.build_model().double().eval()


def _pair_nll(model, src: np.ndarray, tgt: np.ndarray) -> float:
    """-log p(tgt + eos | src) of one pair, unpadded and unsmoothed."""
    tgt_in = torch.tensor([[2, *tgt.tolist()]])
    logits = model(torch.from_numpy(np.asarray(src))[None], tgt_in)[0]
    return float(F.cross_entropy(logits, torch.tensor([*tgt.tolist(), EOS_ID]), reduction="sum"))


def test_translation_validation_loss_is_unsmoothed_and_weighted_by_target_tokens(tmp_path):
    """Catches validation loss computed with the training label smoothing, or averaged over batches instead of
    over target tokens (eos included): the expected value scores every pair on its own."""
    task, model = _translation(tmp_path)
    src, tgt = task._eval_pairs()
    with torch.no_grad():
        expected = sum(_pair_nll(model, s, t) for s, t in zip(src, tgt)) / sum(len(t) + 1 for t in tgt)
        assert task._eval_loss(model, torch.device("cpu")) == pytest.approx(expected, rel=1e-6)  # fp32 loss


def test_translation_training_loss_is_label_smoothed_mean_over_target_tokens(tmp_path):
    """Catches the training loss divided by all positions (padding included) or by the sentences, and a
    smoothing other than Szegedy et al.'s: (1 - eps) * nll + eps * mean over the vocabulary of -log p."""
    task, model = _translation(tmp_path)
    src, tgt = [np.array([5, 6, 7, 8]), np.array([9, 10])], [np.array([11, 12, 13]), np.array([14])]
    batch = collate_pairs(src, tgt)
    eps, total, count = 0.1, 0.0, 0
    for s, t in zip(src, tgt):
        with torch.no_grad():
            logits = model(torch.from_numpy(s)[None], torch.tensor([[2, *t.tolist()]]))[0]
        logp = torch.log_softmax(logits, dim=-1)
        gold = torch.tensor([*t.tolist(), EOS_ID])
        total += float(((1 - eps) * -logp.gather(1, gold[:, None])[:, 0] - eps * logp.mean(-1)).sum())
        count += len(gold)
    assert batch.n_tokens == count == 6 and (batch.tensors["tgt_out"] == IGNORE).sum() == 2
    with torch.no_grad():
        loss = float(task.loss(model, batch))
    assert loss == pytest.approx(total / count, rel=1e-6)  # the task's loss is fp32


def test_translation_evaluation_cuts_targets_to_what_the_decoder_can_position(tmp_path):
    """Catches evaluation targets cut to max_seq_len pieces: bos + target would then need max_seq_len + 1
    positions and the evaluation fails on any long reference."""
    task, model = _translation(tmp_path, max_seq_len=20, max_source_len=20)
    assert max(len(t) for t in task.eval_data.tgt) >= 20, "some reference must be longer than the model"
    assert all(len(t) == min(len(r), 19) for t, r in zip(task._eval_pairs()[1], task.eval_data.tgt))
    with torch.no_grad():
        assert math.isfinite(task._eval_loss(model, torch.device("cpu")))


def test_token_budget_batches_may_fill_the_budget_exactly():
    """Catches >= for > in the budget test: a batch of exactly max_tokens padded tokens is allowed."""
    src, tgt = np.array([3, 3, 3]), np.array([2, 2, 2])  # 3 + (2 + 1) = 6 tokens a pair
    assert [b.tolist() for b in length_batches(src, tgt, np.arange(3), 12)] == [[0, 1], [2]]


class _Echo(nn.Module):
    """Translates a source into its first token: bos -> that token, anything else -> eos."""

    def encode(self, src_BS, src_padding_mask_BS=None):
        return src_BS[:, :1, None].double()

    def decode(self, tgt_in_BT, memory_BSD, src_padding_mask_BS=None, tgt_padding_mask_BT=None):
        logits = torch.zeros(*tgt_in_BT.shape, 200, dtype=torch.float64)
        first = memory_BSD[:, 0, 0].long()[:, None].expand_as(tgt_in_BT)
        at_bos = tgt_in_BT == 2
        logits.scatter_(2, torch.where(at_bos, first, EOS_ID)[..., None], 10.0)
        return logits


def test_translate_returns_hypotheses_in_the_input_order(tmp_path):
    """Catches hypotheses of a length-sorted batch written back in another order (sentence i receiving the
    translation of another source), which BLEU against the references would punish."""
    task, _ = _translation(tmp_path, max_tokens=48)  # 24 tokens a batch per beam: batches of 1 to 3 sentences
    lengths = [7, 2, 5, 3, 6, 2, 4]
    sources = [np.array([20 + i] + [9] * (n - 1)) for i, n in enumerate(lengths)]
    got = task.translate(_Echo(), sources, torch.device("cpu"))
    assert got == [[20 + i] for i in range(len(sources))]


# --- classification (tasks/classify.py, models/classifier.py) ------------------------------------------------


class _Chars:
    def encode(self, texts):
        return [[10 + ord(c) - ord("a") for c in text] for text in texts]


def test_a_pair_loses_pieces_from_its_longer_side_whichever_side_that_is():
    """Catches truncation that always cuts the first side (HF's "longest_first" cuts the longer one)."""
    pair = encode_examples(_Chars(), (["xy"], ["abcdefgh"]), max_len=9)[0]
    assert pair.tolist() == [EOS_ID, *_Chars().encode(["xy"])[0], EOS_ID, *_Chars().encode(["abcd"])[0], EOS_ID]


def test_pad_batch_masks_exactly_the_padding():
    """Catches an off-by-one in the classifier's padding mask (the first padding position left visible)."""
    tokens, mask = pad_batch([np.array([3, 7, 3]), np.array([3, 3])])
    assert tokens.tolist() == [[3, 7, 3], [3, 3, 0]]
    assert mask.tolist() == [[False] * 3, [False, False, True]]


def test_macro_f1_averages_over_classes_in_labels_or_predictions():
    """Catches macro F1 over the label classes only: scikit-learn's f1_score(average="macro") also counts a
    class that is only predicted (its F1 is 0)."""
    labels, predicted = np.array([0, 0, 1, 1, 1]), np.array([0, 2, 1, 1, 0])
    f1 = {0: 2 * 1 / (2 * 1 + 1 + 1), 1: 2 * 2 / (2 * 2 + 0 + 1), 2: 0.0}  # 2tp / (2tp + fp + fn) by hand
    accuracy, macro = accuracy_and_macro_f1(labels, predicted)
    assert accuracy == pytest.approx(3 / 5)
    assert macro == pytest.approx(sum(f1.values()) / 3)


def test_first_pooling_reads_position_zero_whatever_the_padding():
    """Catches 'first' pooling reading another position (the last one is padding in a padded row)."""
    torch.manual_seed(0)
    cfg = ModelConfig(max_seq_len=16, **TINY)
    model = SequenceClassifier(cfg, 40, 3, pooling="first").double().eval()
    short = torch.tensor([[3, 11, 12, 3]])
    batch = torch.cat([torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], 1), torch.arange(20, 27)[None]])
    mask = torch.arange(7)[None, :] >= torch.tensor([[4], [7]])
    with torch.no_grad():
        torch.testing.assert_close(model(batch, mask)[0], model(short)[0], atol=1e-12, rtol=1e-12)


def test_classification_head_is_robertas():
    """Catches another activation or order in the head: RoBERTa's is out_proj(tanh(dense(x))) (Hugging Face
    RobertaClassificationHead, dropout aside)."""
    torch.manual_seed(0)
    cfg = ModelConfig(max_seq_len=16, **TINY)
    head = SequenceClassifier(cfg, 40, 3).head.eval()
    x = torch.randn(5, 16)
    expected = torch.tanh(x @ head.dense.weight.T + head.dense.bias) @ head.out_proj.weight.T + head.out_proj.bias
    torch.testing.assert_close(head(x), expected)


def test_classification_validation_loss_is_the_mean_over_examples(tmp_path):
    """Catches the summed loss divided by the number of batches instead of the number of examples."""
    cfg = TASK.validate_python({"kind": "classify", "dataset": "builtin", "num_classes": 2, "vocab_size": 120,
                                "batch_size": 4, "max_len": 64,
                                "builtin": {"train_sentences": 60, "eval_sentences": 10}})
    model_cfg = ModelConfig(max_seq_len=64, **TINY)
    task = build_task(cfg, model_cfg, WorkerContext(seed=0, cache_dir=tmp_path))
    torch.manual_seed(0)
    model = task.build_model().double().eval()
    with torch.no_grad():
        losses = [float(F.cross_entropy(model(torch.from_numpy(ids)[None]), torch.tensor([int(y)])))
                  for ids, y in zip(task.eval_ids, task.eval_labels)]
        assert task.evaluate(model)["val/loss"] == pytest.approx(float(np.mean(losses)), rel=1e-6)  # fp32 loss


# --- generated long-range data (tasks/mqar.py, tasks/listops.py) ---------------------------------------------


def test_mqar_query_slots_are_the_whole_query_region():
    """Catches a query region one slot short: Zoology has (seq_len - 2P) // 2 slots, P(g) ~ a * g**(a - 1)."""
    p = mqar.query_slot_probabilities(64, 4, 0.1)
    g = np.arange(1, (64 - 8) // 2 + 1)
    np.testing.assert_allclose(p, 0.1 * g**-0.9 / (0.1 * g**-0.9).sum())


def test_mqar_random_fillers_range_over_the_whole_vocabulary():
    """Catches fillers that never draw id 0: Zoology fills with randint(0, vocab_size)."""
    data = mqar.generate(0, 20, 64, 4, 80, 0.1, random_non_queries=True)
    fillers = np.ones_like(data["inputs"], dtype=bool)
    fillers[:, :8] = False
    np.put_along_axis(fillers, data["positions"].astype(np.int64), False, axis=1)
    assert data["inputs"][fillers].min() == 0 and data["inputs"][fillers].max() == 79


def _arity(tree) -> list[int]:
    if isinstance(tree, int):
        return []
    return [len(tree[1])] + [n for arg in tree[1] for n in _arity(arg)]


def test_listops_operators_take_at_least_two_arguments():
    """Catches randint(1, max_args): LRA's generate_tree draws randint(2, max_args) arguments."""
    rng = random.Random(0)
    arities = [n for _ in range(200) for n in _arity(listops.generate_tree(rng, 1, 4, 5)[0])]
    assert min(arities) == 2 and max(arities) == 5
