"""Contract tests run over every kind in the registry: shapes, padding, causality, gradients."""

from __future__ import annotations

import pytest
import torch

from models.attention import ATTENTION_KINDS
from tests.attention_cases import D_MODEL, causal_kinds, make_attention


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_shapes_and_parameter_count(kind):
    attn = make_attention(kind)
    x = torch.randn(2, 16, D_MODEL)
    assert attn(x).shape == (2, 16, D_MODEL)
    assert 0 < attn.attention_parameters() <= sum(p.numel() for p in attn.parameters())


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_appended_padding_leaves_real_positions_unchanged(kind):
    attn = make_attention(kind)
    torch.manual_seed(1)
    x = torch.randn(2, 12, D_MODEL)
    pad = torch.randn(2, 4, D_MODEL) * 5  # loud padding: any leak shows
    x_padded = torch.cat([x, pad], dim=1)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 12:] = True
    out = attn(x, key_padding_mask_BS=torch.zeros(2, 12, dtype=torch.bool))
    out_padded = attn(x_padded, key_padding_mask_BS=mask)
    torch.testing.assert_close(out_padded[:, :12], out, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_padding_within_a_batch_matches_unpadded_rows(kind):
    """Row 1 padded to row 0's length gives the same outputs as row 1 alone."""
    attn = make_attention(kind)
    torch.manual_seed(2)
    x = torch.randn(2, 16, D_MODEL)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[1, 10:] = True
    batched = attn(x, key_padding_mask_BS=mask)
    alone = attn(x[1:, :10])
    torch.testing.assert_close(batched[1:, :10], alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", causal_kinds())
def test_causal_output_has_zero_gradient_from_future_inputs(kind):
    attn = make_attention(kind)
    x = torch.randn(1, 16, D_MODEL, requires_grad=True)
    out = attn(x, causal=True)
    for i in (0, 5, 11):
        (grad,) = torch.autograd.grad(out[0, i].sum(), x, retain_graph=True)
        assert torch.count_nonzero(grad[0, i + 1 :]) == 0, f"{kind}: output {i} depends on a future input"
        assert grad[0, : i + 1].abs().sum() > 0


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_gradients_reach_every_parameter(kind):
    attn = make_attention(kind).train()
    x = torch.randn(2, 16, D_MODEL, requires_grad=True)
    attn(x).pow(2).mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in attn.named_parameters():
        assert p.grad is not None, f"{kind}: {name} got no gradient"
        assert torch.isfinite(p.grad).all()


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_cross_attention_to_a_longer_context(kind):
    from models.attention import build_attention
    from tests.attention_cases import attention_cfg

    attn = build_attention(attention_cfg(kind), 0, torch.nn.ModuleDict(), cross=True)
    x, ctx = torch.randn(2, 5, D_MODEL), torch.randn(2, 9, D_MODEL)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 7:] = True
    out = attn(x, ctx, key_padding_mask_BS=mask)
    assert out.shape == (2, 5, D_MODEL)
    torch.testing.assert_close(out[:1], attn(x[:1], ctx[:1, :7]), atol=1e-5, rtol=1e-4)


def test_gradcheck_float64_exact_and_linformer():
    for kind in ("mha", "mhe", "linformer"):
        attn = make_attention(kind).double()
        x = torch.randn(1, 6, D_MODEL, dtype=torch.float64, requires_grad=True)
        mask = torch.tensor([[False] * 5 + [True]])
        assert torch.autograd.gradcheck(lambda t: attn(t, key_padding_mask_BS=mask), (x,), eps=1e-6, atol=1e-5)
