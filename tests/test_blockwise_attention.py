"""The blockwise PyTorch attention (kernels.blockwise) against the dense reference: forward, gradients through
out and lse, masking and empty rows, and the memory claim (no saved tensor of M x N)."""

from __future__ import annotations

import pytest
import torch

from kernels.blockwise import block_rows, exact_attention_blockwise
from kernels.reference import exact_attention_reference

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def outputs_and_grads(fn, q, k, v, dout, dlse, **kwargs):
    """out, lse, and the gradients of sum(out * dout) + sum(lse * dlse) (finite lse entries only)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, **kwargs)
    loss = torch.zeros((), dtype=torch.float64)
    if dout is not None:
        loss = loss + (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse).double() * dlse.double()).sum()
    grads = torch.autograd.grad(loss, (q, k, v), allow_unused=True)  # lse alone does not depend on v
    return (out, lse, *(torch.zeros_like(x) if g is None else g for x, g in zip((q, k, v), grads)))


def padding(batch: int, seq_k: int, empty_row: bool) -> torch.Tensor:
    mask = torch.zeros(batch, seq_k, dtype=torch.bool)
    mask[-1, -3:] = True
    if empty_row:
        mask[0] = True  # every key of the first sequence padded: zeros and lse = -inf
    return mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(13, 13), (7, 19), (19, 7)])
@pytest.mark.parametrize("grads", ["out", "lse", "both"])
def test_blockwise_matches_reference(dtype, causal, seq_q, seq_k, grads):
    torch.manual_seed(seq_q * 31 + seq_k)
    batch, heads, dim = 2, 3, 8
    q = torch.randn(batch, heads, seq_q, dim, dtype=dtype)
    k, v = (torch.randn(batch, heads, seq_k, dim, dtype=dtype) for _ in range(2))
    mask = padding(batch, seq_k, empty_row=not causal)
    dout = torch.randn(batch, heads, seq_q, dim, dtype=dtype) if grads != "lse" else None
    dlse = torch.randn(batch, heads, seq_q, dtype=torch.float64) if grads != "out" else None
    # 3 query rows per block: several blocks, the last one shorter.
    blocks = {"block_elements": batch * heads * seq_k * 3}
    assert block_rows(batch, heads, seq_k, blocks["block_elements"]) == 3
    got = outputs_and_grads(exact_attention_blockwise, q, k, v, dout, dlse, causal=causal, key_padding_mask=mask,
                            **blocks)
    expected = outputs_and_grads(exact_attention_reference, q, k, v, dout, dlse, causal=causal,
                                 key_padding_mask=mask)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(torch.isinf(a), torch.isinf(b)), f"{name}: infinite entries differ"
        finite = torch.isfinite(b)
        err = (a[finite].double() - b[finite].double()).abs().max().item()
        assert err <= TOLERANCE[dtype] * max(1.0, b[finite].abs().max().item()), f"{name}: error {err:.3g}"
    if not causal:
        assert torch.isinf(got[1][0]).all() and not got[0][0].any()  # the fully padded sequence


def test_blockwise_gradcheck_through_out_and_lse():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64, requires_grad=True) for n in (5, 6, 6))
    mask = torch.tensor([[False, False, False, False, True, False]])

    def both(q, k, v):
        out, lse = exact_attention_blockwise(q, k, v, causal=True, key_padding_mask=mask, block_elements=2 * 6 * 2)
        return out, lse

    assert torch.autograd.gradcheck(both, (q, k, v))


def saved_tensor_sizes(fn, *args, **kwargs) -> list[int]:
    """numel of every tensor autograd saves while fn runs."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return sizes


def test_blockwise_saves_no_m_by_n_tensor():
    batch, heads, n, dim = 1, 2, 256, 16
    q, k, v = (torch.randn(batch, heads, n, dim, requires_grad=True) for _ in range(3))
    scores = batch * heads * n * n
    dense = saved_tensor_sizes(exact_attention_reference, q, k, v, causal=True)
    assert max(dense) >= scores  # the check can fail: the reference keeps its probabilities
    blockwise = saved_tensor_sizes(exact_attention_blockwise, q, k, v, causal=True, block_elements=scores // 8)
    assert max(blockwise) <= batch * heads * n * dim  # q, k, v and lse only
