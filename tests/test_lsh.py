"""Reformer LSH attention: agreement with exact shared-QK attention, padding, determinism, causality, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import ValidationError

from models import ModelConfig
from models.attention import build_attention
from models.attention.lse import SELF_LOGIT
from models.attention.lsh import (
    LSHMechanism,
    LSHMechanismConfig,
    bounded_layout,
    default_n_buckets,
    default_n_buckets_of,
    layout_length_bound,
)
from models.attention.projections import MultiHeadProjection, SharedQKProjection

B, H, E = 2, 2, 8


def lsh(layer_index: int = 0, **knobs) -> LSHMechanism:
    return LSHMechanism(LSHMechanismConfig(**knobs), E, layer_index).eval()


def shared_qk_inputs(T: int, seed: int = 0, scale: float = 1.0, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    qk = (torch.randn(B, H, T, E, generator=gen) * scale).requires_grad_(requires_grad)
    v = torch.randn(B, H, T, E, generator=gen).requires_grad_(requires_grad)
    return qk, v


def exact_shared_qk(q, v, causal=False, scale=1.0):
    """softmax over all keys with k = q / |q|, a token's own logit replaced by SELF_LOGIT (Reformer Sec. 2.2);
    logits q.k with no further scale, as trax and Hugging Face."""
    k = F.normalize(q, dim=-1)
    T = q.shape[2]
    s = q @ k.transpose(-1, -2) * scale
    s = torch.where(torch.eye(T, dtype=torch.bool), torch.full_like(s, SELF_LOGIT), s)
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.filterwarnings("ignore:lsh with causal_routing=paper")
@pytest.mark.parametrize("logit_scale", ["none", "rsqrt_head_dim"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("n_hashes", [1, 3])
def test_one_chunk_equals_exact_shared_qk_attention_with_self_mask(causal, n_hashes, logit_scale):
    """bucket_size >= seq_len: the whole (short) sequence is one chunk, whatever the buckets (the paper's
    routing; the past-only one keeps only the query's bucket, see the oracle in test_causal_routing.py)."""
    T = 11
    q, v = shared_qk_inputs(T)
    mech = lsh(bucket_size=16, n_hashes=n_hashes, logit_scale=logit_scale, causal_routing="paper")
    out = mech(q, F.normalize(q, dim=-1), v, causal=causal)
    scale = 1.0 if logit_scale == "none" else 1 / math.sqrt(E)
    torch.testing.assert_close(out, exact_shared_qk(q, v, causal, scale), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n_buckets", [None, 6])
def test_outputs_invariant_to_padding_appended_at_the_end(n_buckets):
    T, P = 21, 6
    q, v = shared_qk_inputs(T + P, seed=3)
    q[:, :, T:] *= 10  # loud padding: any leak shows
    mech = lsh(bucket_size=4, n_hashes=2, n_buckets=n_buckets)
    mask = torch.zeros(B, T + P, dtype=torch.bool)
    mask[:, T:] = True
    padded = mech(q, F.normalize(q, dim=-1), v, key_padding_mask_BS=mask)
    alone = mech(q[:, :, :T], F.normalize(q[:, :, :T], dim=-1), v[:, :, :T])
    torch.testing.assert_close(padded[:, :, :T], alone, atol=1e-5, rtol=1e-4)


def test_deterministic_for_a_fixed_seed_and_different_across_seeds_and_layers():
    T = 32
    q, v = shared_qk_inputs(T, scale=3.0)
    k = F.normalize(q, dim=-1)
    a = lsh(bucket_size=4, n_hashes=2, seed=5)(q, k, v)
    b = lsh(bucket_size=4, n_hashes=2, seed=5)(q, k, v)
    assert torch.equal(a, b)
    other_seed = lsh(bucket_size=4, n_hashes=2, seed=6).buckets(k, None)
    other_layer = lsh(1, bucket_size=4, n_hashes=2, seed=5).buckets(k, None)
    same = lsh(bucket_size=4, n_hashes=2, seed=5).buckets(k, None)
    assert not torch.equal(same, other_seed) and not torch.equal(same, other_layer)


def test_more_hashes_do_not_increase_the_error_against_exact_attention():
    """Reformer Fig. 4 / Table 2: accuracy rises with n_hashes. Averaged over inputs and seeds."""
    T, bucket = 64, 8
    hashes = [1, 2, 4, 8]
    errors = {h: 0.0 for h in hashes}
    for trial in range(6):
        q, v = shared_qk_inputs(T, seed=100 + trial, scale=4.0)  # peaked attention, as LSH assumes
        exact = exact_shared_qk(q, v)
        for h in hashes:
            out = lsh(bucket_size=bucket, n_hashes=h, seed=trial)(q, F.normalize(q, dim=-1), v)
            errors[h] += ((out - exact).norm() / exact.norm()).item()
    for fewer, more in zip(hashes, hashes[1:]):
        assert errors[more] <= errors[fewer], errors
    assert errors[hashes[-1]] < 0.5 * errors[hashes[0]], errors


def test_causal_output_has_exactly_zero_gradient_from_later_tokens():
    T = 24
    q, v = shared_qk_inputs(T, seed=7, requires_grad=True)
    out = lsh(bucket_size=4, n_hashes=3)(q, F.normalize(q, dim=-1), v, causal=True)
    for i in (0, 5, 13, 23):
        gq, gv = torch.autograd.grad(out[:, :, i].sum(), (q, v), retain_graph=True)
        assert torch.count_nonzero(gq[:, :, i + 1 :]) == 0 and torch.count_nonzero(gv[:, :, i + 1 :]) == 0
        assert gv[:, :, : i + 1].abs().sum() > 0


def test_first_causal_token_attends_to_itself():
    """Nothing else is available to position 0 under the causal mask, so its output is its own value."""
    q, v = shared_qk_inputs(10)
    out = lsh(bucket_size=4, n_hashes=2)(q, F.normalize(q, dim=-1), v, causal=True)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])


