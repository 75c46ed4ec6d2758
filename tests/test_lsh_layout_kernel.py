"""LSH's past-only layout on its Triton kernel (kernels/k_lsh_layout.py, under the interpreter at tiny shapes) is
the layout models/attention/lsh.py builds in PyTorch from `bucket_aligned_slots`: the same token in every row, -1
in the same filler rows, and the same shifted positions, for runs shorter than a chunk, of whole chunks and longer,
runs that cross the kernel's tiles (16 sorted tokens under the interpreter), the padding's bucket, and a layout
longer than it needs (the bound the model gives it).

``KERNEL_TESTS_DEVICE=cuda`` runs them on the kernel compiled for a GPU, as tests/test_kernels.py does.
"""

from __future__ import annotations

# First: on the CPU it sets TRITON_INTERPRET=1 before the @triton.jit modules are imported.
from tests.kernel_device import (  # noqa: F401 (an autouse fixture)
    DEVICE, needs_triton, one_gpu_launch_config, run_gpu_compile_script,
)

import pytest
import torch

from kernels.lsh_layout import bucket_layout
from models.attention.lsh import LSHMechanism, LSHMechanismConfig

pytestmark = needs_triton


def torch_layout(mech: LSHMechanism, bucket_BHRT: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of the model's PyTorch path (LSHMechanism.forward, past-only, off the kernels), `length` rows."""
    B, H, R, T = bucket_BHRT.shape
    order_BHRT = torch.argsort(bucket_BHRT * T + torch.arange(T), dim=-1)  # (bucket, position): distinct keys
    slot_BHRT, needed = mech.bucket_aligned_slots(bucket_BHRT, order_BHRT)
    assert needed <= length
    token_BHRL = torch.full((B, H, R, length), -1, dtype=torch.int32)
    token_BHRL.scatter_(3, slot_BHRT, torch.arange(T, dtype=torch.int32).expand(B, H, R, T))
    return token_BHRL, torch.arange(T) - bucket_BHRT * T


def kernel_layout(bucket_BHRT: torch.Tensor, bucket_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    bucket_BHRT = bucket_BHRT.to(DEVICE)
    order_BHRT = torch.argsort(bucket_BHRT, dim=-1, stable=True)  # as the model sorts
    token_BHRL, positions_BHRT = bucket_layout(bucket_BHRT, order_BHRT, bucket_size, length)
    return token_BHRL.cpu(), positions_BHRT.cpu()


def buckets(case: str, B: int, H: int, R: int, T: int, n_ids: int, gen: torch.Generator) -> torch.Tensor:
    bucket_BHRT = torch.randint(0, n_ids - 1, (B, H, R, T), generator=gen)
    if case == "long runs":
        # Row 0: one bucket holds tokens 5-40 (36 sorted tokens: 9 chunks of 4, across three tiles); row 1: two
        # buckets of exactly 16 and 20 tokens interleaved, whose runs end at and past tile edges.
        bucket_BHRT[0, 0, 0, 5:41] = 3
        bucket_BHRT[0, 0, 1, :32] = torch.tensor([1, 2]).repeat(16)
    elif case == "padding":
        bucket_BHRT[1, :, :, 50:] = n_ids - 1  # the padding's id (2 * n_half), one run at the end of its rows
    elif case == "one bucket":
        bucket_BHRT.fill_(n_ids - 2)
    return bucket_BHRT


@pytest.mark.parametrize("case, T", [("random", 70), ("long runs", 70), ("padding", 70), ("one bucket", 32),
                                     ("random", 9)])
def test_the_kernel_lays_out_every_row_as_the_model_does_in_pytorch(case: str, T: int) -> None:
    B, H, R, C = 2, 2, 2, 4
    mech = LSHMechanism(LSHMechanismConfig(bucket_size=C, n_hashes=R), head_dim=16, layer_index=0)
    gen = torch.Generator().manual_seed(0)
    bucket_BHRT = buckets(case, B, H, R, T, mech.n_ids_bound(T), gen)
    length = mech.bounded_layout_length(T)  # what the model gives the kernel: filler rows past the layout
    token, positions = kernel_layout(bucket_BHRT, C, length)
    token_ref, positions_ref = torch_layout(mech, bucket_BHRT, length)
    assert torch.equal(token, token_ref), (token != token_ref).nonzero()[:8].tolist()
    assert torch.equal(positions, positions_ref)
    # Every token in exactly one row, and every bucket's run starting a chunk (the rule both sides follow).
    assert torch.equal(token.sort(-1).values[..., -T:], torch.arange(T, dtype=torch.int32).expand(B, H, R, T))


def test_the_layout_refuses_mismatched_shapes_and_a_length_shorter_than_the_tokens() -> None:
    bucket_BHRT = torch.zeros(1, 1, 2, 8, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="must both be"):
        bucket_layout(bucket_BHRT, bucket_BHRT[..., :4], 4, 16)
    with pytest.raises(ValueError, match="length=7"):
        bucket_layout(bucket_BHRT, bucket_BHRT, 4, 7)


def causal_layer(B: int) -> tuple[LSHMechanism, tuple[torch.Tensor, ...]]:
    """Past-only LSH, buckets of 4, two rounds, 24 tokens (12 buckets), one head (the interpreter's chunk kernel
    takes seconds a call)."""
    mech = LSHMechanism(LSHMechanismConfig(bucket_size=4, n_hashes=2, causal_routing="past_only"), 16, 0).eval()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, 1, 24, 16, generator=gen) for _ in range(3))
    return mech, (q, k, v)


