"""LSH's hash on its Triton kernel (kernels/k_lsh_hash.py, under the interpreter at tiny shapes) gives the ids of the
argmax over the concatenation [xR; -xR] (tests/test_lsh_hash.py's oracle), ties included, and in bf16 the ids of
the projections rounded once from their exact sums, as a bf16 matmul rounds its output.

``KERNEL_TESTS_DEVICE=cuda`` runs them on the kernel compiled for a GPU, as tests/test_kernels.py does.
"""

from __future__ import annotations

# First: on the CPU it sets TRITON_INTERPRET=1 before the @triton.jit modules are imported.
from tests.kernel_device import DEVICE, needs_triton, one_gpu_launch_config  # noqa: F401 (an autouse fixture)

import pytest
import torch

from kernels import dispatch
from kernels.lsh_hash import angular_hash
from models.attention.lsh import LSHMechanism, LSHMechanismConfig, angular_argmax
from tests.test_lsh_hash import buckets_by_concatenation, factorized_by_concatenation

pytestmark = needs_triton


def mechanism(bucket_size: int = 4, n_hashes: int = 2) -> LSHMechanism:
    # eval: fixed rotations, so the oracle's call draws the same ones (training with rotations=redraw draws anew)
    return LSHMechanism(LSHMechanismConfig(bucket_size=bucket_size, n_hashes=n_hashes), head_dim=16,
                        layer_index=0).eval()


def ties_across_tiles(k_BHTE: torch.Tensor, rot_HREN: torch.Tensor) -> int:
    """Tokens whose maximal projection is reached in two column tiles of the interpreter's launch (the shapes here
    span several of them; a GPU's tiles of 64 hold these cases whole): where a kernel that let a later tile win an
    equal maximum would give another id."""
    from kernels import k_lsh_hash  # imports triton, which the module's skip already requires

    tile = k_lsh_hash.launch_config(interpret=True)["BLOCK_N"]
    xr = torch.einsum("bhte,hren->bhrtn", k_BHTE.double(), rot_HREN.double())
    top = xr.max(-1, keepdim=True).values
    at_top = torch.nn.functional.pad(xr == top, (0, -xr.shape[-1] % tile))  # whole tiles, padding never at top
    tiles = at_top.unflatten(-1, (-1, tile)).any(-1).sum(-1)
    return int((tiles > 1).sum())


@pytest.mark.parametrize("padded", [False, True])
def test_the_kernel_gives_the_concatenations_ids_in_the_model(monkeypatch, padded: bool) -> None:
    """`buckets` of the model on the kernel (ATTN_BACKEND=triton) against the concatenation's argmax: several
    token and column tiles, 2 rounds, and with padding rows whose half counts differ (columns past a row's own
    count win in neither half)."""
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    mech = mechanism()
    torch.manual_seed(0)
    B, H, T = 2, 2, 70  # 5 token tiles; 70 / 4 * 2 = 36 buckets, 18 columns per half: 2 column tiles
    k = torch.randn(B, H, T, 16)
    mask = None
    if padded:
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[1, 41:] = True  # row 1: 41 real tokens, 10 columns per half against row 0's 18
    on_device = k.to(DEVICE)
    assert dispatch.fused_kernels(on_device)
    got = mech.buckets(on_device, None if mask is None else mask.to(DEVICE))
    assert torch.equal(got.cpu(), buckets_by_concatenation(mech, k, mask))


def test_factorized_buckets_on_the_kernel_are_the_authors_combination(monkeypatch) -> None:
    """n_buckets as factors on the kernel: one launch per factor over its slice of the rotation (strided columns),
    the ids combined as Hugging Face combines them (tests/test_lsh_hash.py's oracle)."""
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    factors = [6, 36]  # the second factor's 18 columns span two of the interpreter's column tiles
    mech = LSHMechanism(LSHMechanismConfig(bucket_size=4, n_hashes=2, n_buckets=factors), head_dim=16,
                        layer_index=0).eval()
    torch.manual_seed(0)
    k = torch.randn(1, 2, 37, 16)
    got = mech.buckets(k.to(DEVICE), None)
    rot = mech.rotations(2, sum(f // 2 for f in factors), k.device)
    assert torch.equal(got.cpu(), factorized_by_concatenation(k, rot, factors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ties_go_to_the_first_maximum_within_and_across_tiles(dtype: torch.dtype) -> None:
    """Small integers: every sum exact in each dtype, so ties are many and are ties in the matmul too; the
    first maximal column wins, within a tile and across tiles, and the positive half wins a tie with the
    negative one."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randint(-2, 3, (1, 2, 48, 16), generator=gen).to(dtype)
    rot = torch.randint(-1, 2, (2, 2, 16, 40), generator=gen).float()  # 40 columns: 3 column tiles
    half = torch.tensor([40])
    assert ties_across_tiles(k, rot) > 0  # the case the strict comparison across tiles exists for
    xr = torch.einsum("bhte,hren->bhrtn", k.double(), rot.double())
    assert int(((xr.max(-1).values == -xr.min(-1).values)).sum()) > 0  # the positive half's tie
    oracle = angular_argmax(xr, None, half[:, None, None, None])
    assert torch.equal(angular_hash(k.to(DEVICE), rot.to(DEVICE), half).cpu(), oracle)


def test_bf16_ids_are_those_of_the_exactly_rounded_projections() -> None:
    """Random bf16 keys: each projection is summed in fp32 and rounded to bf16 to nearest, ties to even, before
    the comparison, as a bf16 matmul rounds its output; the interpreter's own cast truncates, which gave other
    ids for about 0.5% of tokens here."""
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 2, 64, 64, generator=gen).bfloat16()
    rot = torch.randn(2, 2, 64, 32, generator=gen).bfloat16()
    half = torch.tensor([32, 32])
    exact = torch.einsum("bhte,hren->bhrtn", k.double(), rot.double()).bfloat16()  # one rounding of each sum
    got = angular_hash(k.to(DEVICE), rot.to(DEVICE), half).cpu()
    assert torch.equal(got, angular_argmax(exact, None, half[:, None, None, None]))
    # Without counts every row uses the rotation's 32 columns: the same ids, with no count tensor.
    assert torch.equal(angular_hash(k.to(DEVICE), rot.to(DEVICE)).cpu(), got)


def test_bad_shapes_are_refused_naming_what_is_wrong() -> None:
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="2 heads of 16 features"):
        angular_hash(k, torch.randn(3, 1, 16, 4), torch.tensor([4]))
    with pytest.raises(ValueError, match=r"must be 4-D \[batch, heads, seq, head_dim\]"):
        angular_hash(k[0], torch.randn(2, 1, 16, 4), torch.tensor([4]))
    with pytest.raises(ValueError, match="one half count per batch row"):
        angular_hash(k, torch.randn(2, 1, 16, 4), torch.tensor([4, 4]))
    with pytest.raises(ValueError, match="head_dim 16..128"):
        angular_hash(torch.randn(1, 2, 8, 8), torch.randn(2, 1, 8, 4), torch.tensor([4]))
