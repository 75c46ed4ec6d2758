"""Merging attention parts through their log-sum-exp (models/attention/lse.py): values against the formula
written out in float64, written against mutants that the other method tests let live
(docs/mutation_testing.md). Two parts over disjoint keys merge to exact attention over their union
(tests/test_hyper.py); here the many-part merge of Reformer's rounds, its lse, and the dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from models.attention.lse import (
    merge_lse,
    merge_lse_below,
    merge_lse_many,
    merge_lse_many_reference,
    merge_lse_reference,
)

NEG_INF = float("-inf")


def _merged_by_hand(out_RME: torch.Tensor, lse_RM: torch.Tensor):
    """lse = log sum_r e^lse_r, out = sum_r e^(lse_r - lse) out_r, per row m, in Python floats; a row whose
    parts all have lse = -inf (no keys) gives zeros and -inf."""
    R, M, E = out_RME.shape
    out, lse = torch.zeros(M, E, dtype=torch.float64), torch.full((M,), NEG_INF, dtype=torch.float64)
    for m in range(M):
        finite = [r for r in range(R) if lse_RM[r, m] > NEG_INF]
        if not finite:
            continue
        top = max(float(lse_RM[r, m]) for r in finite)  # log sum e^l = top + log sum e^(l - top), no overflow
        lse[m] = top + math.log(sum(math.exp(lse_RM[r, m] - top) for r in finite))
        out[m] = sum(math.exp(lse_RM[r, m] - lse[m]) * out_RME[r, m] for r in finite)
    return out, lse


def test_merging_rounds_gives_their_log_sum_exp_and_the_weighted_outputs():
    """merge_lse_many over the rounds axis of [B, R, M] (as Reformer's rounds are merged): rows where every
    round has keys, where exactly one has (its lse is the merged lse, exactly), where none has (zeros, -inf),
    and a round with a large lse that would overflow exp without the shift."""
    gen = torch.Generator().manual_seed(11)
    B, R, M, E = 2, 3, 5, 4
    out = torch.randn(B, R, M, E, generator=gen, dtype=torch.float64)
    lse = torch.randn(B, R, M, generator=gen, dtype=torch.float64)
    lse[0, 1:, 1] = NEG_INF  # row 1 of batch 0: only round 0 has keys
    lse[1, :2, 2] = NEG_INF  # row 2 of batch 1: only round 2 has keys
    lse[0, :, 3] = NEG_INF  # row 3 of batch 0: no round has keys
    lse[1, 0, 4] = 800.0  # e^800 overflows float64
    got_out, got_lse = merge_lse_many(out, lse, dim=1)
    assert got_out.shape == (B, M, E) and got_lse.shape == (B, M)
    for b in range(B):
        ref_out, ref_lse = _merged_by_hand(out[b], lse[b])
        torch.testing.assert_close(got_out[b], ref_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(got_lse[b], ref_lse, atol=1e-12, rtol=1e-12)
    assert got_lse[0, 1] == lse[0, 0, 1] and got_lse[1, 2] == lse[1, 2, 2]
    assert torch.equal(got_out[0, 3], torch.zeros(E, dtype=torch.float64)) and got_lse[0, 3] == NEG_INF
    torch.testing.assert_close(got_out[1, 4], out[1, 0, 4], atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_outputs_merge_back_to_their_dtype_with_a_float32_lse(dtype):
    """Parts as the kernels return them for half inputs: out in the inputs' dtype, lse in float32. The merged
    out comes back in the inputs' dtype (not the float32 it is accumulated in) and the lse stays float32."""
    gen = torch.Generator().manual_seed(12)
    out = torch.randn(3, 2, 4, generator=gen).to(dtype)
    lse = torch.randn(3, 2, generator=gen)
    many_out, many_lse = merge_lse_many(out, lse, dim=0)
    two_out, two_lse = merge_lse(out[0], lse[0], out[1], lse[1])
    assert many_out.dtype == two_out.dtype == dtype and many_lse.dtype == two_lse.dtype == torch.float32
    ref_out, ref_lse = _merged_by_hand(out.double(), lse.double())
    torch.testing.assert_close(many_out.double(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(many_lse.double(), ref_lse, atol=1e-6, rtol=1e-6)


def test_many_small_half_precision_parts_are_accumulated_in_float32():
    """1000 fp16 parts (fp16 lse too) of the same output 1e-4: each weighted term out_r / 1000 is about 1e-7,
    a subnormal in fp16 (which rounds it to 1.19e-7), so summing fp16 terms would give 1.19e-4. Accumulated
    in float32 as `_acc` promises, the merge returns the parts' value to fp16 precision."""
    R = 1000
    out = torch.full((R, 1, 4), 1e-4, dtype=torch.float16)
    lse = torch.zeros(R, 1, dtype=torch.float16)
    merged, merged_lse = merge_lse_many(out, lse, dim=0)
    assert merged.dtype == torch.float16
    torch.testing.assert_close(merged.double(), out[0].double(), atol=0, rtol=2e-3)
    torch.testing.assert_close(merged_lse.double(), torch.tensor([math.log(R)], dtype=torch.float64),
                               atol=1e-2, rtol=0)


def _parts(rows: int, dtype: torch.dtype, seed: int):
    """out [rows, 3, 5, 8], lse [rows, 3, 5] with rows of no keys (lse = -inf) in each part and in both."""
    gen = torch.Generator().manual_seed(seed)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.randn(rows, 3, 5, 8, generator=gen).to(dtype)
    lse = torch.randn(rows, 3, 5, generator=gen, dtype=lse_dtype) * 3
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("stacked", [False, True], ids=["merge_lse", "merge_lse_below"])
def test_the_fused_merge_equals_the_autograd_expression_bitwise_in_outputs_and_part_gradients(dtype, stacked):
    """merge_lse (and merge_lse_below, HyperAttention's causal level) against merge_lse_reference: outputs and
    the parts' gradients bitwise; the lse gradients, from the closed form, within a few ulps of autograd's."""
    B = 2
    out_a, lse_a = _parts(2 * B if stacked else B, dtype, 0)
    out_b, lse_b = _parts(B, dtype, 1)
    a_row = B if stacked else 0
    lse_a[a_row, 0], lse_b[0, 1] = NEG_INF, NEG_INF
    lse_a[a_row + 1, 0], lse_b[1, 0] = NEG_INF, NEG_INF
    results = []
    for fused in (True, False):
        leaves = [x.clone().requires_grad_() for x in (out_a, lse_a, out_b, lse_b)]
        if fused:
            out, lse = (merge_lse_below if stacked else merge_lse)(*leaves)
        elif stacked:
            out_bot, lse_bot = merge_lse_reference(leaves[0][B:], leaves[1][B:], leaves[2], leaves[3])
            out, lse = torch.cat([leaves[0][:B], out_bot], dim=2), torch.cat([leaves[1][:B], lse_bot], dim=2)
        else:
            out, lse = merge_lse_reference(*leaves)
        weights = torch.linspace(-1, 1, out.shape[-1], dtype=torch.float64)
        ((out.double() * weights).sum() + torch.where(torch.isinf(lse), 0, lse).sum()).backward()
        results.append((out, lse, [x.grad for x in leaves]))
    (out, lse, grads), (ref, ref_lse, ref_grads) = results
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grads[2], ref_grads[2])
    for got, want in ((grads[1], ref_grads[1]), (grads[3], ref_grads[3])):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stacked", [False, True], ids=["merge_lse", "merge_lse_below"])
def test_the_fused_merge_backward_passes_gradcheck(stacked):
    out_a, lse_a = _parts(4 if stacked else 2, torch.float64, 2)
    out_b, lse_b = _parts(2, torch.float64, 3)
    merge = merge_lse_below if stacked else merge_lse
    leaves = tuple(x[..., :2, :3] if x.dim() == 4 else x[..., :2] for x in (out_a, lse_a, out_b, lse_b))
    leaves = tuple(x.contiguous().requires_grad_() for x in leaves)
    assert torch.autograd.gradcheck(lambda *xs: merge(*xs), leaves, eps=1e-6, atol=1e-6)


def _rounds(dtype: torch.dtype, seed: int):
    """out [2, 4, 5, 8] and lse [2, 4, 5] (rounds on axis 1) with rounds without keys, a row where none has
    any, and a row where a single round has."""
    gen = torch.Generator().manual_seed(seed)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.randn(2, 4, 5, 8, generator=gen).to(dtype)
    lse = torch.randn(2, 4, 5, generator=gen, dtype=lse_dtype) * 3
    lse[0, 1, 0] = lse[1, 3, 2] = NEG_INF
    lse[0, :, 3] = NEG_INF  # no round has keys
    lse[1, 1:, 4] = NEG_INF  # only round 0 has
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_the_in_place_round_merge_equals_the_autograd_expression(dtype):
    """merge_lse_many against merge_lse_many_reference (the former expression: fp32 copies of every round): the
    lse bitwise, out and the rounds' gradients within an ulp or so of the accumulation dtype (the merge sums the
    weighted rounds in order with fused multiply-adds), the lse gradients within a few ulps (closed form)."""
    out, lse = _rounds(dtype, 4)
    results = []
    for merge in (merge_lse_many, merge_lse_many_reference):
        leaves = [x.clone().requires_grad_() for x in (out, lse)]
        got, got_lse = merge(*leaves, dim=1)
        weights = torch.linspace(-1, 1, got.shape[-1], dtype=torch.float64)
        ((got.double() * weights).sum() + (torch.where(torch.isinf(got_lse), 0, got_lse) * 0.7).sum()).backward()
        results.append((got, got_lse, [x.grad for x in leaves]))
    (got, got_lse, grads), (ref, ref_lse, ref_grads) = results
    assert got.dtype == ref.dtype == dtype and torch.equal(got_lse, ref_lse)
    tol = {torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(grads[0], ref_grads[0], atol=tol, rtol=tol)
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], ref_grads[1], atol=max(tol, 1e-5), rtol=max(tol, 1e-5))
    assert torch.equal(got[0, 3], torch.zeros_like(got[0, 3]))  # no keys in any round: zeros, no gradient
    assert torch.equal(grads[1][0, :, 3], torch.zeros_like(grads[1][0, :, 3]))


def test_the_in_place_round_merge_passes_gradcheck():
    out, lse = _rounds(torch.float64, 5)  # rows 0-2: rounds without keys, each row's lse finite (none is -inf)
    leaves = (out[:, :, :3, :3].contiguous().requires_grad_(), lse[:, :, :3].contiguous().requires_grad_())
    assert torch.autograd.gradcheck(lambda o, l: merge_lse_many(o, l, dim=1), leaves, eps=1e-6, atol=1e-6)