def test_default_n_buckets_is_even_and_about_two_per_chunk():
    for T, bucket in [(64, 8), (100, 16), (3, 64), (1000, 7)]:
        n = default_n_buckets(T, bucket)
        assert n >= 2 and n % 2 == 0
        assert abs(n - 2 * T / bucket) <= 2 or n == 2


def test_lsh_kind_uses_shared_qk_for_self_and_mha_for_cross_attention():
    cfg = ModelConfig(d_model=16, layers=1, ffn=32, attention={"kind": "lsh", "heads": 2, "bucket_size": 4}).attention
    self_attn = build_attention(cfg, 0, nn.ModuleDict())
    cross_attn = build_attention(cfg, 0, nn.ModuleDict(), cross=True)
    assert isinstance(self_attn.projection, SharedQKProjection)
    assert isinstance(cross_attn.projection, MultiHeadProjection)
    d = cfg.d_model
    assert self_attn.attention_parameters() == 3 * d * d  # W_qk, W_v, W_o
    x, memory = torch.randn(2, 9, d), torch.randn(2, 5, d)
    assert cross_attn(x, memory).shape == x.shape
    with pytest.raises(ValueError, match="shares one projection"):
        self_attn(x, memory)


@pytest.mark.parametrize(
    "knobs, field",
    [({"bucket_size": 0}, "bucket_size"), ({"n_hashes": 0}, "n_hashes"), ({"n_buckets": 5}, "n_buckets"),
     ({"n_buckets": 0}, "n_buckets")],
)
def test_bad_knobs_fail_naming_the_field(knobs, field):
    with pytest.raises(ValidationError, match=f"model.attention.{field}"):
        ModelConfig(d_model=16, attention={"kind": "lsh", "heads": 2, **knobs})


def test_lsh_is_not_offered_as_a_mechanism_of_other_projection_schemes():
    with pytest.raises(ValidationError, match="lsh"):
        ModelConfig(d_model=16, attention={"kind": "mha", "heads": 2, "mechanism": {"kind": "lsh"}})


