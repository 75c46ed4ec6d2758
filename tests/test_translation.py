"""Translation: token-budget batches, beam search vs greedy, BLEU through the real pipeline, a tiny model learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from pydantic import TypeAdapter

from models import ModelConfig, Seq2SeqTransformer
from tasks import WorkerContext, build_task
from tasks.beam_search import DecodeSpecials, beam_search, greedy_decode, max_lengths, sequence_log_prob
from tasks.config import TaskConfig
from tasks.translation import IGNORE, collate_pairs, length_batches
from tests.training import fit_task

TASK = TypeAdapter(TaskConfig)
SPECIALS = DecodeSpecials(bos=2, eos=3, forbidden=(0, 1, 2, 4))


def _task(cache_dir, **overrides):
    cfg = TASK.validate_python({
        "kind": "translation", "vocab_size": 200, "max_tokens": 1200, "max_source_len": 48, "beam_size": 2,
        "builtin": {"train_sentences": 3000, "eval_sentences": 60, "lexicon_size": 12}, **overrides})
    model = ModelConfig(d_model=64, layers=1, ffn=128, max_seq_len=64, dropout=0.0, positional="sinusoidal",
                        attention={"kind": "mha", "heads": 4})
    return build_task(cfg, model, WorkerContext(seed=0, cache_dir=cache_dir))


def test_length_batches_respect_the_token_budget():
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 40, size=500), rng.integers(1, 40, size=500)
    order = np.lexsort((tgt, src))
    batches = length_batches(src, tgt, order, max_tokens=400)
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))
    for batch in batches:
        assert len(batch) * (src[batch].max() + tgt[batch].max() + 1) <= 400


def test_collate_shifts_targets_and_ignores_padding():
    batch = collate_pairs([np.array([5, 6, 7]), np.array([8])], [np.array([9, 10]), np.array([11, 12, 13])])
    t = batch.tensors
    assert t["tgt_in"][0].tolist() == [2, 9, 10, 0] and t["tgt_out"][0].tolist() == [9, 10, 3, IGNORE]
    assert t["tgt_in"][1].tolist() == [2, 11, 12, 13] and t["tgt_out"][1].tolist() == [11, 12, 13, 3]
    assert t["src_padding_mask"].tolist() == [[False] * 3, [False, True, True]]
    assert batch.n_tokens == 7


def _random_model(vocab: int = 30) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, layers=1, ffn=64, max_seq_len=40, dropout=0.0, attention={"kind": "mha", "heads": 2})
    return Seq2SeqTransformer(cfg, vocab).eval()


def test_beam_of_one_is_greedy():
    model = _random_model()
    src = torch.randint(5, 30, (6, 9))
    mask = torch.zeros_like(src, dtype=torch.bool)
    mask[3:, 6:] = True
    limit = max_lengths(torch.tensor([9, 9, 9, 6, 6, 6]), 1.0, 4, cap=39)
    greedy = greedy_decode(model, src, mask, limit, SPECIALS)
    beam, _ = beam_search(model, src, mask, limit, SPECIALS, beam_size=1, length_penalty=1.0)
    assert beam == greedy
    assert all(len(h) < int(n) for h, n in zip(beam, limit)), "eos counts towards the length limit"


class _TableModel(nn.Module):
    """Decoder whose next-piece distribution depends only on the previous piece (a bigram table)."""

    def __init__(self, log_probs_VV: torch.Tensor):
        super().__init__()
        self.log_probs_VV = log_probs_VV

    def encode(self, src_BS, src_padding_mask_BS=None):
        return torch.zeros(src_BS.shape[0], src_BS.shape[1], 1)

    def decode(self, tgt_in_BT, memory_BSD, src_padding_mask_BS=None, tgt_padding_mask_BT=None):
        return self.log_probs_VV[tgt_in_BT]


def test_beam_search_beats_greedy_on_a_constructed_case():
    # pieces: 5 = A, 6 = B, 7..9 = C, D, E. After bos: A 0.55, B 0.45. After A the mass is spread over C, D, E;
    # after B, eos is almost certain. Greedy commits to A (p <= 0.55 * 0.33); the beam keeps B and finds
    # B eos (p = 0.45 * 0.95), the better sequence.
    V = 10
    table = torch.full((V, V), 1e-6)
    table[2, 5], table[2, 6] = 0.55, 0.45
    table[5, 7:10] = 0.33
    table[6, 3] = 0.95
    table[7:10, 3] = 1.0
    model = _TableModel(torch.log(table / table.sum(-1, keepdim=True)))
    src = torch.full((1, 3), 5)
    limit = torch.tensor([6])
    greedy = greedy_decode(model, src, None, limit, SPECIALS)[0]
    best, scores = beam_search(model, src, None, limit, SPECIALS, beam_size=2, length_penalty=0.0)
    assert greedy[0] == 5 and best[0] == [6]
    greedy_score = sequence_log_prob(model, src, None, greedy, 0, SPECIALS)
    beam_score = sequence_log_prob(model, src, None, best[0], 0, SPECIALS)
    assert beam_score == pytest.approx(scores[0], abs=1e-5)
    assert beam_score > greedy_score + 0.5


def test_perfect_output_scores_bleu_100(tmp_path):
    """Reference pieces, detokenised by the task's own tokenizer, must reproduce the raw references."""
    task = _task(tmp_path)
    pieces = [t.tolist() for t in task.eval_data.tgt]
    scores = task.score_pieces(pieces, task.eval_data.references)
    assert scores["val/bleu"] == pytest.approx(100.0) and scores["val/chrf"] == pytest.approx(100.0)
    shuffled = task.score_pieces(pieces[1:] + pieces[:1], task.eval_data.references)
    assert shuffled["val/bleu"] < 20


