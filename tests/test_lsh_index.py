"""LSH attention through the chunked kernels' token index (`token_of_row`) equals the former sorted-copy layout,
forward and backward, on the Triton kernels under the interpreter (tiny shapes); and the indexed kernels equal
the indexed reference on random layouts with filler rows."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first launch imports the @triton.jit modules

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import chunked_attention  # noqa: E402
from kernels.chunked_attention import chunked_flash_attention  # noqa: E402
from kernels.parity import parity_error  # noqa: E402
from kernels.reference import chunked_attention_reference  # noqa: E402
from models.attention.lse import merge_lse_many  # noqa: E402
from models.attention.lsh import LSHMechanism, LSHMechanismConfig  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
E = 16  # the kernels' smallest head dim


def layout_path(mech: LSHMechanism, q, k, v, mask, causal: bool):
    """The former LSHMechanism.forward: q, k, v, positions and padding scattered into sorted [B, H * R, L] copies,
    the chunked kernel on them, out and lse gathered back. The oracle of the index path."""
    B, H, T, _ = q.shape
    R = mech.n_hashes
    past_only = causal and mech.causal_routing == "past_only"
    bucket = mech.buckets(k.detach(), mask)
    pos_T = torch.arange(T)
    order = torch.argsort(bucket * T + pos_T, dim=-1)
    if past_only:
        slot, L = mech.bucket_aligned_slots(bucket, order)
        positions = pos_T - bucket * T
    else:
        slot, L, positions = torch.argsort(order, dim=-1), T, pos_T.expand(B, H, R, T)

    def layout(x, fill):
        tail = x.shape[4:]
        idx = slot.view(B, H, R, T, *(1,) * len(tail)).expand(B, H, R, T, *tail)
        out = torch.full((B, H, R, L, *tail), fill, dtype=x.dtype)
        return out.scatter(3, idx, x).reshape(B, H * R, L, *tail)

    rounds = lambda x: x[:, :, None].expand(B, H, R, *x.shape[2:])  # noqa: E731
    pad = torch.zeros(B, H, T, dtype=torch.bool) if mask is None else mask[:, None, :].expand(B, H, T)
    out, lse = chunked_attention(
        layout(rounds(q), 0.0), layout(rounds(k), 0.0), layout(rounds(v), 0.0), mech.bucket_size, lookback=1,
        positions=layout(positions, 0), causal=causal, self_mask=mech.self_mask,
        key_padding_mask=layout(rounds(pad), True), wrap=False, scale=mech.scale)
    out_BHRTE = torch.gather(out.view(B, H, R, L, E), 3, slot[..., None].expand(B, H, R, T, E))
    lse_BHRT = torch.gather(lse.view(B, H, R, L), 3, slot)
    return merge_lse_many(out_BHRTE, lse_BHRT, dim=2)[0]


def outputs_and_grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    return out, grads


# About 10 s of CPU each under the interpreter (two kernel paths, forward and backward): the slow tier; the fast
# tier checks the indexed kernels against the indexed reference at a smaller size below.
@pytest.mark.slow
@pytest.mark.parametrize("causal, routing, self_mask, padded", [
    (True, "past_only", True, True), (True, "past_only", True, False), (False, "past_only", True, True),
    (True, "paper", False, True),
], ids=["causal-past_only", "causal-past_only-unpadded", "bidirectional", "causal-paper-no-self-mask"])
def test_index_path_equals_the_layout_path(causal, routing, self_mask, padded, monkeypatch):
    """Padding in one row (a per-row bucket count), two rounds, buckets of 4: chunks of real tokens, filler rows
    under past-only routing (without padding too: then nothing but the filler rule masks them), fully masked
    queries. fp32 on both sides, so only summation order may differ."""
    monkeypatch.setenv("ATTN_BACKEND", "triton")
    B, H, T = 2, 1, 20
    mech = LSHMechanism(LSHMechanismConfig(bucket_size=4, n_hashes=2, causal_routing=routing), E, 0).eval()
    mech.self_mask = self_mask
    gen = torch.Generator().manual_seed(0)
    q, v = torch.randn(B, H, T, E, generator=gen), torch.randn(B, H, T, E, generator=gen)
    k = q / q.norm(dim=-1, keepdim=True)  # shared QK, keys unit-normalised, as the lsh projection makes them
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 13:] = True
    mask = mask if padded else None
    with pytest.warns(UserWarning) if routing == "paper" else _no_warning():
        out, grads = outputs_and_grads(lambda q, k, v: mech(q, k, v, key_padding_mask_BS=mask, causal=causal), q, k, v)
    out_ref, grads_ref = outputs_and_grads(lambda q, k, v: layout_path(mech, q, k, v, mask, causal), q, k, v)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def random_layout(B, H, R, T, L, gen):
    """Each round of each (batch, head): the T tokens in random rows of L, the other rows fillers (-1)."""
    tok = torch.full((B, H, R, L), -1, dtype=torch.int32)
    for index in range(B * H * R):
        rows = torch.randperm(L, generator=gen)[:T]
        tok.view(-1, L)[index, rows] = torch.arange(T, dtype=torch.int32)
    return tok


@pytest.mark.parametrize("dtype, B, T, L, padded", [
    (torch.float32, 1, 7, 12, False),
    pytest.param(torch.float32, 2, 13, 22, True, marks=pytest.mark.slow),
    pytest.param(torch.bfloat16, 2, 13, 22, True, marks=pytest.mark.slow),
], ids=["fp32-tiny-unpadded", "fp32", "bf16"])
def test_indexed_kernels_match_the_indexed_reference(dtype, B, T, L, padded):
    """Random layouts with fillers, per-round distinct positions, causal, self-mask and padding (without it only
    the filler rule masks the filler rows); a chunk of 4 rows, so a 16-row block covers a chunk and rows past
    it."""
    gen = torch.Generator().manual_seed(1)
    H, R = 1, 2
    q, k, v = (torch.randn(B, H, T, E, generator=gen).to(dtype) for _ in range(3))
    pos = torch.stack([torch.randperm(T, generator=gen) * 3 - 7 for _ in range(B * H * R)]).view(B, H, R, T)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :3] = True
    kwargs = dict(chunk=4, lookback=1, positions=pos, causal=True, self_mask=True,
                  key_padding_mask=mask if padded else None,
                  wrap=False, token_of_row=random_layout(B, H, R, T, L, gen))
    out, grads = outputs_and_grads(lambda q, k, v: _joint(chunked_flash_attention(q, k, v, **kwargs)), q, k, v)
    out_ref, grads_ref = outputs_and_grads(lambda q, k, v: _joint(chunked_attention_reference(q, k, v, **kwargs)),
                                           q, k, v)
    for name, x, x_ref in zip(("out and lse", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref)):
        err, bound, problem = parity_error(x, x_ref, dtype)  # the kernels' stated tolerance per dtype
        assert problem is None and err <= bound, f"{name}: {problem or f'max abs error {err:.3g} > {bound:.3g}'}"


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "compiled_branch"])
def test_indexed_gradients_come_back_in_the_inputs_layout(monkeypatch, compiling: bool):
    """The indexed backward sums the rounds' dq, dk, dv into buffers laid out as q: a layer's heads are [B, H, T, E]
    views of its [B, T, H, E] projections, whose backward then reads the gradients without a copy (contiguous
    [B, H, T, E] sums took one each). Values are the other cases'. `compiled_branch`: the sum that torch.compile
    takes (a copy into the strided buffer, where eager sums into it with out=; kernels/chunked_attention.py), run
    eagerly with the interpreter's kernels: the same layout and the same gradients to the bit."""
    def gradients():
        gen = torch.Generator().manual_seed(2)
        B, H, R, T, L = 1, 2, 2, 7, 12
        bases = [torch.randn(B, T, H, E, generator=gen, requires_grad=True) for _ in range(3)]
        q, k, v = (x.transpose(1, 2) for x in bases)
        layouts = []
        for x in (q, k, v):
            x.register_hook(lambda g: layouts.append(g.stride()))
        pos = torch.stack([torch.randperm(T, generator=gen) for _ in range(B * H * R)]).view(B, H, R, T)
        out, _ = chunked_flash_attention(q, k, v, chunk=4, positions=pos, causal=True, wrap=False,
                                         token_of_row=random_layout(B, H, R, T, L, gen))
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        assert layouts == [q.stride()] * 3, (layouts, q.stride())
        return [x.grad for x in bases]

    want = gradients()
    if compiling:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        for name, got, expected in zip("qkv", gradients(), want):
            assert torch.equal(got, expected), name


def _joint(out_lse):
    """out [B, H, R, T, E] and lse [B, H, R, T] as one tensor, so one backward takes gradients through both."""
    out, lse = out_lse
    assert out.shape[:4] == lse.shape and lse.dtype == torch.float32
    return torch.cat([out.float(), torch.where(torch.isinf(lse), 0.0, lse)[..., None]], dim=-1)
