"""Projection schemes (models/attention/projections.py): values against independent computations, written
against mutants that the other method tests let live (docs/mutation_testing.md)."""

from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from models.attention.projections import CompressedContext, unit_rows
from tests.attention_cases import D_MODEL, HEADS, make_attention

E = D_MODEL // HEADS


def _x(B: int = 2, T: int = 5) -> torch.Tensor:
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_mhe_heads_are_the_shared_seed_with_each_heads_embedding(mode):
    """MHE eq. 5 and Sec. 3.2: head i's query, key and value are psi(A, e_i) of the shared seed A = x W^T,
    A + e_i under add and A * (1 + e_i) under mul, checked head by head and position by position."""
    p = make_attention("mhe", mode=mode, init_std=0.3).double().projection
    x = _x()
    q, k, v = p.qkv(x, x)
    assert q.shape == k.shape == v.shape == (2, HEADS, 5, E)
    for got, seed, e in ((q, p.q, p.e_q), (k, p.k, p.e_k), (v, p.v, p.e_v)):
        a_BTE = x @ seed.weight.T
        for h in range(HEADS):
            expected = a_BTE + e[h] if mode == "add" else a_BTE * (1 + e[h])
            torch.testing.assert_close(got[:, h], expected, atol=1e-12, rtol=0)


def test_mhe_head_embeddings_start_at_init_std():
    """The three head-embedding tables are drawn from Normal(0, init_std): 8 x 64 draws each, so the sample
    std is within 15% of init_std (its standard error is about 3%)."""
    torch.manual_seed(0)
    p = make_attention("mhe", d_model=512, heads=8, init_std=0.02).projection
    for name in ("e_q", "e_k", "e_v"):
        e = getattr(p, name)
        assert e.shape == (8, 64)
        assert abs(e.std().item() - 0.02) < 0.003 and abs(e.mean().item()) < 0.003, name


def test_shared_qk_keys_are_each_heads_queries_at_unit_length():
    """Reformer Sec. 2.2: k_j = q_j / |q_j|, normalised per head and position (not across heads), with q and
    v the heads of x W_QK^T and x W_V^T."""
    p = make_attention("lsh").double().projection
    x = _x()
    q, k, v = p.qkv(x, x)
    q_ref = (x @ p.qk.weight.T).view(2, 5, HEADS, E)
    v_ref = (x @ p.v.weight.T).view(2, 5, HEADS, E)
    for b in range(2):
        for h in range(HEADS):
            for t in range(5):
                torch.testing.assert_close(q[b, h, t], q_ref[b, t, h], atol=1e-12, rtol=0)
                torch.testing.assert_close(k[b, h, t], q_ref[b, t, h] / q_ref[b, t, h].norm(), atol=1e-12, rtol=0)
                torch.testing.assert_close(v[b, h, t], v_ref[b, t, h], atol=1e-12, rtol=0)


def test_unit_rows_are_normalize_in_value_and_in_gradient():
    """The keys' normalisation with its closed-form backward equals `F.normalize` and autograd's gradient through
    it: values bitwise (the same three ops) in fp32 and bf16; gradients in fp64 to rounding, for ordinary rows, a
    zero row and a row whose norm is below eps (clamped: the gradient is g / eps, the norm passing none); and
    gradcheck away from the clamp."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 6, 8, generator=gen, dtype=torch.float64)
    x[0, 0, 0] = 0.0
    x[0, 1, 2] *= 1e-14  # |x| about 3e-14 < eps = 1e-12
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(unit_rows(x.to(dtype)), F.normalize(x.to(dtype), dim=-1))
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    unit_rows(ours).backward(g)
    F.normalize(theirs, dim=-1).backward(g)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(ours.grad[0, 1, 2], g[0, 1, 2] / 1e-12, rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(unit_rows, (x[1].clone().requires_grad_(),))


def test_shared_qk_refuses_cross_attention_naming_the_fix():
    p = make_attention("lsh").projection
    x = _x().float()
    with pytest.raises(ValueError) as refused:
        p.qkv(x, x.clone())
    assert str(refused.value) == (
        "model.attention.kind=lsh shares one projection for queries and keys, so it only does self-attention; "
        "cross-attention is built with cross=True, which uses mha projections"
    )


def test_sha_output_refuses_several_heads_naming_how_many():
    p = make_attention("sha").projection
    with pytest.raises(ValueError) as refused:
        p.output(torch.zeros(2, 3, 5, E))
    assert str(refused.value) == "sha attends with one head, but its mechanism returned 3 heads"


@pytest.mark.parametrize("kind, scheme", [("skv", "SharedKVProjection"), ("el_att", "ELAttProjection")])
def test_a_scheme_without_a_compressed_path_names_itself(kind, scheme):
    """Schemes whose keys are not an affine map per position do not offer `qkv_compressed`."""
    p = make_attention(kind).projection
    assert not p.projects_compressed_context
    rows, mass = torch.zeros(2, 3, D_MODEL), torch.ones(2, 3, 1)
    ctx = CompressedContext(rows, mass, rows, mass, None)
    with pytest.raises(NotImplementedError) as refused:
        p.qkv_compressed(_x().float(), ctx)
    assert str(refused.value) == f"{scheme} cannot project a compressed context"
