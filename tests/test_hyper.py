"""HyperAttention: exact below min_seq_len, convergence in sample_size, causality, the LSE merge, errors."""

from __future__ import annotations

import warnings

import pytest
import torch
from pydantic import ValidationError

from models import LanguageModel, ModelConfig
from models.attention.hyper import MAX_LSH_BITS, HyperMechanismConfig
from models.attention.hyper import HyperMechanism, gray_rank
from models.attention.lse import exact_attention, merge_lse, merge_lse_reference

B, H, E = 2, 2, 8


def hyper(**knobs) -> HyperMechanism:
    return HyperMechanism(HyperMechanismConfig(**knobs), E, layer_index=0).eval()


def qkv(T: int, seed: int = 0, scale: float = 1.0, dtype=torch.float32, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        (torch.randn(B, H, T, E, generator=gen, dtype=dtype) * s).requires_grad_(requires_grad)
        for s in (scale, scale, 1.0)
    )


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_equals_exact_attention_below_min_seq_len(causal):
    T = 15
    q, k, v = qkv(T)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 11:] = True
    out = hyper(block_size=4, sample_size=4, min_seq_len=T + 1)(q, k, v, key_padding_mask_BS=mask, causal=causal)
    ref, _ = exact_attention(q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_relative_error_falls_as_sample_size_grows():
    T, trials = 256, 4
    sizes = [8, 64, 512]
    errors = {m: 0.0 for m in sizes}
    for trial in range(trials):
        q, k, v = qkv(T, seed=trial, scale=0.7)
        ref, _ = exact_attention(q, k, v)
        for m in sizes:
            torch.manual_seed(1000 + trial)
            mech = hyper(block_size=32, sample_size=m, min_seq_len=64, lsh_bits=3).train()
            errors[m] += ((mech(q, k, v) - ref).norm() / ref.norm()).item() / trials
    for fewer, more in zip(sizes, sizes[1:]):
        assert errors[more] < errors[fewer], errors


def test_blocks_alone_are_worse_than_blocks_plus_samples():
    """sample_size = 0 keeps only the sortLSH diagonal; the sampled residual must reduce the error."""
    T = 256
    q, k, v = qkv(T, seed=11, scale=0.7)
    ref, _ = exact_attention(q, k, v)
    err = {m: ((hyper(block_size=32, sample_size=m, min_seq_len=64)(q, k, v) - ref).norm() / ref.norm()).item()
           for m in (0, 512)}
    assert err[512] < err[0], err


def test_causal_version_leaks_nothing_from_the_future_nor_from_padding():
    T, real = 44, 37  # min_seq_len 8: 44 -> 22 -> 11 (odd: padded to 12) -> 6, off-diagonal blocks approximated
    q, k, v = qkv(T, seed=5, requires_grad=True)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, real:] = True
    out = hyper(block_size=4, sample_size=6, min_seq_len=8, lsh_bits=2).train()(
        q, k, v, causal=True, key_padding_mask_BS=mask
    )
    for i in (0, 9, 10, 21, 30, 43):
        grads = torch.autograd.grad(out[:, :, i].sum(), (q, k, v), retain_graph=True)
        for g in grads:
            assert torch.count_nonzero(g[:, :, i + 1 :]) == 0
        assert grads[2][:, :, : i + 1].abs().sum() > 0
    _, gk, gv = torch.autograd.grad(out[1, :, :real].sum(), (q, k, v))
    assert torch.count_nonzero(gk[1, :, real:]) == 0 and torch.count_nonzero(gv[1, :, real:]) == 0


def test_causal_matches_exact_where_the_recursion_is_exact():
    """Queries of the first min_seq_len-long leaf see only exact causal attention."""
    T, leaf = 32, 8
    q, k, v = qkv(T, seed=2)
    out = hyper(block_size=4, sample_size=4, min_seq_len=leaf)(q, k, v, causal=True)
    ref, _ = exact_attention(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, :leaf], ref[:, :, :leaf], atol=1e-6, rtol=1e-5)


