"""Masked and causal LM: masking statistics, lossless packing, exact evaluation, sharding, resume, learning."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import TypeAdapter

from models import ModelConfig
from tasks import WorkerContext, build_task
from tasks.config import TaskConfig
from tasks.lm import IGNORE, apply_bert_masking, num_blocks, pack_blocks
from tasks.tokenizer import MASK_ID, PAD_ID
from tests.training import fit_task

TASK = TypeAdapter(TaskConfig)
MODEL = ModelConfig(d_model=32, layers=1, ffn=64, max_seq_len=32, dropout=0.0, positional="sinusoidal",
                    attention={"kind": "mha", "heads": 2})


def _task(kind: str, cache_dir, *, rank: int = 0, world_size: int = 1, **overrides):
    cfg = TASK.validate_python({"kind": kind, "seq_len": 32, "batch_size": 8, "vocab_size": 96,
                                "builtin": {"train_sentences": 600, "eval_sentences": 40, "lexicon_size": 12},
                                **overrides})
    return build_task(cfg, MODEL, WorkerContext(rank=rank, world_size=world_size, seed=3, cache_dir=cache_dir))


def test_bert_masking_statistics():
    rng = np.random.default_rng(0)
    vocab = 500
    tokens = rng.integers(MASK_ID + 1, vocab, size=(200, 400))
    lengths = np.full(200, 400)
    lengths[:50] = 100  # padding is never selected
    inputs, targets = apply_bert_masking(tokens, lengths, 0.15, vocab, rng)
    real = np.arange(400)[None, :] < lengths[:, None]
    selected = targets != IGNORE
    assert not (selected & ~real).any()
    assert abs(selected.sum() / real.sum() - 0.15) < 0.005
    assert (targets[selected] == tokens[selected]).all()
    assert (inputs[~selected] == tokens[~selected]).all(), "unselected tokens are untouched"
    masked = (inputs == MASK_ID)[selected].mean()
    kept = (inputs == tokens)[selected].mean()  # includes random draws that hit the same token (~1/vocab)
    randomised = 1 - masked - kept
    assert abs(masked - 0.8) < 0.015 and abs(kept - 0.1) < 0.012 and abs(randomised - 0.1) < 0.012
    assert inputs[selected & (inputs != MASK_ID)].min() > MASK_ID, "random replacements avoid special ids"


@pytest.mark.parametrize("overlap", [0, 1], ids=["mlm-blocks", "clm-blocks"])
def test_block_packing_loses_no_token(overlap):
    stream = np.random.default_rng(1).integers(0, 1000, size=1001)
    seq_len = 64
    n = num_blocks(len(stream), seq_len, overlap)
    blocks, lengths = pack_blocks(stream, np.arange(n), seq_len, overlap)
    assert blocks.shape == (n, seq_len + overlap) and (lengths[:-1] == seq_len + overlap).all()
    if overlap == 0:  # masked LM: the blocks tile the stream
        assert (np.concatenate([b[:k] for b, k in zip(blocks, lengths)]) == stream).all()
    else:  # causal LM: every token after the first is a target exactly once
        targets = np.concatenate([b[1:k] for b, k in zip(blocks, lengths)])
        assert (targets == stream[1:]).all()


def test_causal_evaluation_is_exactly_token_weighted(tmp_path):
    """Perplexity must not depend on how the split is batched (sum of losses / number of targets)."""
    small = _task("clm", tmp_path, batch_size=3)
    large = _task("clm", tmp_path, batch_size=16)
    torch.manual_seed(0)
    model = small.build_model()
    a, b = small.evaluate(model)["val/loss"], large.evaluate(model)["val/loss"]
    assert a == pytest.approx(b, rel=1e-6)
    assert len(small.eval_stream) - 1 == sum(
        batch.n_tokens for batch in [small._make_batch(*pack_blocks(
            small.eval_stream, np.arange(num_blocks(len(small.eval_stream), 32, 1)), 32, 1), None)])


def test_masked_evaluation_is_deterministic(tmp_path):
    task = _task("mlm", tmp_path)
    torch.manual_seed(0)
    model = task.build_model()
    assert task.evaluate(model) == task.evaluate(model)
    assert model.training, "evaluate restores training mode"


def test_masked_evaluation_does_not_depend_on_the_batch_size(tmp_path):
    """Two trials that differ in task.batch_size (methods whose memory allows different batches) must be scored
    on the same masked tokens: the evaluation's masks were drawn batch after batch from one generator, so which
    tokens were masked changed with the batching, and val/loss with it."""
    torch.manual_seed(0)
    model = _task("mlm", tmp_path).build_model()
    scores = [_task("mlm", tmp_path, batch_size=size).evaluate(model)["val/loss"] for size in (3, 8)]
    assert scores[0] == pytest.approx(scores[1], rel=1e-6), scores
    # Per-block masks still cover the 15% rate over the split (BERT's selection; the statistics test above).
    rows = [np.random.default_rng([7, block]) for block in range(400)]
    tokens, lengths = np.full((400, 50), MASK_ID + 1), np.full(400, 50)
    _, targets = apply_bert_masking(tokens, lengths, 0.15, 96, rows)
    assert abs((targets != IGNORE).mean() - 0.15) < 0.01


@pytest.mark.parametrize("kind", ["mlm", "clm"])
def test_ranks_cover_each_block_once(tmp_path, kind):
    """One epoch of two ranks together holds every training block exactly once."""
    ranks = [_task(kind, tmp_path, rank=r, world_size=2) for r in range(2)]
    seen = []
    for task in ranks:
        for batch, position in task.train_batches():
            if position["epoch"] > 0:
                break
            tokens = batch.tensors["tokens"]
            if kind == "mlm":  # undo the masking to recover the block: targets hold the original tokens
                tokens = torch.where(batch.tensors["targets"] != IGNORE, batch.tensors["targets"], tokens)
            seen.extend(tuple(row) for row in tokens.tolist())
            if position["step"] == len(task._epoch_batches(0)[task.ctx.rank::2]):
                break
    overlap = 1 if kind == "clm" else 0
    n = ranks[0].n_train_blocks
    blocks, _ = pack_blocks(ranks[0].train_stream, np.arange(n), 32, overlap)
    expected = [tuple(row[:32]) for row in blocks.tolist()]
    assert sorted(seen) == sorted(expected)


def test_resume_from_position_continues_the_exact_stream(tmp_path):
    task = _task("mlm", tmp_path)
    n_epoch = len(task._epoch_batches(0))
    stream = task.train_batches()
    first = [next(stream) for _ in range(n_epoch + 3)]  # crosses an epoch boundary
    cut = n_epoch - 2
    resumed = task.train_batches(first[cut - 1][1])
    for (expected, _), (batch, _) in zip(first[cut:], [next(resumed) for _ in range(5)]):
        for key in expected.tensors:
            assert torch.equal(expected.tensors[key], batch.tensors[key]), key
    assert first[n_epoch][1] == {"epoch": 1, "step": 1}


def _unigram_entropy(task) -> float:
    """Cross entropy of the evaluation stream under training-split token frequencies (add-one smoothed)."""
    counts = np.bincount(task.train_stream, minlength=task.vocab_size) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[task.eval_stream[1:]].mean())


@pytest.mark.parametrize("kind", ["mlm", "clm"])
def test_tiny_language_model_learns(tmp_path, kind):
    task = _task(kind, tmp_path)
    torch.manual_seed(0)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = task.evaluate(model)["val/loss"]
    fit_task(task, model, optimizer, steps=81)
    after = task.evaluate(model)
    assert after["val/loss"] < before - 0.5
    if kind == "clm":  # beyond word frequencies: the grammar's order and selection are being learned
        assert after["val/loss"] < _unigram_entropy(task) - 0.5
    assert after["val/ppl"] == pytest.approx(np.exp(after["val/loss"]))
    assert task.artifacts()["tokenizer"].exists()


def test_masked_loss_projects_only_the_masked_positions(tmp_path):
    """Scoring the masked positions' states alone gives the loss and gradients of full [B, T, V] logits."""
    task = _task("mlm", tmp_path)
    tokens, lengths = pack_blocks(task.train_stream, np.arange(4), 32, 0)
    tokens[1, 20:], lengths[1] = PAD_ID, 20  # a padded row: its padding is neither attended to nor scored
    batch = task._make_batch(tokens, lengths, np.random.default_rng(0))
    t = batch.tensors
    scored = t["targets"] != IGNORE
    assert "padding_mask" in t and 0 < scored.sum() < scored.numel() // 4
    torch.manual_seed(0)
    model = task.build_model()

    def loss_and_grads(loss_fn):
        model.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    full_logits = lambda: F.cross_entropy(model(t["tokens"], t["padding_mask"]).flatten(0, 1), t["targets"].flatten(),
                                          ignore_index=IGNORE, reduction="sum") / batch.n_tokens
    expected, expected_grads = loss_and_grads(full_logits)
    got, got_grads = loss_and_grads(lambda: task.loss(model, batch))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
    assert batch.n_tokens == int(scored.sum())
    logits_NV = model(t["tokens"], t["padding_mask"], t["scored"])
    torch.testing.assert_close(logits_NV, model(t["tokens"], t["padding_mask"])[scored])


def test_a_masked_lm_step_reads_nothing_back_from_the_device(tmp_path):
    """The scored positions come with the batch from the host (tasks/base.py scored_positions): a step selects
    them without reading a count back from the device, a wait in every micro-batch on a GPU and a graph break
    under torch.compile. Fake tensors have no values, so any such read raises here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    task = _task("mlm", tmp_path)
    batch, _ = next(task.train_batches())
    torch.manual_seed(0)
    with FakeTensorMode() as mode:
        model = task.build_model()
        fake = type(batch)({k: mode.from_tensor(v) for k, v in batch.tensors.items()}, batch.n_tokens)
        task.loss(model, fake).backward()
    assert all(p.grad is not None for p in model.parameters())
