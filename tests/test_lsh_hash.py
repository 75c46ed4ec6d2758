"""LSH hashing in slices with max/min (models/attention/lsh.py `buckets`, `angular_argmax`) gives exactly the ids
of the former one-shot argmax over the concatenation [xR; -xR], ties included."""

from __future__ import annotations

import math

import pytest
import torch

from models.attention.lsh import (
    LSHMechanism,
    LSHMechanismConfig,
    angular_argmax,
    default_n_buckets,
    hash_slice_rows,
)


def buckets_by_concatenation(mech: LSHMechanism, k_BHTE, key_padding_mask_BT, rot_HREN=None):
    """The former `buckets`, verbatim but for the rotations, which a test may give: the oracle."""
    B, H, T = k_BHTE.shape[:3]
    if mech.n_buckets is not None or key_padding_mask_BT is None:
        n_half = mech.n_half_bound(T)
        half_B = torch.full((B,), n_half)
    else:
        real_B = (~key_padding_mask_BT).sum(-1)
        half_B = torch.tensor([default_n_buckets(max(int(n), 1), mech.bucket_size) // 2 for n in real_B])
        n_half = int(half_B.max())
    if rot_HREN is None:
        rot_HREN = mech.rotations(H, n_half, k_BHTE.device)
    rot_HREN = rot_HREN[..., :n_half].to(k_BHTE.dtype)
    xr_BHRTN = torch.einsum("bhte,hren->bhrtn", k_BHTE, rot_HREN)
    unused_B1111N = (torch.arange(n_half) >= half_B[:, None])[:, None, None, None, :]
    xr_BHRTN = xr_BHRTN.masked_fill(unused_B1111N, float("-inf"))
    neg_BHRTN = (-xr_BHRTN).masked_fill(unused_B1111N, float("-inf"))
    idx_BHRT = torch.cat([xr_BHRTN, neg_BHRTN], dim=-1).argmax(-1)
    half_B111 = half_B[:, None, None, None]
    bucket_BHRT = torch.where(idx_BHRT >= n_half, idx_BHRT - n_half + half_B111, idx_BHRT)
    if key_padding_mask_BT is not None:
        bucket_BHRT = bucket_BHRT.masked_fill(key_padding_mask_BT[:, None, None, :], 2 * n_half)
    return bucket_BHRT


def tie_heavy(*shape: int, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """Entries in {-2, -1, 0, 1, 2}: projections of such keys on such rotations are small integers, so equal
    maxima, and +x_c == -x_c' across the halves, are everywhere."""
    return torch.randint(-2, 3, shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_angular_argmax_equals_the_concatenations_first_maximum(dtype):
    gen = torch.Generator().manual_seed(0)
    B, n_half = 3, 5
    xr = tie_heavy(B, 2, 2, 40, n_half, gen=gen, dtype=dtype)
    xr[0, 0, 0, 0] = 0  # a zero key: every column ties, in both halves
    xr[0, 0, 0, 1] = torch.tensor([1, -3, 2, 3, 0], dtype=dtype)  # +x_3 == -x_1: the positive half wins
    xr[0, 0, 0, 2] = torch.tensor([-3, 1, 3, -3, 0], dtype=dtype)  # +x_2 ties -x_0 and -x_3: column 2
    xr[1, 0, 0, 1] = torch.tensor([1, -3, 2, 3, 0], dtype=dtype)  # 3 columns used: -x_1 = 3 wins, bucket 3 + 1
    xr[2, 1, 1, 3] = torch.tensor([-1, -1, -1, -1, -1], dtype=dtype)  # the negative half alone, first column
    half_B = torch.tensor([5, 3, 1])  # rows with fewer buckets: the last columns are not theirs
    unused = (torch.arange(n_half) >= half_B[:, None])[:, None, None, None, :]
    xr[2, 0, 0, 4] = torch.tensor([-1, 7, -9, 9, 9], dtype=dtype)  # only column 0 is used: bucket 1 (-x_0)
    masked = xr.masked_fill(unused, float("-inf"))
    idx = torch.cat([masked, (-xr).masked_fill(unused, float("-inf"))], -1).argmax(-1)
    half_B111 = half_B[:, None, None, None]
    expected = torch.where(idx >= n_half, idx - n_half + half_B111, idx)
    got = angular_argmax(xr, unused, half_B111)
    assert torch.equal(got, expected)
    assert got[0, 0, 0, 0] == 0 and got[0, 0, 0, 1] == 3 and got[0, 0, 0, 2] == 2
    assert got[1, 0, 0, 1] == 4 and got[2, 0, 0, 4] == 1
    # Every row using every column: the same without the mask.
    full = torch.full_like(half_B111, n_half)
    idx_full = torch.cat([xr, -xr], -1).argmax(-1)
    assert torch.equal(angular_argmax(xr, None, full), idx_full)


@pytest.mark.parametrize("n_buckets, padded", [(None, False), (None, True), (6, True), (40, False)])
def test_sliced_buckets_equal_the_concatenations(n_buckets, padded, monkeypatch):
    """Whole mechanism: tie-heavy bf16 keys and rotations, a zero key, padded rows (the default n_buckets then
    differs per row, so some columns are masked), and slices of a few tokens so that the loop runs many times."""
    gen = torch.Generator().manual_seed(1)
    B, H, T, E = 3, 2, 37, 16
    mech = LSHMechanism(LSHMechanismConfig(bucket_size=4, n_hashes=3, n_buckets=n_buckets), E, 0).eval()
    n_half = mech.n_half_bound(T)
    rot = tie_heavy(H, 3, E, n_half, gen=gen, dtype=torch.float32)
    monkeypatch.setattr(mech, "rotations", lambda heads, half, device, dtype: rot[..., :half].to(dtype))
    k = tie_heavy(B, H, T, E, gen=gen)
    k[0, 1, 5] = 0
    mask = None
    if padded:
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[1, 20:] = True
        mask[2, 3:] = True
    expected = buckets_by_concatenation(mech, k, mask, rot)
    for rows in (T, 5, 1):
        monkeypatch.setattr("models.attention.lsh.hash_slice_rows", lambda seq, dim, half, rows=rows: rows)
        assert torch.equal(mech.buckets(k, mask), expected), f"slices of {rows} tokens"


def test_sliced_buckets_equal_the_concatenations_on_gaussian_keys():
    """The mechanism's own rotations and keys, fp32 and bf16, at a length that takes several slices."""
    B, H, T, E = 2, 2, 300, 8
    mech = LSHMechanism(LSHMechanismConfig(bucket_size=2, n_hashes=2), E, 0).eval()
    assert hash_slice_rows(T, E, mech.n_half_bound(T)) < T  # 150 buckets per half: slices of 16 tokens
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.randn(B, H, T, E, generator=torch.Generator().manual_seed(2)).to(dtype)
        assert torch.equal(mech.buckets(k, None), buckets_by_concatenation(mech, k, None))


def test_hash_slices_hold_no_more_than_the_keys():
    assert hash_slice_rows(4096, 64, 32) == 4096  # 4k tokens, 64 buckets: one slice
    assert hash_slice_rows(131072, 64, 1024) == 8192  # 128k tokens, buckets of 64 (default count: 4096 / 2 * 1)
    assert hash_slice_rows(10, 8, 1000) == 1
    for T, E, half in ((131072, 64, 1024), (4096, 64, 32), (300, 8, 150)):
        assert hash_slice_rows(T, E, half) * half <= max(T * E, half)


def factorized_by_concatenation(k_BHTE, rot_HREN, factors):
    """Hugging Face's `LSHSelfAttention._hash_vectors` for a list of n_buckets, written out: the rotated keys' columns
    cut into consecutive runs of f/2, each factor's argmax over [xR_f; -xR_f], the ids combined as b1 + f1 * b2 +
    f1 * f2 * b3 ... The oracle of factorized hashing."""
    xr_BHRTN = torch.einsum("bhte,hren->bhrtn", k_BHTE, rot_HREN)
    bucket_BHRT, first, stride = torch.zeros(xr_BHRTN.shape[:4], dtype=torch.long), 0, 1
    for factor in factors:
        part = xr_BHRTN[..., first:first + factor // 2]
        bucket_BHRT = bucket_BHRT + stride * torch.cat([part, -part], dim=-1).argmax(-1)
        first, stride = first + factor // 2, stride * factor
    return bucket_BHRT


@pytest.mark.parametrize("factors", [[4, 6], [2, 4, 6]])
def test_factorized_buckets_are_the_authors_combination_of_each_factors_argmax(factors):
    """n_buckets as a list: each factor hashes over its own f/2 rotation columns, in order, and the ids combine with
    the first factor lowest (trax, Hugging Face); padding takes the id after every bucket, as unfactorized."""
    mech = LSHMechanism(LSHMechanismConfig(bucket_size=4, n_hashes=2, n_buckets=factors), head_dim=8,
                        layer_index=0).eval()
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 50, 8, generator=gen)
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[1, 31:] = True
    rot = mech.rotations(3, sum(f // 2 for f in factors), k.device)
    expected = factorized_by_concatenation(k, rot, factors).masked_fill(mask[:, None, None, :], mech.n_buckets)
    got = mech.buckets(k, mask)
    assert torch.equal(got, expected)
    assert mech.n_buckets == math.prod(factors) and int(got[~mask[:, None, None, :].expand_as(got)].max()) < mech.n_buckets
    # Every bucket id is reachable: with 50 x 2 x 3 x 2 hashes, the factors' products (24, 48) are mostly seen.
    assert len(torch.unique(got)) > mech.n_buckets // 2


def test_a_factorized_layer_is_causal_in_value():
    """The past-only causal layer with factorized buckets: outputs before a cut do not move when only later inputs
    change (exactly), and the layer runs both ways."""
    mech = LSHMechanism(LSHMechanismConfig(bucket_size=4, n_hashes=2, n_buckets=[4, 4]), head_dim=8,
                        layer_index=0).eval()
    gen = torch.Generator().manual_seed(1)
    q, v = torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 40, 8, generator=gen)
    q2, v2 = q.clone(), v.clone()
    q2[:, :, 25:] = torch.randn(1, 2, 15, 8, generator=gen)
    v2[:, :, 25:] = torch.randn(1, 2, 15, 8, generator=gen)
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731 - shared QK: the keys are the unit queries
    out, out2 = (mech(a, unit(a), b, causal=True) for a, b in ((q, v), (q2, v2)))
    assert torch.equal(out[:, :, :25], out2[:, :, :25]) and not torch.equal(out[:, :, 25:], out2[:, :, 25:])
    assert mech(q, unit(q), v).shape == q.shape


@pytest.mark.parametrize("n_buckets", [[4, 5], [], [0, 4]])
def test_bad_bucket_factors_are_refused_naming_the_field(n_buckets):
    with pytest.raises(ValueError, match=r"model.attention.n_buckets must be an even number >= 2, or a list"):
        LSHMechanismConfig(n_buckets=n_buckets)
