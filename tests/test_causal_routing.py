"""Causal means causal in value (DESIGN.md): lsh and hyper outputs at i depend on inputs at positions <= i only.

The leak probe of issue 15: random weights, a 256-token sequence, only the inputs at positions >= 200 change;
the causal outputs at positions < 200 must be bit-for-bit unchanged. The gradient tests elsewhere cannot see a
leak through routing (which keys a query sees is decided by a sort, which has no gradient).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from models import LanguageModel, ModelConfig
from models.attention import build_attention

T, CUT, D_MODEL, HEADS = 256, 200, 32, 2

# The settings: lsh bucket 16 with 2 hashes, hyper block 32 with 32 samples (min_seq_len low enough
# that three levels of the causal recursion approximate).
KNOBS = {
    "lsh": {"kind": "lsh", "heads": HEADS, "bucket_size": 16, "n_hashes": 2},
    "hyper": {"kind": "hyper", "heads": HEADS, "block_size": 32, "sample_size": 32, "min_seq_len": 32, "lsh_bits": 3},
}


def attention(kind: str, seed: int, dtype: torch.dtype, **knobs) -> nn.Module:
    cfg = ModelConfig(d_model=D_MODEL, layers=1, ffn=64, max_seq_len=T, attention={**KNOBS[kind], **knobs})
    torch.manual_seed(seed)
    return build_attention(cfg.attention, 0, nn.ModuleDict()).to(dtype)


def probe(module: nn.Module, dtype: torch.dtype, seed: int, padded: bool, training: bool) -> float:
    """Largest change of a causal output at a position < CUT when only the inputs at >= CUT change."""
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(2, T, D_MODEL, generator=gen, dtype=torch.float64).to(dtype)
    x_other = x.clone()
    x_other[:, CUT:] = torch.randn(2, T - CUT, D_MODEL, generator=gen, dtype=torch.float64).to(dtype) * 3
    mask = None
    if padded:
        mask = torch.zeros(2, T, dtype=torch.bool)
        mask[1, 230:] = True  # row 1 is 230 tokens long
    module.train(training)
    outs = []
    for inputs in (x, x_other):
        torch.manual_seed(seed)  # training draws (rotations, samples) from the global RNG: the same draws
        outs.append(module(inputs, key_padding_mask_BS=mask, causal=True))
    return (outs[0][:, :CUT] - outs[1][:, :CUT]).abs().max().item()


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", ["lsh", "hyper"])
def test_causal_outputs_before_the_cut_are_bitwise_unchanged_by_the_future(kind, dtype, padded, training):
    for seed in range(3):
        leak = probe(attention(kind, seed, dtype), dtype, seed, padded, training)
        assert leak == 0.0, f"{kind} seed {seed}: outputs before position {CUT} moved by {leak:.3g}"


@pytest.mark.parametrize("kind", ["lsh", "hyper"])
def test_paper_routing_leaks_and_says_so(kind):
    """The papers' routing stays available as an explicit knob; it does leak, and it warns that it does."""
    module = attention(kind, 0, torch.float64, causal_routing="paper")
    with pytest.warns(UserWarning, match="leaks the future"):
        leak = probe(module, torch.float64, 0, padded=False, training=False)
    assert leak > 1e-3


@pytest.mark.parametrize("reversible", [False, True], ids=["plain", "reversible"])
@pytest.mark.parametrize("kind", ["lsh", "hyper"])
def test_causal_language_model_logits_before_the_cut_ignore_later_tokens(kind, reversible):
    """The same probe through a whole decoder-only LM (two layers, plain and reversible stacks)."""
    cfg = ModelConfig(d_model=D_MODEL, layers=2, ffn=64, max_seq_len=T, dropout=0.0, reversible=reversible,
                      attention=KNOBS[kind])
    torch.manual_seed(0)
    model = LanguageModel(cfg, 50, causal=True).double().eval()
    tokens = torch.randint(0, 50, (2, T))
    other = tokens.clone()
    other[:, CUT:] = torch.randint(0, 50, (2, T - CUT))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default routing must not warn
        a, b = model(tokens), model(other)
    assert (a[:, :CUT] - b[:, :CUT]).abs().max().item() == 0.0
