"""HyperAttention (Han et al., 2024, arXiv 2310.05869) behaviour that surviving mutants showed untested.

The device-only mutants (a `device=` dropped, `.to(device)` made `.to(None)`) change nothing on a CPU-only machine;
tests/other_device.py simulates a second device on the CPU so that a tensor made on the wrong one raises, as on a
GPU. The `meta` device cannot do it here: the routing needs values (`longest_real_row`'s host sync, searchsorted
into the sorted key buckets).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from models.attention.hyper import HyperMechanism, HyperMechanismConfig
from models.attention.lse import exact_attention
from tests.other_device import OTHER, OtherDevice, on_other, to_other

B, H, E, T = 2, 2, 8, 22


def _inputs(padded: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, E, generator=g) * s for s in (2.0, 2.0, 1.0))
    pad = None
    if padded:
        pad = torch.zeros(B, T, dtype=torch.bool)
        pad[1, 17:] = True
    return q, k, v, pad


# the causal recursion with each routing (an odd piece, 22 -> 11, pads a row), the non-causal sortLSH; samples in
# evaluation (a CPU generator, moved to the device) and in training (drawn there); with and without padding
@pytest.mark.parametrize("causal, routing, training, padded", [
    (False, "past_only", False, True), (False, "past_only", True, False), (True, "past_only", False, False),
    (True, "past_only", True, True), (True, "paper", False, True), (True, "paper", True, False),
])
def test_every_tensor_is_made_on_the_inputs_device(causal, routing, training, padded):
    """Hash codes, sort keys, the sorted layout, the sampled columns and every mask are made on the input's
    device: run on a simulated second device, nothing mixes with a plain CPU tensor, the output stays there and
    equals the plain CPU run (the same global RNG state in training)."""
    cfg = HyperMechanismConfig(block_size=4, sample_size=4, min_seq_len=8, lsh_bits=2, causal_routing=routing)
    mech = HyperMechanism(cfg, E, layer_index=0).train(training)
    q, k, v, pad = _inputs(padded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the paper routing's leak warning
        torch.manual_seed(1)
        expected = mech(q, k, v, key_padding_mask_BS=pad, causal=causal)
        torch.manual_seed(1)
        with OtherDevice():
            to_other(mech)
            out = mech(*(to_other(x.clone()) for x in (q, k, v)), causal=causal,
                       key_padding_mask_BS=None if pad is None else to_other(pad.clone()))
            assert on_other(out) and out.device == OTHER
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _assert_causal_recursion_is_exact(mech, q, k, v, mask=None):
    """`mech.causal` (Algorithm 4) against exact causal attention with the same mask, output and lse, at every real
    query, in float64."""
    out, lse = mech.causal(q, k, v, mask)
    ref, ref_lse = exact_attention(q, k, v, causal=True, key_padding_mask=mask)
    real = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if mask is None else ~mask
    torch.testing.assert_close(out.transpose(1, 2)[real], ref.transpose(1, 2)[real], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse.transpose(1, 2)[real], ref_lse.transpose(1, 2)[real], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("routing", ["past_only", "paper"])
def test_odd_causal_pieces_without_a_padding_mask_equal_exact_causal_attention(routing):
    """Algorithm 4 on 44 -> 22 -> 11 (odd) -> 6 with no padding mask: the odd piece gets one padded row, masked
    (a mask is made for it), seen only by itself and dropped. With blocks covering every piece (and every sample
    inside its block, hence dropped) the recursion is exact causal attention, output and lse, in float64."""
    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(B, H, 44, E, generator=g, dtype=torch.float64) for _ in range(3))
    cfg = HyperMechanismConfig(block_size=32, sample_size=8, min_seq_len=8, lsh_bits=2, causal_routing=routing)
    mech = HyperMechanism(cfg, E, layer_index=0).double().train()
    _assert_causal_recursion_is_exact(mech, q, k, v)


@pytest.mark.parametrize("routing", ["past_only", "paper"])
def test_padding_at_the_start_or_middle_is_honoured_by_the_causal_recursion(routing):
    """Key padding anywhere (left padding, as batched generation uses, or a hole in the middle) is masked at every
    level of Algorithm 4: the off-diagonal block must take the first half's padding. With blocks covering every
    piece the recursion is exact, so each real query equals exact causal attention with the same mask."""
    g = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(B, H, 44, E, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(B, 44, dtype=torch.bool)
    mask[0, 3:9] = True  # a hole inside the first half (and the first quarter)
    mask[1, :5] = True  # left padding
    cfg = HyperMechanismConfig(block_size=32, sample_size=8, min_seq_len=8, lsh_bits=2, causal_routing=routing)
    mech = HyperMechanism(cfg, E, layer_index=0).double().train()
    _assert_causal_recursion_is_exact(mech, q, k, v, mask)


@pytest.mark.parametrize("routing", ["past_only", "paper"])
def test_an_off_diagonal_block_with_few_real_keys_is_exact(routing):
    """The exact threshold counts real keys (`longest_real_row`), at every level: 44 -> two halves of 22 =
    min_seq_len (exact), and an off-diagonal block whose first half holds 6 and 2 real keys (left padding), fewer
    than min_seq_len, is exact too, so the whole output is exact causal attention with the mask. Counting padded
    keys as real would approximate that block (blocks of 4, 4 samples)."""
    g = torch.Generator().manual_seed(29)
    q, k, v = (torch.randn(B, H, 44, E, generator=g, dtype=torch.float64) * s for s in (2.0, 2.0, 1.0))
    mask = torch.zeros(B, 44, dtype=torch.bool)
    mask[0, :16], mask[1, :20] = True, True
    cfg = HyperMechanismConfig(block_size=4, sample_size=4, min_seq_len=22, lsh_bits=2, causal_routing=routing)
    mech = HyperMechanism(cfg, E, layer_index=0).double().eval()
    _assert_causal_recursion_is_exact(mech, q, k, v, mask)


def _gray_ranks(x, hyperplanes, bits, padding=None):
    """Bucket ranks from the sign bits (angular LSH), ordered along the reflected Gray sequence looked up in the
    sequence itself; padded rows rank after every real bucket."""
    code = ((x @ hyperplanes.to(x.dtype) > 0).long() << torch.arange(bits)).sum(-1)
    position = {i ^ (i >> 1): i for i in range(1 << bits)}
    rank = code.clone().apply_(lambda c: position[c])
    if padding is not None:
        rank = rank.masked_fill(padding[:, None, :], 1 << bits)
    return rank


def _u(B_, H_, m, n_real_max):
    """Fixed 'uniform' draws: the first and last real key of a row of n_real_max keys, and points in between."""
    base = torch.tensor([0.0, 1 - 0.5 / n_real_max, 0.5, 0.27, 0.73, 0.11, 0.9, 0.41, 0.66])[:m]
    return torch.stack([torch.stack([base.roll(b_ + 3 * h_) for h_ in range(H_)]) for b_ in range(B_)])


def _oracle_row(q_i, keys, samples, k, v, n_real, m):
    """One query of the practical HyperAttention (Algorithms 2-3): exact logits of its block's keys, plus the sampled
    keys outside the block, each weighted by n / m (added to the logit in log space); (out, lse) in float64."""
    scale = q_i.shape[-1] ** -0.5
    logits = [float(q_i @ k[j]) * scale for j in keys]
    logits += [float(q_i @ k[j]) * scale + torch.log(torch.tensor(n_real / m, dtype=torch.float64)).item()
               for j in samples]
    idx = list(keys) + list(samples)
    lg = torch.tensor(logits, dtype=torch.float64)
    w = torch.softmax(lg, 0)
    return (w[:, None] * v[idx]).sum(0), torch.logsumexp(lg, 0)


@pytest.mark.parametrize("path", ["sorted-queries", "placed-queries"])
@pytest.mark.parametrize("N, m", [(22, 7), (24, 7), (24, 1)], ids=["partial-last-block", "whole-blocks", "one-sample"])
def test_sampled_part_follows_algorithm_2_with_given_draws(path, N, m, monkeypatch):
    """The light part with the draws fixed (`_uniform` replaced): sample s of a row with n real keys is the key at
    sorted position floor(u_s * n) (real keys sort first), dropped when it lies in the query's own key block (or is
    padding), kept ones weighted by n / m; merged with the block's exact keys, every real query equals a dense
    oracle written from the paper, in float64: bucket order and blocks as Algorithm 1 (ties by position, as the
    authors' stable sort), and for the placed queries the key block at the middle of their bucket's run. Row 1 has
    key padding (at the end for the sorted queries, whose padded queries move to the end; at the start and in the
    middle for the placed ones), so n differs between rows and from the padded length; one case draws a single
    sample (m = 1)."""
    b, bits = 4, 2
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(B, H, N, E, generator=g, dtype=torch.float64) * s for s in (1.5, 1.5, 1.0))
    pad = torch.zeros(B, N, dtype=torch.bool)
    if path == "sorted-queries":
        pad[1, N - 7:] = True
    else:
        pad[1, :3], pad[1, 9:11] = True, True
        q = q[:, :, :N - 5]  # a query count other than the key count (any works)
    _check_against_the_oracle(path, q, k, v, pad, b, m, bits, monkeypatch)


def _check_against_the_oracle(path, q, k, v, pad, b, m, bits, monkeypatch, u=None, qpad=None):
    """Run the sorted (non_causal) or placed routing with fixed draws and compare every real query with the
    oracle of `test_sampled_part_follows_algorithm_2_with_given_draws`. The sorted queries' padding `qpad` is
    the keys' unless given (the paper routing's off-diagonal block pads its queries and keys separately)."""
    B_, H_, N = k.shape[:3]
    qpad = pad if qpad is None else qpad
    cfg = HyperMechanismConfig(block_size=b, sample_size=m, min_seq_len=4, lsh_bits=bits)
    mech = HyperMechanism(cfg, E, layer_index=0).double().eval()
    u = _u(B_, H_, m, N) if u is None else u
    monkeypatch.setattr(mech, "_uniform", lambda *shape_device_level: u.to(shape_device_level[3]))
    if path == "sorted-queries":
        out, lse = mech.non_causal(q, k, v, pad, qpad)
        qx = q
    else:
        qx = q
        out, lse = mech.placed(qx, k, v, pad, 0)
    rank_k = _gray_ranks(k, mech.hyperplanes, bits, pad)
    rank_q = _gray_ranks(qx, mech.hyperplanes, bits, qpad if path == "sorted-queries" else None)
    for bi in range(B_):
        n_real = int((~pad[bi]).sum())
        for h in range(H_):
            order_k = sorted(range(N), key=lambda j: (int(rank_k[bi, h, j]), j))
            order_q = sorted(range(qx.shape[2]), key=lambda i: (int(rank_q[bi, h, i]), i))
            n_slots = -(-N // b) * b
            draws = [min(int(x * n_real), n_slots - 1) for x in u[bi, h].tolist()]
            for i in range(qx.shape[2]):
                if path == "sorted-queries":
                    if qpad[bi, i]:
                        continue
                    block = order_q.index(i) // b
                else:
                    r = int(rank_q[bi, h, i])
                    ranks = [int(rank_k[bi, h, j]) for j in order_k]
                    lo, hi = sum(x < r for x in ranks), sum(x <= r for x in ranks)
                    block = min((lo + hi) // 2, n_real - 1) // b
                keys = [j for j in order_k[block * b:(block + 1) * b] if not pad[bi, j]]
                samples = [order_k[s] for s in draws if s // b != block and s < n_real]  # padding sorts last
                ref, ref_lse = _oracle_row(qx[bi, h, i], keys, samples, k[bi, h], v[bi, h], n_real, m)
                torch.testing.assert_close(out[bi, h, i], ref, atol=1e-12, rtol=1e-10)
                torch.testing.assert_close(lse[bi, h, i], ref_lse, atol=1e-12, rtol=1e-10)


def test_a_query_whose_bucket_follows_every_key_goes_to_the_last_block_of_real_keys(monkeypatch):
    """Placed routing: a query whose bucket ranks after every real key's (its bucket holds no key) searches to the
    end of the real keys, and takes the block of the LAST real key, never a block of padding or one past the end.
    Built so it bites: the keys avoid the last Gray bucket and the queries sit in it, the real key counts are
    multiples of b (16 of 16, 12 after left padding) or one more (13: the last real key opens a block of its own),
    and one head (H = 1)."""
    b, m, bits = 4, 3, 2
    # the hyperplanes of layer 0, seed 0: those of the mechanism the check builds
    mech = HyperMechanism(HyperMechanismConfig(block_size=b, sample_size=m, lsh_bits=bits), E, layer_index=0)
    g = torch.Generator().manual_seed(37)
    x = torch.randn(4000, E, generator=g, dtype=torch.float64)
    rank = _gray_ranks(x[None, None], mech.hyperplanes, bits)[0, 0]
    last = (1 << bits) - 1
    keys, queries = x[rank < last][:3 * 16], x[rank == last][:3 * 10]
    k = keys.view(3, 1, 16, E)
    v = torch.randn(3, 1, 16, E, generator=g, dtype=torch.float64)
    q = queries.view(3, 1, 10, E)
    pad = torch.zeros(3, 16, dtype=torch.bool)
    pad[1, :4], pad[2, :3] = True, True
    _check_against_the_oracle("placed-queries", q, k, v, pad, b, m, bits, monkeypatch)


@pytest.mark.parametrize("path", ["sorted-queries", "placed-queries"])
def test_a_draw_that_rounds_up_to_n_takes_the_last_key(path, monkeypatch):
    """floor(u * n) is below n for every float32 u < 1 only while n is exact in float32; beyond 2^24 keys u * n
    can round up to n or past it. Such a draw (u = 1 here) must still index the sorted keys: the last slot when
    every slot is a real key (24 of 24, b = 4), a padded key (then dropped) otherwise."""
    b, m, N = 4, 3, 24
    g = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(B, H, N, E, generator=g, dtype=torch.float64) for _ in range(3))
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, N - 5:] = True
    u = torch.tensor([1.0, 0.0, 0.5]).expand(B, H, m)
    _check_against_the_oracle(path, q, k, v, pad, b, m, 2, monkeypatch, u=u)


def test_a_row_with_one_real_key_weights_its_samples_by_one_over_m(monkeypatch):
    """The paper routing's off-diagonal block pads keys (first half) and queries (second half) separately: a row
    whose first half holds one real key still has queries in every block. Queries outside block 0 see that key only
    through the m samples (all of them draw it), each weighted n / m = 1 / m, so the row sum is exactly exp of its
    logit (lse = logit); another row of the batch is long, so the block is not exact."""
    b, m, N = 4, 3, 24
    g = torch.Generator().manual_seed(43)
    q, k, v = (torch.randn(B, H, N, E, generator=g, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(B, N, dtype=torch.bool)
    pad[0], pad[1, 5] = False, False
    _check_against_the_oracle("sorted-queries", q, k, v, pad, b, m, 2, monkeypatch,
                              qpad=torch.zeros(B, N, dtype=torch.bool))


def test_a_zero_projection_is_a_zero_bit_as_in_the_authors_hash():
    """SimHash bit r is 1 when the projection on hyperplane r is strictly positive (insuhan/hyper-attn,
    angular_lsh.py: `mask = mat @ proj_dir > 0`): an all-zero row (a zero key, or padding filled with zeros) has
    code 0, bucket rank 0; a row on the negative side of every hyperplane too."""
    mech = HyperMechanism(HyperMechanismConfig(lsh_bits=3), E, layer_index=0)
    x = torch.zeros(1, 1, 2, E)
    x[0, 0, 1] = -torch.linalg.pinv(mech.hyperplanes.T) @ torch.ones(3)  # projection -1 on every hyperplane
    assert mech.bucket_rank(x, None).tolist() == [[[0, 0]]]


def test_inputs_of_another_dtype_than_the_module_are_hashed_in_their_dtype():
    """Under mixed precision the activations' dtype differs from the module's (float32 hyperplanes, autocast
    bfloat16 inputs; float64 here): the hyperplanes follow the inputs, so the result is that of the same module cast
    to the inputs' dtype, bit for bit."""
    g = torch.Generator().manual_seed(47)
    q, k, v = (torch.randn(B, H, 24, E, generator=g, dtype=torch.float64) for _ in range(3))
    cfg = HyperMechanismConfig(block_size=4, sample_size=3, min_seq_len=4, lsh_bits=2)
    mech = HyperMechanism(cfg, E, layer_index=0).eval()
    out = mech(q, k, v)
    torch.testing.assert_close(out, mech.double()(q, k, v), rtol=0, atol=0)


