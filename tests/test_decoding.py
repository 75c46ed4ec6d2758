"""Incremental decoding: a key/value-cached step equals rerunning the decoder over the prefix.

Random (untrained) fp64 models, a padded source batch, both position kinds; eos gets a bias so sentences end
at different steps. The reference is the full-recompute path (`incremental=False`), itself tested against
greedy decoding and a constructed case in tests/test_translation.py. Dropping finished sentences from the batch
is checked against keeping every sentence to the end (`drop_finished=False`).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from benchmarks.system.host_reads import HostReads
from models import ModelConfig, Seq2SeqTransformer
from models.kv_cache import DecoderCache
from tasks.beam_search import DecodeSpecials, beam_search, greedy_decode, incremental_unsupported_reasons, max_lengths

SPECIALS = DecodeSpecials(bos=2, eos=3, forbidden=(0, 1, 2, 4))
VOCAB = 40
EOS_BIAS = 1.5
"""Makes eos likely enough that sentences end at different steps, before the length limit."""
CACHED_KINDS = {
    "mha": {"kind": "mha"},
    "mqa": {"kind": "mqa"},
    "gqa": {"kind": "gqa", "groups": 2},
    "mhe-mul": {"kind": "mhe", "mode": "mul", "init_std": 0.3},
    "mhe-add": {"kind": "mhe", "mode": "add", "init_std": 0.3},
    "sha": {"kind": "sha"},
    "skv": {"kind": "skv"},
    "el_att": {"kind": "el_att"},
}


def _model(attention: dict, positional: str = "learned", dtype=torch.float64) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, layers=2, ffn=64, max_seq_len=24, dropout=0.0, positional=positional, tie_output=False,
                      attention={"heads": 4, **attention})
    model = Seq2SeqTransformer(cfg, VOCAB).to(dtype).eval()
    with torch.no_grad():
        # The training init (std 0.02) leaves attention a whisper next to the token embedding, and an untrained
        # model then repeats its input piece whatever the source; at std fan_in^-1/2 every layer counts.
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=module.in_features**-0.5)
        model.head.bias[SPECIALS.eos] = EOS_BIAS
    return model


def _sources() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eight sources of lengths 3 to 9 in one padded batch (pad id 0, mask True at padding)."""
    gen = torch.Generator().manual_seed(1)
    lengths_B = torch.tensor([9, 9, 8, 7, 6, 5, 4, 3])
    src_BS = torch.randint(5, VOCAB, (8, 9), generator=gen)
    mask_BS = torch.arange(9)[None, :] >= lengths_B[:, None]
    return src_BS.masked_fill(mask_BS, 0), mask_BS, lengths_B


def _finish_at_different_steps(hypotheses: list[list[int]], limit_B: torch.Tensor) -> bool:
    """Some sentence ended by choosing eos (before its limit forced it) and not all at the same length."""
    chose_eos = [len(h) < int(n) - 1 for h, n in zip(hypotheses, limit_B)]
    return any(chose_eos) and len({len(h) for h in hypotheses}) > 1


@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
@pytest.mark.parametrize("kind", list(CACHED_KINDS))
def test_decode_step_equals_decode_of_the_prefix(kind, positional):
    model = _model(CACHED_KINDS[kind], positional)
    src_BS, mask_BS, _ = _sources()
    tgt_BT = torch.randint(5, VOCAB, (8, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        memory_BSD = model.encode(src_BS, mask_BS)
        full_BTV = model.decode(tgt_BT, memory_BSD, mask_BS)
        cache = model.start_decoding(memory_BSD, mask_BS)
        steps_BTV = torch.stack([model.decode_step(tgt_BT[:, t: t + 1], cache) for t in range(12)], dim=1)
    assert cache.length == 12
    torch.testing.assert_close(steps_BTV, full_BTV, rtol=0, atol=1e-10)


def _spy_reorders(monkeypatch) -> list[bool]:
    """Record, for every cache reorder, whether some beam continued another beam's prefix."""
    moved: list[bool] = []
    original = DecoderCache.reorder_beams

    def spy(self, origin_BK):
        moved.append(bool((origin_BK != torch.arange(origin_BK.shape[1])).any()))
        original(self, origin_BK)

    monkeypatch.setattr(DecoderCache, "reorder_beams", spy)
    return moved


@pytest.mark.parametrize("kind", ["mha", "gqa", "mqa", "mhe-mul", "el_att"])
def test_incremental_beam_search_equals_full_recompute(kind, monkeypatch):
    model = _model(CACHED_KINDS[kind])
    src_BS, mask_BS, lengths_B = _sources()
    limit_B = max_lengths(lengths_B, 1.5, 4, cap=23)
    full, full_scores = beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=3, length_penalty=1.0,
                                    incremental=False)
    moved = _spy_reorders(monkeypatch)
    cached, cached_scores = beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=3, length_penalty=1.0,
                                        incremental=True)
    assert cached == full
    assert cached_scores == pytest.approx(full_scores, rel=0, abs=1e-9)
    assert any(moved), "beam reselection must have reordered the cache"
    assert _finish_at_different_steps(full, limit_B)


