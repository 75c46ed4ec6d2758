"""HyperAttention's blocks + samples on one Triton kernel (kernels/k_hyper_blocks.py, under the interpreter at tiny
shapes) equal the reference (kernels/hyper_blocks_reference.py) in out, lse and the gradients
of q, k, v through both, for the two layouts models/attention/hyper.py builds: non-causal sortLSH (group g reads
key block g) and past-only routing (several groups per key block, key blocks no group reads, unused groups of
filler slots), with filler key rows, padded keys, samples drawn twice and samples inside a group's own block.

``KERNEL_TESTS_DEVICE=cuda`` runs them on the kernels compiled for a GPU, as tests/test_kernels.py does.
"""

from __future__ import annotations

import math

# First: on the CPU it sets TRITON_INTERPRET=1 before the @triton.jit modules are imported.
from tests.kernel_device import DEVICE, needs_triton, one_gpu_launch_config  # noqa: F401 (an autouse fixture)

import pytest
import torch

from kernels.hyper_blocks import hyper_block_flash_attention
from kernels.hyper_blocks_reference import hyper_block_attention_reference

pytestmark = needs_triton
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def sorted_layout(B: int, H: int, n: int, b: int, gen: torch.Generator) -> torch.Tensor:
    """A random order of n tokens in whole blocks of b rows, the fillers (-1) last: [B, H, ceil(n / b) * b]."""
    order = torch.argsort(torch.rand(B, H, n, generator=gen), dim=-1)
    return torch.nn.functional.pad(order, (0, -n % b), value=-1)


def non_causal_layout(B, H, n, b, m, gen):
    """Group g reads key block g; samples anywhere among the real rows (so some in a group's own block)."""
    q_slots, k_rows = sorted_layout(B, H, n, b, gen), sorted_layout(B, H, n, b, gen)
    nb = k_rows.shape[-1] // b
    group_block = torch.arange(nb).expand(B, H, nb).contiguous()
    samples = torch.randint(0, n, (B, H, m), generator=gen)
    samples[..., -1] = samples[..., 0]  # a key drawn twice
    return q_slots, k_rows, group_block, samples


def placed_layout(B, H, M, n, b, m, gen):
    """Past-only routing's layout: each query in some key block, each block's queries in ceil(count / b) groups of
    b slots, G = ceil(M / b) + NB groups (the unused ones at the end read the last block with filler slots)."""
    k_rows = sorted_layout(B, H, n, b, gen)
    nb = k_rows.shape[-1] // b
    block_BHM = torch.randint(0, max(nb - 1, 1), (B, H, M), generator=gen)  # the last block read by nobody
    G = -(-M // b) + nb
    q_slots = torch.full((B, H, G * b), -1, dtype=torch.int64)
    group_block = torch.full((B, H, G), nb - 1, dtype=torch.int64)
    for i in range(B):
        for j in range(H):
            g = 0
            for kb in range(nb):
                queries = torch.nonzero(block_BHM[i, j] == kb).flatten()
                for start in range(0, len(queries), b):
                    part = queries[start:start + b]
                    q_slots[i, j, g * b:g * b + len(part)] = part
                    group_block[i, j, g] = kb
                    g += 1
    samples = torch.randint(0, n, (B, H, m), generator=gen)
    return q_slots, k_rows, group_block, samples


def run_both(q, k, v, layout, b, log_w, pad, dtype):
    """(out, lse, dq, dk, dv) of the kernel and of the reference (in fp64 for an fp32 kernel, else in fp32)."""
    g_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    g_lse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = []
    for fn, work in ((hyper_block_flash_attention, dtype),
                     (hyper_block_attention_reference, torch.float64 if dtype == torch.float32 else dtype)):
        leaves = [x.detach().to(DEVICE, work, copy=True).requires_grad_() for x in (q, k, v)]
        args = [x.to(DEVICE) for x in layout]
        out, lse = fn(*leaves, *args, log_w.to(DEVICE), b, key_padding_mask=None if pad is None else pad.to(DEVICE))
        finite = torch.isfinite(lse)
        ((out.double() * g_out).sum() + (torch.where(finite, lse, 0).double() * g_lse).sum()).backward()
        results.append([out.detach(), lse.detach(), *(x.grad for x in leaves)])
    return results


# The non-causal layout is the GPU suite's parity case (benchmarks/gpu/parity.py, `hyper`), whose dry run in the
# fast tier checks it against the same reference under the interpreter (tests/test_gpu_suite.py), and on a GPU in
# every dtype and head dim; here the past-only layout, in fp32 (the tight tolerance).
def test_the_kernel_equals_the_reference_on_the_past_only_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    B, H, E, b, m, dtype = 2, 1, 16, 16, 20, torch.float32
    n, M = 45, 37  # three key blocks, the last with 3 filler rows
    layout = placed_layout(B, H, M, n, b, m, gen)
    q, k, v = (torch.randn(B, H, t, E, generator=gen) for t in (M, n, n))
    pad = torch.zeros(B, n, dtype=torch.bool)
    pad[1, -7:] = True  # row 1's last keys padded: never seen, in a block or as a sample
    log_w = torch.tensor([math.log(n / m), math.log((n - 7) / m)])
    own = (layout[3] // b)[:, :, None, :] == layout[2][..., None]
    assert own.any() and not own.all()  # samples inside a group's own key block, masked there
    kernel, reference = run_both(q, k, v, layout, b, log_w, pad, dtype)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), kernel, reference):
        torch.testing.assert_close(got.to(want.dtype), want, **TOL[dtype], msg=lambda s, n=name: f"{n}: {s}")
    assert kernel[3][1, :, -7:].abs().max() == 0  # padded keys get no gradient