def test_resume_and_sharding_of_translation_batches(tmp_path):
    task = _task(tmp_path)
    stream = task.train_batches()
    first = [next(stream) for _ in range(6)]
    resumed = task.train_batches(first[2][1])
    for (expected, _), (batch, _) in zip(first[3:], [next(resumed) for _ in range(3)]):
        assert torch.equal(expected.tensors["src"], batch.tensors["src"])
        assert torch.equal(expected.tensors["tgt_out"], batch.tensors["tgt_out"])
    everything = sorted(np.concatenate(task._epoch_batches(0)).tolist())
    assert everything == list(range(len(task.train_src))), "an epoch holds every training pair once"
    for indices in task._epoch_batches(0):
        longest = task.train_src_len[indices].max() + task.train_tgt_len[indices].max() + 1
        assert len(indices) == 1 or len(indices) * longest <= task.cfg.max_tokens


@pytest.mark.slow
def test_tiny_translation_model_improves_bleu(tmp_path):
    task = _task(tmp_path, eval_max_sentences=60)
    torch.manual_seed(0)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50))
    before = task.evaluate(model)
    fit_task(task, model, optimizer, steps=401, scheduler=warmup)
    after = task.evaluate(model)
    assert after["val/loss"] < before["val/loss"] - 2.0
    assert after["val/bleu"] > before["val/bleu"] + 3.0
    assert after["val/chrf"] > before["val/chrf"] + 15.0
    hypotheses = task.artifacts()["hypotheses"].read_text().splitlines()
    assert len(hypotheses) == 60 and hypotheses == task.last_hypotheses


def test_evaluate_accepts_a_data_parallel_wrapper(tmp_path):
    """The worker may hand over its DDP-wrapped model; evaluation must use the module's encode/decode."""

    class Wrapper(nn.Module):  # what DistributedDataParallel exposes: forward and .module, no encode/decode
        def __init__(self, module: nn.Module):
            super().__init__()
            self.module = module

        def forward(self, *args):
            return self.module(*args)

    task = _task(tmp_path, eval_max_sentences=4, eval_batches=1)
    torch.manual_seed(0)
    model = task.build_model()
    assert task.evaluate(Wrapper(model)) == task.evaluate(model)
