"""HyperAttention's SimHash bucket ranks on their Triton kernel (kernels/k_simhash.py, under the interpreter at tiny
shapes) against the definition computed in Python integers: bit j of a token's code is set where its product with
hyperplane j, as a matmul in the token's dtype gives it, is positive; the rank is the code's place along the
reflected Gray sequence. And the model's `bucket_rank` on the kernel equals its PyTorch path.

``KERNEL_TESTS_DEVICE=cuda`` runs them on the kernel compiled for a GPU, as tests/test_kernels.py does.
"""

from __future__ import annotations

# First: on the CPU it sets TRITON_INTERPRET=1 before the @triton.jit modules are imported.
from tests.kernel_device import DEVICE, needs_triton, one_gpu_launch_config  # noqa: F401 (an autouse fixture)

import pytest
import torch

from kernels import dispatch
from kernels.simhash import simhash_rank
from models.attention.hyper import HyperMechanism, HyperMechanismConfig

pytestmark = needs_triton


def gray_sequence_ranks(bits: int) -> torch.Tensor:
    """rank[code]: the place of each code in the reflected Gray sequence g(0), g(1), ... with g(i) = i ^ (i >> 1),
    by inverting the sequence itself (not the prefix XOR, which is what the kernel computes)."""
    i = torch.arange(1 << bits)
    return torch.empty_like(i).scatter_(0, i ^ (i >> 1), i)


def ranks_by_definition(x_BHTE: torch.Tensor, planes_ER: torch.Tensor) -> torch.Tensor:
    """The oracle: products summed in float64 (exact for the small integers the tests use), signs, weights 2^j."""
    signs = (x_BHTE.double() @ planes_ER.double()) > 0
    codes = (signs.long() * (1 << torch.arange(planes_ER.shape[1]))).sum(-1)
    return gray_sequence_ranks(planes_ER.shape[1])[codes]


def small_integers(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """Values in -2..2: every product sum is an integer of at most 4 * E, exact in fp16, bf16 and fp32, and many
    are exactly zero (no positive sign)."""
    return torch.randint(-2, 3, shape, generator=generator).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,head_dim", [(7, 16), (20, 24)])
def test_the_kernels_ranks_are_the_definitions(dtype: torch.dtype, bits: int, head_dim: int) -> None:
    """Five token tiles of the interpreter's 16, two batch rows and heads; 7 bits (the authors' default) and 20
    (past the model's rank table, every one of the five shifts of the prefix XOR used) at a head dim that is not
    a power of two (masked features). Zero products are many here and must set no bit; one row is all zeros."""
    gen = torch.Generator().manual_seed(0)
    x = small_integers(2, 2, 70, head_dim, generator=gen)
    x[1, 0, 5] = 0.0
    planes = small_integers(head_dim, bits, generator=gen)
    expected = ranks_by_definition(x, planes)
    assert expected[1, 0, 5] == 0
    assert (x.double() @ planes.double() == 0).any(-1).float().mean() > 0.2  # zero products in many tokens
    got = simhash_rank(x.to(DEVICE, dtype), planes.to(DEVICE))
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), expected)


def test_a_product_that_rounds_to_zero_sets_no_bit_as_in_the_matmul() -> None:
    """fp16 products of 2^-13 * 2^-13 = 2^-26 sum below fp16's smallest subnormal (2^-24) and round to zero, so a
    matmul in fp16 sees no positive sign; summed in fp32 and not rounded, the kernel would see one."""
    tiny = 2.0**-13
    x = torch.zeros(1, 1, 3, 16)
    x[0, 0, :, 0] = tiny
    planes = torch.zeros(16, 2)
    planes[0, 0] = tiny  # token . plane 0 = 2^-26
    planes[0, 1] = 1.0  # token . plane 1 = 2^-13, an fp16 subnormal: positive
    x16 = x.to(torch.float16)
    assert ((x16 @ planes.to(torch.float16)) > 0).tolist() == [[[[False, True]] * 3]]
    got = simhash_rank(x16.to(DEVICE), planes.to(DEVICE))
    assert got.cpu().tolist() == [[[int(gray_sequence_ranks(2)[0b10])] * 3]]


@pytest.mark.parametrize("padded", [False, True])
def test_the_models_ranks_on_the_kernel_are_its_pytorch_ranks(monkeypatch, padded: bool) -> None:
    """`bucket_rank` with ATTN_BACKEND=triton against the same call on PyTorch (the rank table's gather), random
    bf16 rows: the products that decide a sign are far from zero here, so the kernel's fp32 sums, added in another
    order than the matmul's, round to the same signs. Padded rows get 2^bits either way."""
    mech = HyperMechanism(HyperMechanismConfig(lsh_bits=7), head_dim=16, layer_index=0)
    torch.manual_seed(0)
    x = torch.randn(2, 2, 40, 16, dtype=torch.bfloat16)
    mask = None
    if padded:
        mask = torch.zeros(2, 40, dtype=torch.bool)
        mask[1, 29:] = True
    expected = mech.bucket_rank(x, mask)
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    on_device = x.to(DEVICE)
    assert dispatch.fused_kernels(on_device)
    got = mech.to(DEVICE).bucket_rank(on_device, None if mask is None else mask.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    assert not padded or bool((got[1, :, 29:] == 1 << 7).all())


def test_hyperplanes_of_the_wrong_shape_are_named() -> None:
    x = torch.zeros(1, 1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"hyperplanes must be \[E, r\] with x's 16 features"):
        simhash_rank(x, torch.zeros(8, 3, device=DEVICE))
    with pytest.raises(ValueError, match=r"1 <= r <= 30"):
        simhash_rank(x, torch.zeros(16, 31, device=DEVICE))