def test_evaluation_draws_differ_across_heads_and_repeat_across_rows():
    """Evaluation samples come from a per-(layer, level) generator: shared by the rows of a batch (so a row's
    result does not depend on the batch) but independent per head, as the paper samples per attention matrix."""
    mech = HyperMechanism(HyperMechanismConfig(sample_size=16), E, layer_index=0).eval()
    u = mech._uniform(3, 4, 16, torch.device("cpu"), 0)
    assert u.shape == (3, 4, 16)
    assert torch.equal(u[0], u[1]) and torch.equal(u[0], u[2])
    assert all(not torch.equal(u[0, i], u[0, j]) for i in range(4) for j in range(i))


def test_the_dropout_refusal_says_why_and_what_to_set():
    with pytest.raises(ValueError, match=r"^model\.attention\.dropout=0\.1 is not supported by the hyper mechanism "
                       r"\(its parts are merged through their log-sum-exp\); set model\.attention\.dropout to 0$"):
        HyperMechanism(HyperMechanismConfig(), E, layer_index=0, dropout=0.1)


def test_hyperplanes_are_a_fixed_function_of_seed_and_layer_and_not_saved():
    """The hash hyperplanes come from the seed and the layer index alone (not the global RNG, which training
    advances), differ across layers and seeds, and are not part of the state dict (rebuilt, never trained)."""
    calls = iter(range(100))

    def planes(seed, layer):
        torch.manual_seed(next(calls))  # a global RNG state that differs from call to call
        return HyperMechanism(HyperMechanismConfig(seed=seed), E, layer_index=layer).hyperplanes

    assert torch.equal(planes(0, 0), planes(0, 0)) and torch.equal(planes(3, 2), planes(3, 2))
    assert not torch.equal(planes(0, 0), planes(0, 1)) and not torch.equal(planes(0, 0), planes(1, 0))
    mech = HyperMechanism(HyperMechanismConfig(), E, layer_index=0)
    assert "hyperplanes" in dict(mech.named_buffers()) and "hyperplanes" not in mech.state_dict()
