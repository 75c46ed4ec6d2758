"""Every kind trains: a tiny model's loss falls on a learnable toy problem.

Masked LM: predict a token from its neighbours in sequences made by a fixed permutation walk
(x_{t+1} = perm[x_t]); causal LM on the same walk; translation: copy the reversed source.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import LanguageModel, ModelConfig, Seq2SeqTransformer
from models.attention import ATTENTION_KINDS
from tests.attention_cases import causal_kinds, tiny_knobs
from tests.training import fit, next_token_loss

VOCAB, T, STEPS = 24, 16, 40


def _walks(n: int, generator: torch.Generator) -> torch.Tensor:
    perm = torch.randperm(VOCAB - 1, generator=torch.Generator().manual_seed(0)) + 1  # token 0 = [MASK]
    x = torch.empty(n, T, dtype=torch.long)
    x[:, 0] = torch.randint(1, VOCAB, (n,), generator=generator)
    for t in range(1, T):
        x[:, t] = perm[x[:, t - 1] - 1]
    return x


def _cfg(kind: str) -> ModelConfig:
    return ModelConfig(d_model=32, layers=2, ffn=64, dropout=0.0, max_seq_len=T,
                       attention={"kind": kind, "heads": 4, **tiny_knobs(kind)})


def _train(model, batch_fn, steps: int = STEPS) -> tuple[float, float]:
    torch.manual_seed(0)
    losses = fit(batch_fn, torch.optim.AdamW(model.parameters(), lr=3e-3), steps)
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_masked_lm_loss_falls(kind):
    torch.manual_seed(0)
    model = LanguageModel(_cfg(kind), VOCAB, causal=False)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = _walks(16, g)
        masked = torch.rand(x.shape, generator=g) < 0.25
        logits = model(x.masked_fill(masked, 0))
        return F.cross_entropy(logits[masked], x[masked])

    first, last = _train(model, batch)
    assert last < 0.8 * first, f"{kind}: masked-LM loss {first:.3f} -> {last:.3f}"


@pytest.mark.parametrize("kind", causal_kinds())
def test_causal_lm_loss_falls(kind):
    torch.manual_seed(0)
    model = LanguageModel(_cfg(kind), VOCAB, causal=True)

    def batch(step):
        return next_token_loss(model, _walks(16, torch.Generator().manual_seed(step)))

    first, last = _train(model, batch)
    assert last < 0.8 * first, f"{kind}: causal-LM loss {first:.3f} -> {last:.3f}"


@pytest.mark.parametrize("kind", ["mha", "mhe"])
def test_translation_loss_falls(kind):
    torch.manual_seed(0)
    model = Seq2SeqTransformer(_cfg(kind), VOCAB)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        src = torch.randint(2, VOCAB, (16, 8), generator=g)
        tgt = torch.cat([torch.ones(16, 1, dtype=torch.long), src.flip(1)], dim=1)  # 1 = BOS
        logits = model(src, tgt[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tgt[:, 1:].reshape(-1))

    first, last = _train(model, batch, steps=60)
    assert last < 0.8 * first, f"{kind}: translation loss {first:.3f} -> {last:.3f}"