def test_lse_merge_of_two_exact_halves_equals_exact_attention_with_matching_gradients():
    T = 12
    q, k, v = qkv(T, seed=3, dtype=torch.float64, requires_grad=True)
    h = T // 2
    out_a, lse_a = exact_attention(q, k[:, :, :h], v[:, :, :h])
    out_b, lse_b = exact_attention(q, k[:, :, h:], v[:, :, h:])
    merged, lse = merge_lse(out_a, lse_a, out_b, lse_b)
    ref, ref_lse = exact_attention(q, k, v)
    torch.testing.assert_close(merged, ref)
    torch.testing.assert_close(lse, ref_lse)
    weights = torch.randn_like(ref)
    grads = torch.autograd.grad((merged * weights).sum() + lse.sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum() + ref_lse.sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_lse_merge_with_an_empty_part_is_finite_and_ignores_it():
    q, k, v = qkv(6, dtype=torch.float64, requires_grad=True)
    out, lse = exact_attention(q, k, v)
    all_padded = torch.ones(B, 6, dtype=torch.bool)
    empty_out, empty_lse = exact_attention(q, k, v, key_padding_mask=all_padded)
    merged, merged_lse = merge_lse(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(merged, out)
    both_empty, both_lse = merge_lse(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.all(both_empty == 0) and torch.all(torch.isneginf(both_lse))
    grads = torch.autograd.grad(merged.sum() + both_empty.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_gradient_flows_through_the_merge_weights():
    """gradcheck of the approximate path (eval: fixed samples); a detached LSE would fail it."""
    q, k, v = (x[:1, :1].detach().requires_grad_() for x in qkv(12, seed=4, dtype=torch.float64))
    mech = hyper(block_size=4, sample_size=4, min_seq_len=8, lsh_bits=2).double()
    assert torch.autograd.gradcheck(lambda q_, k_, v_: mech(q_, k_, v_), (q, k, v), eps=1e-6, atol=1e-5,
                                    fast_mode=True)


def test_block_size_not_dividing_the_length_is_padded_with_masked_keys():
    """One block larger than the sequence holds every real key: the result is exact attention, and the
    internal padding rows (masked) and the samples (all inside the one block, so dropped) add nothing."""
    T = 10
    q, k, v = qkv(T, seed=8)
    out = hyper(block_size=16, sample_size=8, min_seq_len=4)(q, k, v)
    ref, _ = exact_attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    odd = hyper(block_size=7, sample_size=8, min_seq_len=4).train()(*qkv(23, seed=9))
    assert odd.shape == (B, H, 23, E) and torch.isfinite(odd).all()


def test_padding_appended_at_the_end_changes_nothing_in_evaluation():
    T, P = 30, 9
    q, k, v = qkv(T + P, seed=6)
    k[:, :, T:] *= 10
    mask = torch.zeros(B, T + P, dtype=torch.bool)
    mask[:, T:] = True
    mech = hyper(block_size=4, sample_size=8, min_seq_len=8, lsh_bits=3)
    padded = mech(q, k, v, key_padding_mask_BS=mask)
    alone = mech(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    torch.testing.assert_close(padded[:, :, :T], alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bits", [1, 3, 7])
def test_gray_order_makes_neighbouring_buckets_differ_in_one_bit(bits):
    codes = torch.arange(1 << bits)
    order = torch.argsort(gray_rank(codes, bits))
    flips = order[1:] ^ order[:-1]
    assert torch.all((flips & (flips - 1)) == 0) and torch.all(flips > 0)  # exactly one bit set
    assert torch.equal(torch.sort(gray_rank(codes, bits)).values, codes)  # a permutation of the buckets


@pytest.mark.parametrize(
    "knobs, field",
    [({"lsh_bits": 0}, "lsh_bits"), ({"lsh_bits": MAX_LSH_BITS + 1}, "lsh_bits"), ({"block_size": 0}, "block_size"),
     ({"sample_size": -1}, "sample_size"), ({"min_seq_len": 1}, "min_seq_len")],
)
def test_bad_knobs_fail_naming_the_field(knobs, field):
    with pytest.raises(ValidationError, match=f"model.attention.{field}"):
        ModelConfig(d_model=16, attention={"kind": "hyper", "heads": 2, **knobs})


def test_dropout_is_refused_with_the_field_to_fix():
    # Refused by the config (so `orchestrator validate` says it); the module's own refusal is in test_hyper_mutants.
    with pytest.raises(ValueError, match="model.attention.dropout=0.1 is not supported by the hyper mechanism"):
        ModelConfig(d_model=16, layers=1, ffn=32, attention={"kind": "hyper", "heads": 2, "dropout": 0.1})


def test_hyper_as_a_mechanism_of_mhe_projections_trains_a_step():
    cfg = ModelConfig(
        d_model=16, layers=1, ffn=32, max_seq_len=32,
        attention={"kind": "mhe", "heads": 2, "mechanism": {"kind": "hyper", "block_size": 4, "sample_size": 4,
                                                             "min_seq_len": 8, "lsh_bits": 2}},
    )
    model = LanguageModel(cfg, 20, causal=True)
    tokens = torch.randint(0, 20, (2, 24))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("path", ["sorted-queries", "placed-queries"])
def test_sampled_row_sum_is_unbiased(path):
    """E[exp(lse)] over the sample draws is the exact row sum: block keys exactly, the rest estimated by
    n / m times the sampled terms outside the query's block (Algorithm 2's d_i, practical version). A dropped
    or inverted n / m weight, or samples not masked inside the block, miss by many standard errors."""
    N, draws = 64, 3000
    q, k, v = (x[:1].double() for x in qkv(N, seed=13, scale=0.5))
    mech = hyper(block_size=8, sample_size=8, min_seq_len=16, lsh_bits=3).double().train()
    torch.manual_seed(0)
    run = (lambda *x: mech.non_causal(*x, None, None)[1]) if path == "sorted-queries" else (
        lambda *x: mech.placed(*x, None, 0)[1])
    # Each batch row draws its own sample (`residual`: per batch row and head) and the hashing is fixed, so the
    # draws are rows of a batch of copies of the one row: the same 3000 independent draws, in three calls
    # instead of 3000.
    sums = torch.cat([run(*(x.expand(draws // 3, -1, -1, -1) for x in (q, k, v))).exp()
                      for _ in range(3)])[:, None]  # [draws, 1, H, N]
    exact = exact_attention(q, k, v)[1].exp()
    mean, stderr = sums.mean(0), sums.std(0) / draws**0.5
    z = (mean - exact) / stderr.clamp(min=1e-12)
    assert z.abs().max() < 5.0, f"largest |z| {z.abs().max():.1f}"
    assert ((mean - exact).abs() / exact).max() < 0.05


@pytest.mark.parametrize("routing", ["past_only", "paper"])
def test_causal_with_blocks_covering_every_piece_equals_exact_causal_attention(routing):
    """block_size >= every off-diagonal piece: each is one exact block and every sample falls inside it (so is
    dropped); the recursion (44 -> 22 -> 11, odd, -> 6) must then give exact causal attention, output and lse,
    at every level. Merging the wrong half, or a wrong odd-length pad, fails it."""
    T = 44
    q, k, v = qkv(T, seed=17, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 39:] = True
    mech = hyper(block_size=32, sample_size=8, min_seq_len=8, lsh_bits=2, causal_routing=routing).double()
    out, lse = mech.train().causal(q, k, v, mask)
    ref, ref_lse = exact_attention(q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)


def test_mechanism_orders_buckets_so_that_neighbours_differ_in_one_bit():
    """Through the mechanism's own hashing (not only the helper): sorting by bucket_rank walks the codes of
    the sign bits against its hyperplanes along a Gray path. A binary order (rank = code) fails."""
    mech = hyper(lsh_bits=4)
    x = torch.randn(1, 1, 4000, E, generator=torch.Generator().manual_seed(3))
    code = ((x @ mech.hyperplanes > 0).long() << torch.arange(4)).sum(-1).flatten()
    rank = mech.bucket_rank(x, None).flatten()
    walk = torch.unique_consecutive(code[torch.argsort(rank, stable=True)])
    assert len(walk) == 16  # every code seen once, in rank order
    flips = walk[1:] ^ walk[:-1]
    assert torch.all((flips & (flips - 1)) == 0)


def test_training_samples_differ_across_batch_rows():
    """Two identical rows of a batch get independent samples in training (the paper samples independently)."""
    q, k, v = (x[:1].expand(2, H, 64, E) for x in qkv(64, seed=4))
    mech = hyper(block_size=8, sample_size=8, min_seq_len=16, lsh_bits=3).train()
    out = mech(q, k, v)
    assert not torch.equal(out[0], out[1])
    assert torch.equal(mech.eval()(q, k, v)[0], mech.eval()(q, k, v)[1])  # evaluation: shared, repeatable


def test_past_only_placement_gives_each_query_the_key_block_at_its_own_bucket():
    """Oracle of the past-only routing of an off-diagonal block (samples off): keys sorted by (bucket rank,
    position); a query's block is the one holding the middle of its bucket's run of keys, so it sees exactly
    those b keys. A query placed one block off, or by the other queries, fails it."""
    M, N, b = 20, 32, 8
    q, k, v = (x[:1].double() for x in qkv(N, seed=19))
    q = q[:, :, :M]
    mech = hyper(block_size=b, sample_size=0, min_seq_len=4, lsh_bits=3).double()
    out, lse = mech.placed(q, k, v, None, 0)
    rank_k, rank_q = mech.bucket_rank(k, None), mech.bucket_rank(q, None)
    for h in range(H):
        order = sorted(range(N), key=lambda j: (int(rank_k[0, h, j]), j))
        ranks = [int(rank_k[0, h, j]) for j in order]
        for i in range(M):
            r = int(rank_q[0, h, i])
            lo, hi = sum(x < r for x in ranks), sum(x <= r for x in ranks)
            keys = order[(min((lo + hi) // 2, N - 1) // b) * b:][:b]
            ref, ref_lse = exact_attention(q[:, h:h + 1, i:i + 1], k[:, h:h + 1, keys], v[:, h:h + 1, keys])
            torch.testing.assert_close(out[0, h, i], ref[0, 0, 0], atol=1e-12, rtol=1e-10)
            torch.testing.assert_close(lse[0, h, i], ref_lse[0, 0, 0], atol=1e-12, rtol=1e-10)


def test_min_seq_len_boundary_follows_the_authors_code():
    """insuhan/hyper-attn: `forward_no_causal_mask` is exact when `self.min_seq_len > n_query` (strictly shorter),
    the causal recursion when `n_key <= self.min_seq_len` (no longer than)."""
    T = 16
    q, k, v = qkv(T, seed=3, scale=2.0)
    mech = hyper(block_size=4, sample_size=4, min_seq_len=T, lsh_bits=2)
    exact_causal, _ = exact_attention(q, k, v, causal=True)
    torch.testing.assert_close(mech(q, k, v, causal=True), exact_causal, atol=1e-6, rtol=1e-5)
    exact_full, _ = exact_attention(q, k, v)
    assert (mech(q, k, v) - exact_full).abs().max() > 1e-3  # length == min_seq_len: approximated
    shorter = hyper(block_size=4, sample_size=4, min_seq_len=T + 1, lsh_bits=2)
    torch.testing.assert_close(shorter(q, k, v), exact_full, atol=1e-6, rtol=1e-5)
    # inside the recursion: 32 -> two pieces of exactly min_seq_len = 16, which are exact
    q, k, v = qkv(2 * T, seed=4, scale=2.0)
    exact_causal, _ = exact_attention(q, k, v, causal=True)
    torch.testing.assert_close(mech(q, k, v, causal=True)[:, :, :T], exact_causal[:, :, :T], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("routing", ["past_only", "paper"])
def test_evaluation_draws_its_samples_independently_at_every_recursion_level(routing, monkeypatch):
    """Each level of the causal recursion gets its own evaluation generator (level 0, 1, 2 for 64 -> 32 -> 16 -> 8),
    so the sampled columns of different levels are not the same draw."""
    mech = hyper(block_size=4, sample_size=4, min_seq_len=8, lsh_bits=2, causal_routing=routing)
    draws: dict[int, torch.Tensor] = {}
    uniform = mech._uniform

    def recording(B, H, m, device, level):
        draws[level] = uniform(B, H, m, device, level)
        return draws[level]

    monkeypatch.setattr(mech, "_uniform", recording)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mech(*qkv(64, seed=1), causal=True)
    assert sorted(draws) == [0, 1, 2]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])


@pytest.mark.filterwarnings("ignore:hyper with causal_routing=paper")
def test_paper_routing_ignores_the_content_of_padded_positions():
    """The paper routing leaks real future tokens, but padded queries sort after every real one and padded
    keys are never sampled: changing what sits under the padding mask changes no real output."""
    T, real = 44, 29
    q, k, v = qkv(T, seed=6, scale=2.0)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, real:] = True
    mech = hyper(block_size=4, sample_size=6, min_seq_len=8, lsh_bits=2, causal_routing="paper")
    out = mech(q, k, v, causal=True, key_padding_mask_BS=mask)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, real:] = torch.randn_like(x[:, :, real:]) * 5
    out2 = mech(q2, k2, v2, causal=True, key_padding_mask_BS=mask)
    assert torch.equal(out[:, :, :real], out2[:, :, :real])


def test_cross_length_inputs_are_refused_naming_the_fix():
    q, _, _ = qkv(9)
    _, k, v = qkv(5)
    with pytest.raises(ValueError, match=r"same length \(got 9 and 5\); cross-attention is built with cross=True"):
        hyper(min_seq_len=4)(q, k, v)


def _sortlsh_oracle(hyperplanes: torch.Tensor, bits: int, q_NE, k_NE, v_NE, b: int):
    """Algorithm 1 (sortLSH) of arXiv 2310.05869 for one (batch, head), written out densely, and softmax over
    its mask M^H: (out [N, E], lse [N]).

    - Hash (Def. 1; the authors' angular_lsh.py `hash`, lines 24-26): the sign bits of x against the
      hyperplanes, code = sum_i 2^i bit_i. Buckets are ordered along the reflected Gray sequence
      0, 1, 3, 2, 6, ... (our documented deviation: the inverse Gray map, so that neighbouring buckets differ
      in one bit; the authors' `perm[code]` at line 27 is the forward map); here the position of the code in
      that sequence is looked up in a list, not computed by prefix XOR as `gray_rank` does.
    - Order inside a bucket: the authors' hyper_attn.py (insuhan/hyper-attn 68b91e9) sorts with
      `torch.sort(self.lsh.hash(query), dim=2, stable=True)` (lines 102-103, keys likewise), so rows of one
      bucket keep their position order; Algorithm 1's P_Q(i) < P_Q(j) if H(Q_i) <= H(Q_j) leaves ties open.
      Python's sort is stable, and is the independent computation of that order here.
    - M^H_ij = 1{floor(P_Q(i) / b) = floor(P_K(j) / b)}: the diagonal b x b blocks of the sorted order
      (lines 114-120 view the sorted rows in blocks of b). A last block shorter than b holds fewer keys (we
      mask the internal padding; the authors pad with zero keys).
    """
    gray = [s ^ (s >> 1) for s in range(1 << bits)]

    def rank(x_NE):
        codes = [sum(int(bit) << i for i, bit in enumerate(row)) for row in (x_NE @ hyperplanes > 0)]
        return [gray.index(code) for code in codes]

    N = q_NE.shape[0]
    rank_q, rank_k = rank(q_NE), rank(k_NE)
    order_q = sorted(range(N), key=lambda i: rank_q[i])  # stable: ties stay in position order
    order_k = sorted(range(N), key=lambda j: rank_k[j])
    p_q = {i: slot for slot, i in enumerate(order_q)}
    p_k = {j: slot for slot, j in enumerate(order_k)}
    mask = torch.tensor([[p_q[i] // b == p_k[j] // b for j in range(N)] for i in range(N)])
    logits = (q_NE @ k_NE.T) * q_NE.shape[-1] ** -0.5
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, -1) @ v_NE, torch.logsumexp(logits, -1)


@pytest.mark.parametrize("N", [24, 22], ids=["whole-blocks", "partial-last-block"])
def test_sortlsh_blocks_follow_algorithm_1_with_the_authors_in_bucket_order(N):
    """The heavy part alone (sample_size=0) is softmax over Algorithm 1's mask, queries and keys sorted by
    bucket and, inside a bucket, by position (the authors' stable sort). With 2 hash bits the buckets hold
    about 6 rows and blocks 4, so blocks cut through buckets and the order inside a bucket decides which keys
    a query sees: a descending or otherwise different tie-break fails."""
    b, bits = 4, 2
    q, k, v = (x.double() for x in qkv(N, seed=23))
    mech = hyper(block_size=b, sample_size=0, min_seq_len=4, lsh_bits=bits).double()
    out, lse = mech.non_causal(q, k, v, None, None)
    assert mech(q, k, v).equal(out)  # the mechanism's own bidirectional path is this one
    cut = 0
    for bb in range(B):
        for h in range(H):
            ref, ref_lse = _sortlsh_oracle(mech.hyperplanes.double(), bits, q[bb, h], k[bb, h], v[bb, h], b)
            torch.testing.assert_close(out[bb, h], ref, atol=1e-12, rtol=1e-10)
            torch.testing.assert_close(lse[bb, h], ref_lse, atol=1e-12, rtol=1e-10)
            ranks = sorted(mech.bucket_rank(k[bb:bb + 1, h:h + 1], None).flatten().tolist())
            cut += sum(ranks[s - 1] == ranks[s] for s in range(b, N, b))  # a block boundary inside a bucket
    assert cut >= 4  # the in-bucket order is really exercised


def _causal_by_slices(mech: HyperMechanism, q, k, v, pad, level: int = 0):
    """Algorithm 4 as plain slices, cat and the autograd merge (how `causal` wrote it before issue 55's glue work):
    the independent path that `causal`'s views and merge_lse_below must match bitwise."""
    B, H, N, E = q.shape
    if N <= mech.min_seq_len:
        return exact_attention(q, k, v, causal=True, key_padding_mask=pad)
    odd = N % 2
    if odd:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 1)) for x in (q, k, v))
        pad = torch.nn.functional.pad(torch.zeros(B, N, dtype=torch.bool) if pad is None else pad, (0, 1), value=True)
    h = (N + odd) // 2
    halves = lambda x: torch.cat([x[:, :, :h], x[:, :, h:]], dim=0)  # noqa: E731
    out_d, lse_d = _causal_by_slices(mech, halves(q), halves(k), halves(v),
                                     None if pad is None else torch.cat([pad[:, :h], pad[:, h:]]), level + 1)
    first, second = (None, None) if pad is None else (pad[:, :h], pad[:, h:])
    if mech.past_only:
        out_off, lse_off = mech.placed(q[:, :, h:], k[:, :, :h], v[:, :, :h], first, level)
    else:
        out_off, lse_off = mech.non_causal(q[:, :, h:], k[:, :, :h], v[:, :, :h], first, second, level)
    out_bot, lse_bot = merge_lse_reference(out_d[B:], lse_d[B:], out_off, lse_off)
    return torch.cat([out_d[:B], out_bot], dim=2)[:, :, :N], torch.cat([lse_d[:B], lse_bot], dim=2)[:, :, :N]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("routing", ["past_only", "paper"])
@pytest.mark.parametrize("T", [37, 64])
def test_causal_recursion_equals_the_slice_and_cat_recursion_bitwise(T, routing, training):
    """The causal levels' views (unbind) and the fused merge change no output bit (issue 55), odd pieces and
    padding included; the input gradients agree within float32 rounding (the merge's lse gradient is a closed
    form, a few ulps from autograd's chain)."""
    mech = hyper(block_size=4, sample_size=4, min_seq_len=8, lsh_bits=2, causal_routing=routing).train(training)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 3], mask[1, T - 5:] = True, True
    results = []
    for path in (mech.causal, lambda *xs: _causal_by_slices(mech, *xs)):
        q, k, v = qkv(T, seed=T, requires_grad=True)
        torch.manual_seed(5)
        out, lse = path(q, k, v, mask)
        (out.pow(2).sum() + lse.sum()).backward()
        results.append((out, lse, (q.grad, k.grad, v.grad)))
    (out, lse, grads), (ref, ref_lse, ref_grads) = results
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