def test_the_causal_layer_on_the_layout_kernel_equals_the_layer_in_pytorch(monkeypatch) -> None:
    """The wiring: the layer's output with its layout, chunks and merge on the kernels against the same layer
    on PyTorch's backend (its layout built by `bucket_aligned_slots`), fp32 on both sides; padding in one row
    (fewer buckets there, and the padding's own bucket)."""
    from kernels import dispatch

    mech, (q, k, v) = causal_layer(B=2)
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[1, 17:] = True
    expected = mech(q, k, v, key_padding_mask_BS=mask, causal=True)
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    mech.to(DEVICE)
    assert dispatch.fused_kernels(q.to(DEVICE))
    got = mech(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), key_padding_mask_BS=mask.to(DEVICE), causal=True)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_on_the_layout_kernel_the_output_at_i_depends_on_nothing_after_i(monkeypatch) -> None:
    """Inputs after position i replaced (a different layout of the later tokens, in every round): the outputs up
    to i are bitwise the same."""
    from kernels import dispatch

    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    mech, inputs = causal_layer(B=1)
    mech.to(DEVICE)
    q, k, v = (x.to(DEVICE) for x in inputs)
    base = mech(q, k, v, causal=True)
    gen = torch.Generator().manual_seed(6)
    for i in (6, 15):
        changed = [x.clone() for x in (q, k, v)]
        for x in changed:
            x[:, :, i + 1:] = torch.randn(1, 1, 24 - i - 1, 16, generator=gen).to(DEVICE)
        out = mech(*changed, causal=True)
        assert torch.equal(out[:, :, :i + 1], base[:, :, :i + 1]), i
        assert not torch.equal(out[:, :, i + 1:], base[:, :, i + 1:]), i  # the check can see a change


_LAYOUT_PTX_SCRIPT = """
from kernels import k_lsh_layout
from kernels.offline_compile import compile_for
cfg = k_lsh_layout.launch_config(interpret=False)
print(compile_for(k_lsh_layout._bucket_layout, {"BLOCK": cfg["BLOCK"]}, cfg["num_warps"], 1, 90).asm["ptx"])
"""


def _loops(ptx_lines: list[str]) -> list[tuple[int, int]]:
    """(header line, back-edge line) of each loop of a PTX listing, in order: a branch to a label defined above."""
    labels = {line.split(":")[0].strip(): i for i, line in enumerate(ptx_lines) if line.startswith("$L__BB")}
    loops = []
    for i, line in enumerate(ptx_lines):
        target = line.split()[-1].rstrip(";") if "bra" in line else None
        if target in labels and labels[target] < i:
            loops.append((labels[target], i))
    return loops


@pytest.mark.slow
def test_the_compiled_layout_kernel_passes_a_barrier_between_the_fill_and_the_tokens():
    """Other threads of a program store tokens into slots the fill wrote -1 to, so every thread must pass a CTA
    barrier after its fill stores and before the tokens' loop; the interpreter runs a program's stores in order and
    cannot show it. The PTX for sm_90 (Triton's bundled ptxas, no GPU): the fill loop (stores), a `bar.sync`, then
    the tokens' loop (stores). Without `tl.debug_barrier()` the first barrier is inside the tokens' loop (its scans'),
    after that loop's header, and this fails."""
    lines = run_gpu_compile_script(_LAYOUT_PTX_SCRIPT, timeout=600).splitlines()
    (fill_head, fill_back), (token_head, token_back) = _loops(lines)[:2]
    assert any("st.global" in line for line in lines[fill_head:fill_back]), "no store in the fill loop"
    assert any("st.global" in line for line in lines[token_head:token_back]), "no store in the tokens' loop"
    assert any("bar.sync" in line for line in lines[fill_back:token_head]), "\n".join(lines[fill_back:token_head])