def lsh_dense_oracle(mech: LSHMechanism, q, k, v, mask, causal: bool, routing: str, scale: float = 1.0):
    """LSH attention written out with dense T x T masks, independently of the mechanism's sort and layout.

    Per round r: bucket = argmax([kR; -kR]) over the mechanism's rotations (padded keys: an extra bucket);
    paper routing: chunk = (rank in the (bucket, position) order) // C, a query sees its chunk and the previous
    one; past-only routing (causal): a query of bucket-rank n sees the earlier keys of its own bucket with
    bucket-rank >= C * (n // C - 1). Then padding, causal and the self-logit, a softmax with its log-sum-exp,
    and the rounds merged by a softmax over their log-sum-exps (Reformer Sec. 2.3)."""
    B, H, T, _ = q.shape
    C, n_buckets = mech.bucket_size, mech.n_buckets
    rot = mech.rotations(H, n_buckets // 2, q.device).to(q.dtype)  # [H, R, E, n_half]
    xr = torch.einsum("bhte,hren->bhrtn", k, rot)
    bucket = torch.cat([xr, -xr], -1).argmax(-1)  # [B, H, R, T]
    pad = torch.zeros(B, T, dtype=torch.bool) if mask is None else mask
    bucket = bucket.masked_fill(pad[:, None, None, :], n_buckets)
    pos = torch.arange(T)
    outs, lses = [], []
    for r in range(mech.n_hashes):
        out_r = torch.zeros_like(q)
        lse_r = torch.zeros(B, H, T, dtype=q.dtype)
        for b in range(B):
            for h in range(H):
                bk = bucket[b, h, r]
                if routing == "past_only" and causal:
                    same = bk[:, None] == bk[None, :]
                    rank = torch.tensor([int((bk[:i] == bk[i]).sum()) for i in range(T)])
                    visible = same & (rank[None, :] >= C * (rank[:, None] // C - 1))
                else:
                    sorted_rank = torch.argsort(torch.argsort(bk * T + pos))
                    chunk = sorted_rank // C
                    visible = (chunk[None, :] == chunk[:, None]) | (chunk[None, :] == chunk[:, None] - 1)
                masked = ~visible | pad[b][None, :]
                if causal:
                    masked = masked | (pos[None, :] > pos[:, None])
                s = (q[b, h] @ k[b, h].T) * scale
                s = torch.where(torch.eye(T, dtype=torch.bool), torch.full_like(s, SELF_LOGIT), s)
                s = s.masked_fill(masked, float("-inf"))
                lse_r[b, h] = torch.logsumexp(s, -1)
                out_r[b, h] = torch.softmax(s, -1) @ v[b, h]
        outs.append(out_r)
        lses.append(lse_r)
    w = torch.softmax(torch.stack(lses), dim=0)  # [R, B, H, T]
    return (w[..., None] * torch.stack(outs)).sum(0)


@pytest.mark.filterwarnings("ignore:lsh with causal_routing=paper")
@pytest.mark.parametrize(
    "causal, routing", [(False, "past_only"), (True, "past_only"), (True, "paper")],
    ids=["bidirectional", "causal-past-only", "causal-paper"],
)
def test_mechanism_equals_the_dense_mask_oracle(causal, routing):
    """Exact agreement (float64) with hashing, sorting, windows, self-mask, causal mask, padding and the LSE
    merge over rounds written out densely: look-back 0 or 2, a plain mean over rounds, a missing self-mask or a
    leaky window all fail it. 4 buckets over 37 tokens: buckets hold more than one chunk, so the window binds."""
    T = 37
    q, v = shared_qk_inputs(T, seed=21, scale=2.0)
    q, v = q.double(), v.double()
    k = F.normalize(q, dim=-1)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 30:] = True
    mech = lsh(bucket_size=4, n_hashes=3, n_buckets=4, causal_routing=routing).double()
    out = mech(q, k, v, key_padding_mask_BS=mask, causal=causal)
    ref = lsh_dense_oracle(mech, q, k, v, mask, causal, routing)
    real = ~mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], atol=1e-12, rtol=1e-10)


def test_rotations_are_redrawn_every_training_forward_and_fixed_in_evaluation():
    """trax and Hugging Face draw new rotations on every forward pass; ours come from the global RNG in training
    (so a reversible backward, which restores it, replays them) and from (seed, layer) in evaluation."""
    q, v = shared_qk_inputs(32, scale=3.0)
    k = F.normalize(q, dim=-1)
    mech = lsh(bucket_size=4, n_hashes=2).train()
    torch.manual_seed(0)
    a = mech(q, k, v)
    torch.manual_seed(0)
    assert torch.equal(mech(q, k, v), a)  # same RNG state, same rotations
    assert not torch.equal(mech(q, k, v), a)  # the next call draws new ones
    mech.eval()
    assert torch.equal(mech(q, k, v), mech(q, k, v))
    fixed = lsh(bucket_size=4, n_hashes=2, rotations="fixed")
    assert torch.equal(fixed.train()(q, k, v), fixed.eval()(q, k, v))


def test_default_n_buckets_rounds_an_odd_count_up():
    """2 * 40 / 16 = 5 buckets cannot split into the [xR; -xR] halves: the default takes 6, not 4."""
    assert default_n_buckets(40, 16) == 6
    assert default_n_buckets(56, 16) == 8  # 7 -> 8
    assert default_n_buckets(48, 16) == 6  # already even


@pytest.mark.parametrize("bucket", [1, 3, 4, 7, 16, 64, 100])
def test_the_rows_bucket_counts_on_the_device_are_the_hosts(bucket):
    """Padded rows take their counts from `default_n_buckets_of`, made where the rows are: the same numbers as
    the host's formula for every length (halves rounded to even included: 2 * 40 / 16 = 5 -> 6, 2 * 24 / 16 = 3 ->
    4, 2 * 6 / 8 = 1.5 -> 2), an empty row counted as one token."""
    lengths = torch.arange(0, 3001)
    host = torch.tensor([default_n_buckets(max(int(n), 1), bucket) for n in lengths])
    assert torch.equal(default_n_buckets_of(lengths, bucket), host)