def test_without_samples_the_kernel_is_block_diagonal_attention() -> None:
    """m = 0: each query attends to its key block only, which the reference computes as exact attention."""
    gen = torch.Generator().manual_seed(3)
    B, H, E, b, n = 1, 2, 16, 16, 40
    q_slots, k_rows, group_block, _ = non_causal_layout(B, H, n, b, 1, gen)
    layout = (q_slots, k_rows, group_block, torch.zeros(B, H, 0, dtype=torch.int64))
    q, k, v = (torch.randn(B, H, n, E, generator=gen) for _ in range(3))
    kernel, reference = run_both(q, k, v, layout, b, torch.zeros(B), None, torch.float32)
    for got, want in zip(kernel, reference):
        torch.testing.assert_close(got.double(), want, **TOL[torch.float32])


def test_the_reference_is_the_merge_of_blocks_and_samples() -> None:
    """The reference's one softmax over block keys and weighted samples = exact attention over the block merged
    with exact attention over the samples outside the block (weights n / m), the two parts the paper merges: checked
    on one group written out by hand."""
    gen = torch.Generator().manual_seed(4)
    B, H, E, b, n, m = 1, 1, 8, 4, 12, 5
    q_slots, k_rows, group_block, samples = non_causal_layout(B, H, n, b, m, gen)
    q, k, v = (torch.randn(B, H, n, E, generator=gen, dtype=torch.float64) for _ in range(3))
    log_w = torch.tensor([math.log(n / m)])
    out, lse = hyper_block_attention_reference(q, k, v, q_slots, k_rows, group_block, samples, log_w, b)
    g = 1
    queries = q_slots[0, 0, g * b:(g + 1) * b]
    block_keys = k_rows[0, 0, g * b:(g + 1) * b]
    outside = samples[0, 0][samples[0, 0] // b != g]
    sample_keys = k_rows[0, 0, outside]
    logits = q[0, 0, queries] @ torch.cat([k[0, 0, block_keys], k[0, 0, sample_keys]]).T / math.sqrt(E)
    logits[:, b:] += math.log(n / m)
    want_lse = torch.logsumexp(logits, -1)
    want = torch.softmax(logits, -1) @ torch.cat([v[0, 0, block_keys], v[0, 0, sample_keys]])
    torch.testing.assert_close(out[0, 0, queries], want)
    torch.testing.assert_close(lse[0, 0, queries], want_lse)


def test_bad_layouts_are_refused() -> None:
    q = torch.randn(1, 2, 8, 16)
    q_slots, k_rows, group_block, samples = non_causal_layout(1, 2, 8, 4, 3, torch.Generator().manual_seed(0))
    log_w = torch.zeros(1)
    with pytest.raises(ValueError, match="q_slots must be int64"):
        hyper_block_flash_attention(q, q, q, q_slots[..., :-1], k_rows, group_block, samples, log_w, 4)
    with pytest.raises(ValueError, match="whole key blocks of 4"):
        hyper_block_flash_attention(q, q, q, q_slots, k_rows[..., :-1], group_block, samples, log_w, 4)
    with pytest.raises(ValueError, match="one log-weight per batch row"):
        hyper_block_flash_attention(q, q, q, q_slots, k_rows, group_block, samples, torch.zeros(2), 4)
    twice = q_slots.clone()
    twice[..., 1] = twice[..., 0]
    with pytest.raises(ValueError, match="every query token exactly once"):
        hyper_block_attention_reference(q, q, q, twice, k_rows, group_block, samples, log_w, 4)


# The paper routing's off-diagonal blocks are the non-causal path (its own cases) at every level. "non_causal" has
# padded keys (the samples drawn among each row's real keys, the tables made on the host); "non_causal_whole_blocks"
# none, at a multiple of the block (one piece's samples and tables on the tables kernel), in both modes. Causal
# cases (past-only routing): "causal_past_only" 64 -> 32 -> 16 tokens in blocks of 16, two levels stacked in one pass
# (models/attention/hyper_levels.py); "causal_three_levels" 64 -> 32 -> 16 -> 8 in blocks of 4, where the
# recursion's draw order of its pieces' samples is bit-reversed (tests/test_hyper_placement_kernel.py: the tables
# with batch rows); "causal_two_levels_eval" 32 -> 16 -> 8, stacked, in evaluation with two heads (each level's
# fixed draw, shared by the batch rows);
# "causal_level_by_level" 72 tokens, whose halves of 36 are not whole blocks of 16, so the recursion runs level by
# level on the kernel; "causal_level_by_level_eval" 96 -> 48 -> 24 -> 12, halves of whole blocks of 8 but 12 keys
# at the last level, fewer than min_seq_len: level by level, each level's tables on the tables kernel with its own
# evaluation draw.
CASES = {  # mode: (B, H, T, block_size, min_seq_len, causal, training, padded)
    "non_causal": (2, 1, 70, 16, 16, False, False, True),
    "non_causal_whole_blocks": (2, 2, 64, 16, 16, False, True, False),
    "non_causal_whole_blocks_eval": (2, 2, 64, 16, 16, False, False, False),
    "causal_past_only": (1, 2, 64, 16, 16, True, True, False),
    "causal_three_levels": (1, 1, 64, 4, 8, True, True, False),
    "causal_two_levels_eval": (2, 2, 32, 4, 8, True, False, False),
    "causal_level_by_level": (1, 2, 72, 16, 16, True, True, False),
    "causal_level_by_level_eval": (1, 2, 96, 8, 16, True, False, False),
}


@pytest.mark.parametrize("mode", list(CASES))
def test_the_model_on_the_kernel_equals_the_model_in_pytorch(monkeypatch, mode: str) -> None:
    """HyperMechanism with ATTN_BACKEND=triton (the fused blocks + samples, read through the sort orders) against
    the same mechanism on the PyTorch reference (the two parts and their lse merge): the same samples from the same
    seed in training and from each recursion level's own generator in evaluation (causal, past-only routing: the
    off-diagonal blocks of every recursion level on the kernel)."""
    from kernels import dispatch
    from models.attention.hyper import HyperMechanism, HyperMechanismConfig

    B, H, T, block, min_seq_len, causal, training, padded = CASES[mode]
    cfg = HyperMechanismConfig(block_size=block, sample_size=8, min_seq_len=min_seq_len, lsh_bits=3)
    mech = HyperMechanism(cfg, head_dim=16, layer_index=0).train(training)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, T, 16, generator=gen) for _ in range(3))
    pad = None
    if padded:  # padding needs two rows
        pad = torch.zeros(B, T, dtype=torch.bool)
        pad[1, 50:] = True
    g_out = torch.randn(B, H, T, 16, generator=gen)
    results = []
    for backend in ("triton", "reference"):
        monkeypatch.setenv(dispatch.BACKEND_ENV, backend)
        leaves = [x.clone().to(DEVICE).requires_grad_() for x in (q, k, v)]
        torch.manual_seed(7)  # the samples' draw
        out = mech.to(DEVICE)(*leaves, key_padding_mask_BS=None if pad is None else pad.to(DEVICE), causal=causal)
        (out * g_out.to(DEVICE)).sum().backward()
        results.append([out.detach().cpu(), *(x.grad.cpu() for x in leaves)])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5, msg=lambda s, n=name: f"{n}: {s}")