@pytest.mark.parametrize("kind", ["mha", "mqa", "mhe-add"])
def test_incremental_greedy_equals_full_recompute(kind):
    model = _model(CACHED_KINDS[kind], positional="sinusoidal")
    src_BS, mask_BS, lengths_B = _sources()
    limit_B = max_lengths(lengths_B, 1.5, 4, cap=23)
    full = greedy_decode(model, src_BS, mask_BS, limit_B, SPECIALS, incremental=False)
    assert greedy_decode(model, src_BS, mask_BS, limit_B, SPECIALS, incremental=True) == full
    assert _finish_at_different_steps(full, limit_B)


def _spy_decoder_batch_sizes(monkeypatch) -> list[int]:
    """Record the rows of every decoder call, on both paths (`decode` over the prefix and `decode_step`)."""
    rows: list[int] = []
    decode, decode_step = Seq2SeqTransformer.decode, Seq2SeqTransformer.decode_step

    def spy_decode(self, tgt_in_BT, *args, **kwargs):
        rows.append(tgt_in_BT.shape[0])
        return decode(self, tgt_in_BT, *args, **kwargs)

    def spy_decode_step(self, tokens_N1, cache):
        rows.append(tokens_N1.shape[0])
        return decode_step(self, tokens_N1, cache)

    monkeypatch.setattr(Seq2SeqTransformer, "decode", spy_decode)
    monkeypatch.setattr(Seq2SeqTransformer, "decode_step", spy_decode_step)
    return rows


@pytest.mark.parametrize("incremental", [False, True], ids=["full_recompute", "kv_cache"])
@pytest.mark.parametrize("kind", ["mha", "gqa", "mhe-mul", "el_att"])
def test_dropping_finished_sentences_changes_no_hypothesis(kind, incremental, monkeypatch):
    model = _model(CACHED_KINDS[kind])
    src_BS, mask_BS, lengths_B = _sources()
    limit_B = max_lengths(lengths_B, 1.5, 4, cap=23)
    K = 3
    rows = _spy_decoder_batch_sizes(monkeypatch)
    kept, kept_scores = beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=K, length_penalty=1.0,
                                    incremental=incremental, drop_finished=False)
    assert set(rows) == {8 * K}
    rows.clear()
    dropped, dropped_scores = beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=K,
                                          length_penalty=1.0, incremental=incremental)
    assert dropped == kept
    assert dropped_scores == pytest.approx(kept_scores, rel=0, abs=1e-12)
    assert _finish_at_different_steps(kept, limit_B)
    # the batch shrinks by whole sentences, more than once, and the last steps run only what is left
    assert rows[0] == 8 * K and rows == sorted(rows, reverse=True) and all(n % K == 0 for n in rows)
    assert len(set(rows)) >= 3 and rows[-1] < 8 * K


def test_dropping_finished_sentences_keeps_the_input_order():
    """Shuffled rows of the same padded batch give the same hypotheses, shuffled alike, and each equals the
    sentence decoded on its own: the active-row map puts every output back in its input slot."""
    model = _model(CACHED_KINDS["gqa"])
    src_BS, mask_BS, lengths_B = _sources()
    limit_B = max_lengths(lengths_B, 1.5, 4, cap=23)
    search = dict(beam_size=3, length_penalty=1.0, incremental=True)
    hyps, scores = beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, **search)
    order = torch.tensor([7, 0, 5, 2, 6, 1, 4, 3])  # interleave early and late finishers
    shuffled, shuffled_scores = beam_search(model, src_BS[order], mask_BS[order], limit_B[order], SPECIALS, **search)
    assert shuffled == [hyps[i] for i in order.tolist()]
    assert shuffled_scores == pytest.approx([scores[i] for i in order.tolist()], rel=0, abs=1e-12)
    for b in (0, 4, 7):
        alone, alone_scores = beam_search(model, src_BS[b: b + 1], mask_BS[b: b + 1], limit_B[b: b + 1], SPECIALS,
                                          **search)
        assert alone == [hyps[b]]
        assert alone_scores == pytest.approx([scores[b]], rel=0, abs=1e-9)


