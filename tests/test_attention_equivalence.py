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


def _linformer_reference(lin, x, mask):
    """Project K and V from every position, then compress them (the mechanism's own forward)."""
    q_BHTE, k_BHSE, v_BHSE = lin.projection.qkv(x, x)
    return lin.projection.output(lin.mechanism(q_BHTE, k_BHSE, v_BHSE, key_padding_mask_BS=mask))


def _outputs_and_grads(module, params, run, x, grad):
    for p in params:
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out = run(module, x)
    out.backward(grad)
    return out.detach(), x.grad, [p.grad.clone() for p in params]


COMPRESSED_FIRST = [(kind, projection, sharing) for projection in ("linear", "mean")
                    for sharing in ("headwise", "kv", "layerwise") for kind in ("linformer", "gqa")]


@pytest.mark.parametrize("kind,projection,sharing", COMPRESSED_FIRST)
def test_linformer_compressing_the_input_first_equals_projecting_first(kind, projection, sharing):
    """E (X W^T) = (E X) W^T: the layer's input-compressing path equals the mechanism's own, values and gradients.

    fp64 and padding that empties whole pooled slots (row 1 keeps 5 of 13 positions, stride 16 / 4 = 4).
    """
    shared = nn.ModuleDict()
    knobs = {"k": 4, "max_len": 16, "projection": projection, "sharing": sharing}
    if kind == "gqa":  # a grouped scheme with the Linformer mechanism: K/V heads are broadcast after projection
        knobs = {"groups": 2, "mechanism": {"kind": "linformer", "k": 4, "projection": projection, "sharing": sharing},
                 "max_len": 16}
    lin = make_attention(kind, shared_state=shared, **knobs).double().train()
    shared.double()
    assert lin.compresses_context
    params = list(lin.parameters()) + list(shared.parameters())
    torch.manual_seed(5)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[1, 5:] = True
    grad = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    fast = _outputs_and_grads(lin, params, lambda m, x: m(x, key_padding_mask_BS=mask), x, grad)
    reference = _outputs_and_grads(lin, params, lambda m, x: _linformer_reference(m, x, mask), x, grad)
    torch.testing.assert_close(fast[0], reference[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(fast[1], reference[1], atol=1e-12, rtol=1e-10)
    for got, expected in zip(fast[2], reference[2]):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    # The path adds no parameters: W^Q, W^O (d^2 each), W^K, W^V (d x kv_heads·d_head), and k x n per linear E
    # or F in the layer (a layerwise E belongs to the model; pooling has none).
    kv_width = D_MODEL // HEADS * (2 if kind == "gqa" else HEADS)
    extras = {"headwise": 2 * 4 * 16, "kv": 4 * 16, "layerwise": 0}[sharing] if projection == "linear" else 0
    assert lin.attention_parameters() == 2 * D_MODEL * D_MODEL + 2 * D_MODEL * kv_width + extras


@pytest.mark.parametrize("projection", ["linear", "mean"])
def test_linformer_compressed_input_carries_the_bias_of_valid_positions_only(projection):
    """With biased W^K, W^V: E (X W^T + 1 b^T) = (E X) W^T + (E 1_valid) b^T, padded positions carrying no bias."""
    lin = make_attention("linformer", k=4, max_len=16, projection=projection, sharing="headwise").double()
    torch.manual_seed(6)
    for name in ("k", "v"):
        biased = nn.Linear(D_MODEL, D_MODEL, bias=True).double()
        with torch.no_grad():
            biased.weight.copy_(getattr(lin.projection, name).weight)
            biased.bias.normal_()
        setattr(lin.projection, name, biased)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[0, 10:] = True
    mask[1, 5:] = True
    torch.testing.assert_close(lin(x, key_padding_mask_BS=mask), _linformer_reference(lin, x, mask),
                               atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("projection,sharing", [("linear", "none"), ("mean", "none"), ("max", "headwise"),
                                                ("conv", "headwise"), ("conv", "layerwise")])
def test_linformer_keeps_projecting_first_where_compression_does_not_commute(projection, sharing):
    """Max pooling is not linear, a conv mixes each head's features after W^K, and per-head E_i saves nothing."""
    assert not make_attention("linformer", k=4, max_len=16, projection=projection, sharing=sharing).compresses_context
