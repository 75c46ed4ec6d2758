"""The merges by lse on their Triton kernels (kernels/k_merge_rounds.py, under the interpreter at tiny shapes):
LSH's rounds give `merge_lse_many_reference`'s out, lse and gradients (autograd through the weights), rows that no
part has keys for included, and the LSH layer on them equals the layer on the PyTorch merge; HyperAttention's
causal level (`merge_below`) gives the joined reference's, and the causal layer on it equals the layer on PyTorch's.

``KERNEL_TESTS_DEVICE=cuda`` runs them on the kernels compiled for a GPU, as tests/test_kernels.py does.
"""

from __future__ import annotations

# First: on the CPU it sets TRITON_INTERPRET=1 before the @triton.jit modules are imported.
from tests.kernel_device import DEVICE, needs_triton, one_gpu_launch_config  # noqa: F401 (an autouse fixture)

import pytest
import torch

from kernels.merge_rounds import merge_below, merge_rounds
from models.attention.lse import merge_lse_many_reference, merge_lse_reference

pytestmark = needs_triton

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def parts(shape_R: tuple[int, ...], dim: int, E: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """out [.., E] and lse with rows every part of which is -inf (no keys: weights 0, lse -inf, out 0), rows one
    part of which is -inf, and spread lse values, so the weights are far from uniform."""
    torch.manual_seed(0)
    lse = torch.randn(shape_R) * 4
    flat = lse.movedim(dim, -1)  # [.., R] view: the parts of each row last
    flat[0, 0, :] = float("-inf")
    flat[..., 1, 0] = float("-inf")
    out = torch.randn(*shape_R, E).to(dtype)
    return out.to(DEVICE), lse.to(DEVICE)


def merged_and_grads(merge, out, lse, dim, use_lse: bool):
    out = out.detach().clone().requires_grad_(True)
    lse = lse.detach().clone().requires_grad_(True)
    m_out, m_lse = merge(out, lse, dim)
    torch.manual_seed(1)
    g_out = torch.randn(m_out.shape).to(device=m_out.device, dtype=m_out.dtype)
    g_lse = torch.randn(m_lse.shape, device=m_lse.device)
    loss = (m_out.float() * g_out.float()).sum()
    if use_lse:
        loss = loss + (torch.where(torch.isinf(m_lse), 0.0, m_lse) * g_lse).sum()
    loss.backward()
    return m_out, m_lse, out.grad, lse.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape_R", "dim", "use_lse"), [((2, 2, 3, 37), 2, True),  # LSH's [B, H, R, T]
                                                         ((3, 2, 21), 1, False)])   # R at 1, lse unused
def test_the_kernels_give_the_references_values_and_gradients(shape_R, dim, use_lse, dtype):
    E = 24  # not a power of two: the feature tile is masked
    out, lse = parts(shape_R, dim, E, dtype)
    got = merged_and_grads(merge_rounds, out, lse, dim, use_lse)
    expected = merged_and_grads(merge_lse_many_reference, out, lse, dim, use_lse)
    tol = TOLERANCE[dtype]
    for name, g, e in zip(("out", "lse", "d out", "d lse"), got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        finite = torch.isfinite(e)
        assert torch.equal(finite, torch.isfinite(g)), name  # -inf exactly where the reference has it
        err = (g[finite].float() - e[finite].float()).abs().max().item()
        assert err <= tol * max(1.0, e[finite].float().abs().max().item()), (name, err)
    no_keys = torch.isinf(expected[1]) & (expected[1] < 0)
    assert no_keys.any() and (got[0][no_keys] == 0).all()


def test_the_lsh_layer_on_the_kernels_equals_the_layer_on_the_pytorch_merge(monkeypatch):
    """The whole LSH mechanism with the kernels (ATTN_BACKEND=triton: the chunked kernel, the hash kernel and this
    merge) against the same with the merge in PyTorch: outputs and input gradients, causal."""
    from kernels import dispatch
    from models.attention import lsh

    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    mech = lsh.LSHMechanism(lsh.LSHMechanismConfig(bucket_size=4, n_hashes=3), head_dim=16, layer_index=0).eval()
    torch.manual_seed(0)
    shape = (1, 1, 11, 16)  # small: the chunked kernels run under the interpreter, program by program
    q = torch.randn(shape, device=DEVICE, requires_grad=True)
    k = torch.nn.functional.normalize(q.detach(), dim=-1).requires_grad_(True)
    v = torch.randn(shape, device=DEVICE, requires_grad=True)
    g = torch.randn(shape, device=DEVICE)
    assert lsh.round_merge(dispatch.fused_kernels(q)) is merge_rounds  # the layer's own choice on the kernels
    results = []
    for merge in (merge_rounds, merge_lse_many_reference):
        monkeypatch.setattr(lsh, "round_merge", lambda fused, merge=merge: merge)
        out = mech(q, k, v, causal=True)
        grads = torch.autograd.grad((out * g).sum(), (q, k, v))
        results.append((out, *grads))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def below_reference(out_a, lse_a, out_b, lse_b):
    """`merge_lse_below` as one autograd expression: the first halves, then the second merged with out_b."""
    B = out_b.shape[0]
    merged, lse = merge_lse_reference(out_a[B:], lse_a[B:], out_b, lse_b)
    return torch.cat([out_a[:B], merged], dim=-2), torch.cat([lse_a[:B], lse], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_lse", [True, False])
def test_the_causal_level_merge_gives_the_references_values_and_gradients(dtype, use_lse):
    B, H, h, E = 2, 2, 19, 24
    torch.manual_seed(0)
    lse_a, lse_b = torch.randn(2 * B, H, h) * 4, torch.randn(B, H, h) * 4
    lse_a[B:, 0, :3] = float("-inf")  # second halves without keys: the off-diagonal part alone
    lse_b[:, 0, 2:5] = float("-inf")  # rows 2, 3, 4 of head 0: no off-diagonal keys; rows 0-2 have neither part
    lse_a[:B, 1, 0] = float("-inf")  # a first-half row without keys passes through as it is
    out_a, out_b = torch.randn(2 * B, H, h, E).to(dtype), torch.randn(B, H, h, E).to(dtype)
    args = [x.to(DEVICE) for x in (out_a, lse_a, out_b, lse_b)]

    def run(merge):
        leaves = [x.detach().clone().requires_grad_(True) for x in args]
        out, lse = merge(*leaves)
        torch.manual_seed(1)
        g = torch.randn(out.shape).to(device=out.device, dtype=out.dtype)
        loss = (out.float() * g.float()).sum()
        if use_lse:
            loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * torch.randn(lse.shape, device=lse.device)).sum()
        loss.backward()
        return out, lse, *(leaf.grad for leaf in leaves)

    tol = TOLERANCE[dtype]
    names = ("out", "lse", "d out_a", "d lse_a", "d out_b", "d lse_b")
    for name, got, expected in zip(names, run(merge_below), run(below_reference), strict=True):
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        finite = torch.isfinite(expected)
        assert torch.equal(finite, torch.isfinite(got)), name
        err = (got[finite].float() - expected[finite].float()).abs().max().item()
        assert err <= tol * max(1.0, expected[finite].float().abs().max().item()), (name, err)
