"""Reversible layers' autocast replay in the two cases tests/test_reversible.py does not run: a float32
forward without autocast (the backward must not switch autocast on) and fp16 autocast (the backward must
recompute in fp16, not autocast's default bf16). Gradients equal plain autograd's in each case."""

from __future__ import annotations

import pytest
import torch

from models import LanguageModel, ModelConfig
from models.reversible import irreversible_stack, reversible_stack

VOCAB = 23


def grads_of(stack_fn, model, x, autocast_dtype):
    """Forward under autocast (when a dtype is given), backward outside it, as a training step does."""
    model.zero_grad()
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        y1, y2 = stack_fn(x)
    weights = torch.randn(y1.shape, generator=torch.Generator().manual_seed(9))
    ((y1.float() * weights).sum() + (y2.float() * weights.flip(-1)).sum()).backward()
    return x.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast_dtype", [None, torch.float16], ids=["fp32", "fp16-autocast"])
def test_recomputation_runs_in_the_forwards_precision(autocast_dtype):
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=16,
        layers=3,
        ffn=32,
        max_seq_len=32,
        dropout=0.0,
        reversible=True,
        attention={"kind": "mha", "heads": 2},
    )
    model = LanguageModel(cfg, VOCAB, causal=True).train()
    layers, params = list(model.stack.layers), list(model.parameters())
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1))
    gx_rev, g_rev = grads_of(lambda x_: reversible_stack(layers, x_, x_, params), model, x, autocast_dtype)
    gx_ref, g_ref = grads_of(lambda x_: irreversible_stack(layers, x_, x_), model, x, autocast_dtype)
    tol = 1e-5 if autocast_dtype is None else 2e-4  # fp16 rounding of the rebuilt inputs, not bf16's ~1e-2
    torch.testing.assert_close(gx_rev, gx_ref, atol=tol, rtol=tol)
    assert g_rev.keys() == g_ref.keys() and len(g_ref) > 0
    for name in g_ref:
        torch.testing.assert_close(g_rev[name], g_ref[name], atol=tol, rtol=tol, msg=name)