def test_attention_dropout_reaches_the_mechanism_in_training_only():
    """The block's attention dropout is applied to LSH's attention weights in training and never in evaluation."""

    def layer(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        cfg = ModelConfig(d_model=16, layers=1, ffn=32, attention={
            "kind": "lsh", "heads": 2, "bucket_size": 4, "rotations": "fixed", "dropout": dropout}).attention
        return build_attention(cfg, 0, nn.ModuleDict())

    x = torch.randn(2, 24, 16)
    plain, dropped = layer(0.0), layer(0.5)
    assert torch.equal(plain.eval()(x), dropped.eval()(x))
    torch.manual_seed(1)
    a = plain.train()(x)
    torch.manual_seed(1)
    assert not torch.allclose(a, dropped.train()(x))


def test_cross_length_inputs_are_refused_with_both_lengths():
    q, v = shared_qk_inputs(9)
    k, v5 = shared_qk_inputs(5)
    with pytest.raises(ValueError, match=r"lsh attention is self-attention: .*same length \(got 9 and 5\)"):
        lsh(bucket_size=4)(q, F.normalize(k, dim=-1), v5)


@pytest.mark.parametrize("n_buckets,padded", [(None, False), (6, True)])
def test_bounded_layout_changes_no_output_or_gradient(n_buckets, padded):
    """`bounded_layout` (what `orchestrator plan` counts under) only lengthens the past-only layout with masked rows:
    outputs and gradients equal the data-sized layout's, float64, without padding or with a fixed n_buckets."""
    T = 29
    q, v = shared_qk_inputs(T, seed=5, scale=2.0)
    q, v = q.double().requires_grad_(), v.double().requires_grad_()
    mask = torch.zeros(B, T, dtype=torch.bool)
    if padded:
        mask[1, 20:] = True
    mech = lsh(bucket_size=4, n_hashes=2, n_buckets=n_buckets).double()

    def run():
        out = mech(q, F.normalize(q, dim=-1), v, key_padding_mask_BS=mask, causal=True)
        return (out, *torch.autograd.grad(out.pow(2).sum(), (q, v)))

    sized = run()
    with bounded_layout():
        bounded = run()
    for a, b in zip(sized, bounded, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_layout_length_bound_holds_and_is_reached():
    """The past-only layout of T tokens in n_ids buckets is at most `layout_length_bound` long, for keys hashed
    at random and for any placement; one token in every bucket but one, which takes the rest, reaches it."""
    mech = lsh(bucket_size=4, n_hashes=1, causal_routing="past_only")
    T, n_ids = 40, 12

    def length(bucket_T: torch.Tensor) -> int:
        bucket = bucket_T.view(1, 1, 1, T)
        order = torch.argsort(bucket * T + torch.arange(T), dim=-1)
        return mech.bucket_aligned_slots(bucket, order)[1]

    bound = layout_length_bound(T, n_ids, 4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert length(torch.randint(0, n_ids, (T,), generator=gen)) <= bound
    worst = torch.cat([torch.arange(n_ids - 1), torch.full((T - n_ids + 1,), n_ids - 1)])
    assert length(worst[torch.randperm(T, generator=gen)]) == bound == (12 + (40 - 12) // 4) * 4
    assert layout_length_bound(5, 12, 4) == 20  # more buckets than tokens: one chunk per token


def test_under_bounded_layout_the_layout_takes_the_bound_of_every_bucket_id():
    """Inside `bounded_layout` the layout's length is `layout_length_bound` over the 2 * n_half bucket ids plus the
    padding's, whatever the hashes, without reading them back (what lets a plan run LSH on fake tensors)."""
    T, C = 40, 4
    mech = lsh(bucket_size=C, n_hashes=1, causal_routing="past_only")
    n_ids = default_n_buckets(T, C) + 1  # 20 buckets and the padding's id
    bucket = torch.zeros(1, 1, 1, T, dtype=torch.long)  # every token in bucket 0: a data-sized layout of T
    order = torch.argsort(bucket * T + torch.arange(T), dim=-1)
    assert mech.bucket_aligned_slots(bucket, order)[1] == T
    with bounded_layout():
        assert mech.bucket_aligned_slots(bucket, order)[1] == layout_length_bound(T, n_ids, C) == (21 + 19 // 4) * 4
