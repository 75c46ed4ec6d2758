"""Tests written against surviving hand mutants of tasks/beam_search.py and models/transformer.py.

Beam search is compared with an independent, sentence-at-a-time reimplementation of fairseq's SequenceGenerator
rules (the module docstring of tasks/beam_search.py) on bigram "table" models whose next-piece logits depend on
the previous piece and the source, so every hypothesis and score has an exact expected value. The encoder-decoder
is checked for padding invariance: a source padded in a batch must give the same logits as the source alone.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from models import LanguageModel, ModelConfig, Seq2SeqTransformer
from tasks.beam_search import DecodeSpecials, beam_search, max_lengths, sequence_log_prob

SPECIALS = DecodeSpecials(bos=2, eos=3, forbidden=(0, 1, 2, 4))


class _SourceTableModel(nn.Module):
    """Next-piece logits table[source id, previous piece]: source b decodes with its own bigram table."""

    def __init__(self, logits_SVV: torch.Tensor):
        super().__init__()
        self.logits_SVV = logits_SVV

    def encode(self, src_BS, src_padding_mask_BS=None):
        return src_BS[:, :1, None].double()  # [B, 1, 1]: which table the sentence uses

    def decode(self, tgt_in_BT, memory_BSD, src_padding_mask_BS=None, tgt_padding_mask_BT=None):
        tables_NVV = self.logits_SVV[memory_BSD[:, 0, 0].long()]
        return tables_NVV[torch.arange(len(tgt_in_BT))[:, None], tgt_in_BT]  # [N, T, V]


def reference_beam(logits_VV: torch.Tensor, K: int, length_penalty: float, limit: int) -> tuple[list[int], float]:
    """fairseq's rules written out for one sentence: expand every live beam, keep the best 2K candidates, finish an
    eos candidate only if it ranks among the top K (and fewer than K are finished), continue with the best K that do
    not end; only eos at the limit (with the model's own eos log-probability); score = log p / (pieces + eos)**lp;
    the answer is the finished hypothesis with the best score. Log-probabilities are the model's log-softmax over
    the whole vocabulary, forbidden ids then removed (not renormalised), as fairseq sets lprobs[:, pad] = -inf."""
    logp_VV = torch.log_softmax(logits_VV.double(), dim=-1)
    logp_VV[:, list(SPECIALS.forbidden)] = -math.inf
    live, finished = [(0.0, [SPECIALS.bos])], []
    for t in range(limit):
        candidates = []
        for score, seq in live:
            for v in range(logp_VV.shape[1]):
                if (t + 1 < limit or v == SPECIALS.eos) and math.isfinite(float(logp_VV[seq[-1], v])):
                    candidates.append((score + float(logp_VV[seq[-1], v]), seq + [v]))
        top = sorted(candidates, key=lambda c: -c[0])[: 2 * K]
        for score, seq in top[:K]:
            if seq[-1] == SPECIALS.eos and len(finished) < K:
                finished.append((score / (t + 1) ** length_penalty, seq[1:-1]))
        if len(finished) >= K:
            break
        live = [c for c in top if c[1][-1] != SPECIALS.eos][:K]
    ranked = sorted(finished, key=lambda item: -item[0])
    assert len(ranked) < 2 or ranked[0][0] - ranked[1][0] > 1e-4, "a near tie would make the test depend on rounding"
    return ranked[0][1], ranked[0][0]


def _tables(seed: int, n: int, V: int, eos_shift: float) -> torch.Tensor:
    """Random logits; forbidden ids keep real probability mass (so renormalising after forbidding shows)."""
    gen = torch.Generator().manual_seed(seed)
    logits_SVV = 2.0 * torch.randn(n, V, V, generator=gen, dtype=torch.float64)
    logits_SVV[:, :, SPECIALS.eos] += eos_shift
    return logits_SVV


# (seed, V, beam size, length penalty, eos shift, limits): short and long hypotheses compete (length penalty),
# sentences that reach their limit (the forced eos), and eos candidates below the top K.
CASES = [
    (0, 12, 3, 1.0, 0.0, [6, 7, 5]),
    (1, 12, 3, 0.6, 0.5, [6, 4, 7]),
    (2, 10, 2, 0.0, 0.0, [5, 6, 6]),
    (3, 12, 4, 1.0, -1.5, [5, 6, 4]),
    (4, 9, 3, 2.0, 1.0, [7, 7, 6]),
    (5, 12, 3, 1.0, -3.0, [4, 5, 6]),
]


@pytest.mark.parametrize("drop_finished", [True, False], ids=["drop", "keep"])
@pytest.mark.parametrize("seed, V, K, lp, eos_shift, limits", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_beam_search_equals_the_reference_rules(seed, V, K, lp, eos_shift, limits, drop_finished):
    """Catches: length normalisation by the wrong length (t, t + 2, a product), fewer than 2K candidates, eos
    finished from outside the top K, the first finished hypothesis returned instead of the best, eos forced one
    step late, a forced eos scored 0, and log-probabilities renormalised after forbidding ids."""
    logits_SVV = _tables(seed, len(limits), V, eos_shift)
    model = _SourceTableModel(logits_SVV)
    src_BS = torch.arange(len(limits))[:, None].repeat(1, 3)
    hyps, scores = beam_search(model, src_BS, None, torch.tensor(limits), SPECIALS, beam_size=K, length_penalty=lp,
                               drop_finished=drop_finished)
    for b, limit in enumerate(limits):
        want_hyp, want_score = reference_beam(logits_SVV[b], K, lp, limit)
        assert hyps[b] == want_hyp, f"sentence {b}: {hyps[b]} != reference {want_hyp}"
        assert scores[b] == pytest.approx(want_score, abs=1e-5), f"sentence {b}"
        # the score is the model's own log p(hypothesis + eos) normalised by its length (eos included)
        log_p = sequence_log_prob(model, src_BS, None, hyps[b], b, SPECIALS)
        assert scores[b] == pytest.approx(log_p / (len(hyps[b]) + 1) ** lp, abs=1e-5), f"sentence {b}"
        assert len(hyps[b]) + 1 <= limit, "the limit counts the generated pieces including eos"


def test_a_sentence_that_never_chooses_eos_ends_exactly_at_its_limit():
    """Catches eos forced one step late (t >= limit instead of t + 1 >= limit) and a forced eos scored 0 instead
    of its log-probability: with eos almost impossible the hypothesis has limit - 1 pieces and its score is the
    sum of the model's log-probabilities, the forced eos included."""
    V, limit = 8, 5
    table = torch.zeros(V, V, dtype=torch.float64)
    table[:, SPECIALS.eos] = -20.0
    table[:, 5] = 3.0  # the argmax everywhere
    model = _SourceTableModel(table[None])
    src = torch.zeros(1, 2, dtype=torch.long)
    hyps, scores = beam_search(model, src, None, torch.tensor([limit]), SPECIALS, beam_size=2, length_penalty=0.0)
    assert hyps[0] == [5] * (limit - 1)
    logp = torch.log_softmax(table[5], dim=-1)
    assert scores[0] == pytest.approx(float((limit - 1) * logp[5] + logp[SPECIALS.eos]), abs=1e-4)


def test_max_lengths_is_a_max_len_a_times_source_plus_b_capped():
    """Catches a cap off by one (the cap is the model's position table for the target input)."""
    got = max_lengths(torch.tensor([3, 10, 40, 0]), 1.5, 2, cap=20)
    assert got.tolist() == [int(3 * 1.5 + 2), int(10 * 1.5 + 2), 20, 2]


# --- padding masks of the encoder-decoder -----------------------------------------------------------------


def _seq2seq() -> Seq2SeqTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, layers=2, ffn=64, max_seq_len=24, dropout=0.0, positional="learned",
                      attention={"kind": "mha", "heads": 4})
    model = Seq2SeqTransformer(cfg, 40).double().eval()
    with torch.no_grad():  # weights large enough that attending to a padding position changes the logits
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=module.in_features**-0.5)
    return model