def test_cache_select_keeps_rows_of_every_tensor():
    model = _model(CACHED_KINDS["mqa"])
    src_BS, mask_BS, _ = _sources()
    with torch.no_grad():
        memory_BSD = model.encode(src_BS, mask_BS)
        cache = model.start_decoding(memory_BSD, mask_BS)
        model.decode_step(torch.full((8, 1), SPECIALS.bos), cache)
        rows_R = torch.tensor([6, 1, 3])
        reference = model.start_decoding(memory_BSD[rows_R], mask_BS[rows_R])
        model.decode_step(torch.full((3, 1), SPECIALS.bos), reference)
        cache.select(rows_R)
    assert cache.memory_padding_mask_NS is not None and torch.equal(cache.memory_padding_mask_NS, mask_BS[rows_R])
    for layer, ref in zip(cache.layers, reference.layers):
        for name in ("cross_k_NGSE", "cross_v_NGSE", "self_k_NGTE", "self_v_NGTE"):
            torch.testing.assert_close(getattr(layer, name), getattr(ref, name), rtol=0, atol=1e-12)


def test_float32_beam_search_matches_to_rounding():
    model = _model(CACHED_KINDS["gqa"], dtype=torch.float32)
    src_BS, mask_BS, lengths_B = _sources()
    limit_B = max_lengths(lengths_B, 1.5, 4, cap=23)
    full, full_scores = beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=4, length_penalty=0.6,
                                    incremental=False)
    cached, cached_scores = beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=4, length_penalty=0.6)
    assert cached == full
    assert cached_scores == pytest.approx(full_scores, rel=0, abs=1e-4)


def test_the_cache_stores_compact_heads():
    """mqa caches one K/V head and mhe its shared seed head, not the H broadcast heads the mechanism sees."""
    src_BS, mask_BS, _ = _sources()
    for kind, stored_heads in (("mha", 4), ("gqa", 2), ("mqa", 1), ("mhe-mul", 1)):
        model = _model(CACHED_KINDS[kind])
        with torch.no_grad():
            cache = model.start_decoding(model.encode(src_BS, mask_BS), mask_BS)
            model.decode_step(torch.full((8, 1), SPECIALS.bos), cache)
        layer = cache.layers[0]
        assert layer.cross_k_NGSE.shape == (8, stored_heads, 9, 8)
        assert layer.self_k_NGTE is not None and layer.self_k_NGTE.shape == (8, stored_heads, 1, 8)


def test_approximate_mechanisms_fall_back_to_full_recompute(caplog):
    model = _model({"kind": "mhe", "mode": "mul", "mechanism": {"kind": "hyper", "block_size": 4, "sample_size": 4,
                                                                 "min_seq_len": 8, "lsh_bits": 2}})
    reasons = incremental_unsupported_reasons(model)
    assert reasons and all("HyperMechanism" in r for r in reasons)
    assert incremental_unsupported_reasons(_model(CACHED_KINDS["mha"])) == []
    src_BS, mask_BS, lengths_B = _sources()
    limit_B = max_lengths(lengths_B, 1.0, 2, cap=23)
    with caplog.at_level(logging.DEBUG, logger="tasks.beam_search"):
        auto = beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=2, length_penalty=1.0)
    assert "rerunning the decoder over the whole prefix" in caplog.text and "HyperMechanism" in caplog.text
    assert auto == beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=2, length_penalty=1.0,
                               incremental=False)
    with pytest.raises(ValueError, match="HyperMechanism is not exact attention"):
        beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=2, length_penalty=1.0, incremental=True)
    with pytest.raises(ValueError, match="cannot decode incrementally"):
        model.start_decoding(model.encode(src_BS, mask_BS), mask_BS)


@pytest.mark.parametrize("drop_finished", [True, False])
def test_a_decoding_step_reads_the_device_once(drop_finished):
    """The device computes each step's candidates and the host keeps the book from one read of the step's small
    tables: a read a step, one more for the lengths (beam search read each decision as it made it, about 14 times
    a step here); greedy decoding reads whether every sentence ended, once a step."""
    model = _model(CACHED_KINDS["mha"])
    src_BS, mask_BS, lengths_B = _sources()
    limit_B = max_lengths(lengths_B, 1.5, 4, cap=23)
    with HostReads() as reads:
        hypotheses, _ = beam_search(model, src_BS, mask_BS, limit_B, SPECIALS, beam_size=3, length_penalty=1.0,
                                    drop_finished=drop_finished)
    steps = max(len(h) for h in hypotheses) + 1  # the longest hypothesis and its eos
    assert steps <= reads.count <= int(limit_B.max()) + 1
    with HostReads() as reads:
        greedy_decode(model, src_BS, mask_BS, limit_B, SPECIALS)
    assert reads.count <= int(limit_B.max()) + 2
