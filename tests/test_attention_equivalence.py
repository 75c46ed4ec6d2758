"""Each kind tied to exact attention where the papers say they coincide."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.attention_cases import D_MODEL, HEADS, make_attention


def _inputs(T: int = 12, B: int = 2):
    torch.manual_seed(3)
    x = torch.randn(B, T, D_MODEL)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, T - 3 :] = True
    return x, mask


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_mha_equals_torch_multihead_attention(causal):
    ours = make_attention("mha")
    ref = nn.MultiheadAttention(D_MODEL, HEADS, bias=False, batch_first=True).eval()
    p = ours.projection
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([p.q.weight, p.k.weight, p.v.weight]))
        ref.out_proj.weight.copy_(p.out.weight)
    x, mask = _inputs()
    T = x.shape[1]
    attn_mask = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None
    expected, _ = ref(x, x, x, key_padding_mask=mask, attn_mask=attn_mask, need_weights=False)
    got = ours(x, key_padding_mask_BS=mask, causal=causal)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def _copy_projection(dst, src):
    dst.load_state_dict(src.state_dict())


def test_gqa_with_groups_equal_heads_is_mha():
    mha, gqa = make_attention("mha"), make_attention("gqa", groups=HEADS)
    _copy_projection(gqa.projection, mha.projection)
    x, mask = _inputs()
    torch.testing.assert_close(gqa(x, key_padding_mask_BS=mask), mha(x, key_padding_mask_BS=mask))
    assert gqa.attention_parameters() == mha.attention_parameters()


def test_gqa_with_one_group_is_mqa():
    mqa, gqa = make_attention("mqa"), make_attention("gqa", groups=1)
    _copy_projection(gqa.projection, mqa.projection)
    x, mask = _inputs()
    torch.testing.assert_close(gqa(x, key_padding_mask_BS=mask, causal=True), mqa(x, key_padding_mask_BS=mask, causal=True))
    assert gqa.attention_parameters() == mqa.attention_parameters()


@pytest.mark.parametrize("mode", ["add", "mul"])
@pytest.mark.parametrize("heads", [1, HEADS], ids=["one-head", "four-heads"])
def test_mhe_with_zero_embeddings_is_sha(mode, heads):
    sha, mhe = make_attention("sha", heads=heads), make_attention("mhe", heads=heads, mode=mode)
    with torch.no_grad():
        for name in ("e_q", "e_k", "e_v"):
            getattr(mhe.projection, name).zero_()
    for name in ("q", "k", "v", "out"):
        getattr(mhe.projection, name).load_state_dict(getattr(sha.projection, name).state_dict())
    x, mask = _inputs()
    torch.testing.assert_close(mhe(x, key_padding_mask_BS=mask), sha(x, key_padding_mask_BS=mask))


def test_sha_with_one_head_is_mha_with_one_head():
    sha, mha = make_attention("sha", heads=1), make_attention("mha", heads=1)
    for name in ("q", "k", "v", "out"):
        getattr(mha.projection, name).load_state_dict(getattr(sha.projection, name).state_dict())
    x, mask = _inputs()
    torch.testing.assert_close(sha(x, key_padding_mask_BS=mask), mha(x, key_padding_mask_BS=mask))


def test_mhe_add_key_embedding_gets_zero_gradient():
    """Under ADD, e^K_i adds a per-row constant to the logits; softmax is shift invariant (MHE §1.7)."""
    mhe = make_attention("mhe", mode="add").train()
    x, mask = _inputs()
    mhe(x, key_padding_mask_BS=mask).pow(2).sum().backward()
    p = mhe.projection
    assert p.e_k.grad.abs().max() < 1e-6 * max(1.0, p.e_q.grad.abs().max().item())
    assert p.e_q.grad.abs().max() > 1e-4 and p.e_v.grad.abs().max() > 1e-4


def test_mhe_mul_key_embedding_is_trained():
    mhe = make_attention("mhe", mode="mul").train()
    x, _ = _inputs()
    mhe(x).pow(2).sum().backward()
    assert mhe.projection.e_k.grad.abs().max() > 1e-4


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv", "layerwise"])
def test_linformer_with_identity_projections_is_mha(sharing):
    T = 12
    shared = nn.ModuleDict()
    lin = make_attention("linformer", k=T, sharing=sharing, max_len=T, shared_state=shared)
    mha = make_attention("mha", max_len=T)
    _copy_projection(mha.projection, lin.projection)
    eye = torch.eye(T)
    with torch.no_grad():
        E, F = lin.mechanism._projections()
        for proj in {id(E): E, id(F): F}.values():
            proj.weight.copy_(eye.expand_as(proj.weight))
    # No padding here: a compressed slot is a mixture of positions, so Linformer masks padded keys by
    # zeroing them before E (tested in the contract tests), not by removing slots from the softmax.
    x, _ = _inputs(T)
    torch.testing.assert_close(lin(x), mha(x), atol=1e-5, rtol=1e-4)


def test_linformer_shorter_inputs_use_the_first_columns_of_E():
    lin = make_attention("linformer", k=8, max_len=32)
    x, _ = _inputs(T=10)
    E, F = lin.mechanism._projections()
    k_BHSE = lin.projection.qkv(x, x)[1]
    projected, _ = E(k_BHSE, None)
    torch.testing.assert_close(projected, torch.einsum("ks,bhse->bhke", E.weight[:, :10], k_BHSE))


@pytest.mark.parametrize("projection", ["mean", "max"])
def test_linformer_pooling_with_stride_one_is_mha(projection):
    """kernel = stride = n / k = 1: mean and max pooling are the identity."""
    T = 12
    lin = make_attention("linformer", k=T, max_len=T, projection=projection)
    mha = make_attention("mha", max_len=T)
    _copy_projection(mha.projection, lin.projection)
    x, mask = _inputs(T)
    torch.testing.assert_close(lin(x, key_padding_mask_BS=mask), mha(x, key_padding_mask_BS=mask), atol=1e-5, rtol=1e-4)


def test_linformer_mean_pooling_matches_manual_average():
    lin = make_attention("linformer", k=4, max_len=16, projection="mean")
    x = torch.randn(1, 16, D_MODEL)
    E, _ = lin.mechanism._projections()
    k_BHSE = lin.projection.qkv(x, x)[1]
    pooled, empty = E(k_BHSE, None)
    torch.testing.assert_close(pooled, k_BHSE.view(1, HEADS, 4, 4, -1).mean(3))
    assert not empty.any()