def test_a_padded_source_gives_the_logits_of_the_source_alone():
    """Catches the encoder's self-attention or the decoder's cross-attention dropping the source padding mask
    (Seq2SeqTransformer.forward / encode): the padded positions would then change the short sentence's logits."""
    model = _seq2seq()
    gen = torch.Generator().manual_seed(1)
    short_1S, long_1S = torch.randint(5, 40, (1, 4), generator=gen), torch.randint(5, 40, (1, 9), generator=gen)
    tgt_BT = torch.randint(5, 40, (2, 6), generator=gen)
    src_BS = torch.cat([torch.cat([short_1S, torch.zeros(1, 5, dtype=torch.long)], 1), long_1S])
    mask_BS = torch.arange(9)[None, :] >= torch.tensor([[4], [9]])
    with torch.no_grad():
        batched = model(src_BS, tgt_BT[:, :], mask_BS)
        alone = model(short_1S, tgt_BT[:1])
    torch.testing.assert_close(batched[0], alone[0], atol=1e-10, rtol=1e-10)


def test_mem_len_zero_carries_no_state():
    """Catches the memory cut written as states[:, -mem_len:], which keeps every state when mem_len is 0: with
    mem_len 0 each segment must be scored as if it were alone, and the memory stays empty."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, layers=2, ffn=32, dropout=0.0, max_seq_len=32, positional="relative",
                      memory={"mem_len": 0}, attention={"kind": "mha", "heads": 2})
    model = LanguageModel(cfg, 30, causal=True).double().eval()
    tokens_BT = torch.randint(5, 30, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, memory = model(tokens_BT[:, :4], memory=model.empty_memory(2, torch.device("cpu")))
        second, memory = model(tokens_BT[:, 4:], memory=memory)
        alone, _ = model(tokens_BT[:, 4:], memory=model.empty_memory(2, torch.device("cpu")))
    assert [m.shape[1] for m in memory] == [0, 0]
    torch.testing.assert_close(second, alone, atol=1e-12, rtol=1e-12)
