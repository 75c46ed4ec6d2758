"""HyperAttention's causal recursion in one pass on the kernels (models/attention/hyper_levels.py,
kernels/hyper_levels.py): where it applies, how the recursion's samples are put in position order, and that on the
kernels (the interpreter at small shapes) the output at i depends on nothing after i, in value. Its equality with
the recursion on PyTorch, samples included, is tests/test_hyper_blocks_kernel.py's model test."""

from __future__ import annotations

# First: on the CPU it sets TRITON_INTERPRET=1 before the @triton.jit modules are imported.
from tests.kernel_device import DEVICE, needs_triton, one_gpu_launch_config  # noqa: F401 (an autouse fixture)

import pytest
import torch

from models.attention.hyper import HyperMechanism, HyperMechanismConfig
from models.attention.hyper_groups import group_queries, grouped_rows
from models.attention.hyper_levels import stacked_levels


@pytest.mark.parametrize("n, min_seq_len, block, levels", [
    (64, 16, 16, 2),   # 64 -> 32 -> 16: halves of 32 and 16 keys, whole blocks
    (128, 16, 8, 3),
    (16, 16, 4, 0),    # exact: no level at all
    (72, 16, 16, 0),   # a half of 36 keys is not whole blocks of 16
    (96, 16, 4, 0),    # 96 -> 48 -> 24 -> 12: 12 keys at the last level, fewer than min_seq_len (exact there)
    (88, 8, 1, 0),     # 88 -> 44 -> 22 -> 11 (odd: the recursion pads a row)
])
def test_levels_are_stacked_only_where_the_recursion_halves_into_whole_blocks(n, min_seq_len, block, levels):
    assert stacked_levels(n, min_seq_len, block, bits=3) == levels


def test_sort_keys_that_would_overflow_int64_are_not_stacked():
    """The levels' sort key is segment * (2^bits + 1) + bucket rank, with 2^L segments at the last level."""
    assert stacked_levels(1 << 20, 1 << 12, 64, bits=7) == 8
    assert stacked_levels(1 << 40, 1 << 12, 64, bits=30) == 28  # 2^28 * (2^30 + 1) < 2^62
    assert stacked_levels(1 << 50, 1 << 12, 64, bits=30) == 0  # 2^38 * (2^30 + 1) > 2^62


@needs_triton
@pytest.mark.parametrize("lead, M, nb, block, spread", [
    ((2, 3), 40, 10, 4, "random"),       # `placed`'s [B, H]: a few groups per block, blocks without queries
    ((1, 2, 3), 64, 16, 4, "random"),    # the stacked levels' [B, H, L], rows spanning the interpreter's tiles
    ((1, 1), 37, 5, 8, "one block"),     # every query in one block: ceil(37 / 8) groups, the rest unused
    ((1, 2), 48, 6, 8, "runs"),          # runs of whole groups and longer, across tiles of 16
])
def test_the_kernels_grouping_is_group_queries(lead, M, nb, block, spread):
    """`grouped_rows` (the LSH layout kernel) against `group_queries` (PyTorch): the query in each slot (-1 in
    an unused one) and the key block of each group, unused groups included."""
    gen = torch.Generator().manual_seed(M)
    if spread == "random":
        block_XM = torch.randint(0, nb, (*lead, M), generator=gen)
    elif spread == "one block":
        block_XM = torch.full((*lead, M), nb // 2)
    else:
        block_XM = torch.sort(torch.randint(0, 3, (*lead, M), generator=gen) * (nb // 3), dim=-1).values
    slot_XM, want_block = group_queries(block_XM, nb, block)
    G = want_block.shape[-1]
    want_query = torch.full((*lead, G * block), -1, dtype=torch.long).scatter_(
        -1, slot_XM, torch.arange(M).expand(*lead, M))
    query, got_block = grouped_rows(block_XM.to(DEVICE), nb, block)
    assert query.dtype == torch.long and torch.equal(query.cpu(), want_query)
    assert torch.equal(got_block.cpu(), want_block)


@needs_triton
def test_on_the_kernels_the_output_at_i_depends_on_nothing_after_i(monkeypatch):
    """Two stacked levels (32 -> 16 -> 8 tokens, blocks of 4), in training: inputs after position i are replaced,
    and the outputs up to i stay bitwise the same (the samples' draw repeated from one seed)."""
    from kernels import dispatch

    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    cfg = HyperMechanismConfig(block_size=4, sample_size=8, min_seq_len=8, lsh_bits=3)
    mech = HyperMechanism(cfg, head_dim=16, layer_index=0).train().to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    B, H, T = 1, 1, 32
    assert stacked_levels(T, cfg.min_seq_len, cfg.block_size, cfg.lsh_bits) == 2
    q, k, v = (torch.randn(B, H, T, 16, generator=gen).to(DEVICE) for _ in range(3))

    def run(q, k, v):
        torch.manual_seed(11)
        return mech(q, k, v, causal=True)

    base = run(q, k, v)
    for i in (11, 20):  # inside the first half of level 0; in its second half
        changed = [x.clone() for x in (q, k, v)]
        for x in changed:
            x[:, :, i + 1:] = torch.randn(B, H, T - i - 1, 16, generator=gen).to(DEVICE)
        out = run(*changed)
        assert torch.equal(out[:, :, :i + 1], base[:, :, :i + 1]), i
        assert not torch.equal(out[:, :, i + 1:], base[:, :, i + 1:]), i  # the check can see a change


@needs_triton
@pytest.mark.skipif(DEVICE.type != "cuda", reason="the defaults' sizes (blocks and samples of 256, pieces of 4096): "
                    "on a GPU only, KERNEL_TESTS_DEVICE=cuda; the interpreter checks small shapes above")
def test_at_the_defaults_on_a_gpu_the_one_pass_equals_the_recursion(monkeypatch):
    """16k tokens at HyperAttention's defaults (two stacked levels, key blocks of 256 in tiles of the GPU's launch
    configuration), fp32: the kernels' one pass against the recursion on PyTorch, out and gradients, training draws."""
    from kernels import dispatch

    mech = HyperMechanism(HyperMechanismConfig(), head_dim=64, layer_index=0).train().to(DEVICE)
    B, H, T = 1, 2, 16384
    assert stacked_levels(T, mech.min_seq_len, mech.block_size, mech.bits) == 2
    gen = torch.Generator().manual_seed(9)
    q, k, v, g_out = (torch.randn(B, H, T, 64, generator=gen).to(DEVICE) for _ in range(4))
    results = []
    for backend in ("triton", "reference"):
        monkeypatch.setenv(dispatch.BACKEND_ENV, backend)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        torch.manual_seed(7)
        out = mech(*leaves, causal=True)
        (out * g_out).sum().backward()
        results.append([out.detach(), *(x.grad for x in leaves)])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=lambda s, n=name: f"{n}: {s}")
