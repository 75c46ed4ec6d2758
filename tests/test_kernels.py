"""Parity of the Triton attention kernels with the PyTorch references, forward and backward (through both
``out`` and ``lse``), on the CPU through the Triton interpreter; plus checks of the references themselves
against dense oracles, of the kernels' loop boundaries, and of the backend dispatch.

The interpreter runs the kernels with 16 x 16 blocks (kernels.k_flash_attention.INTERPRETER_CONFIG), so the
small shapes below still cover several blocks, sequence tails and causal block skipping; the block-shape
tests force 32 x 16 and 16 x 32 through kernels.flash_attention.fixed_launch_config.

``KERNEL_TESTS_DEVICE=cuda`` runs the same parity tests compiled on a GPU instead (no interpreter),
at one launch configuration (64 x 64; tests/kernel_device.py, as the GPU suite's parity part: the autotuner's
candidates made a case 77 s of compilation), the autotuner itself in test_autotuned_launch_path, with every
sequence length (and chunk) SEQ_SCALE = 8 times longer and the block-shape tests at 128 x 64 and 64 x 128.
"""

from __future__ import annotations

import os

# First: on the CPU it sets TRITON_INTERPRET=1 before the @triton.jit modules are imported.
from tests.kernel_device import (  # noqa: F401 (an autouse fixture)
    DEVICE, HAS_TRITON, KERNEL_DEVICE, needs_triton, one_gpu_launch_config, run_gpu_compile_script,
)

import inspect
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels import chunked_attention, exact_attention, select_backend
from kernels.chunked_attention import chunked_flash_attention
from kernels.flash_attention import (
    backward_delta,
    fixed_launch_config,
    flash_attention,
    tuned_launch_configs,
)
from kernels.parity import parity_error
from kernels.reference import (
    SELF_LOGIT,
    chunk_neighbours,
    chunked_attention_reference,
    exact_attention_reference,
)

# Longer sequences on a GPU, where they cost nothing, so that the production block sizes (64, 128) still
# leave several blocks, tails and a diagonal band.
SEQ_SCALE = 8 if KERNEL_DEVICE == "cuda" else 1
# Block shapes with BLOCK_M != BLOCK_N, which move the causal band's boundaries off the diagonal.
UNEQUAL_BLOCKS = [(128, 64), (64, 128)] if KERNEL_DEVICE == "cuda" else [(32, 16), (16, 32)]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Within kernels.parity.PARITY_TOLERANCE of the reference (relative to max(1, max |reference|)), with
    the same infinite entries."""
    err, bound, problem = parity_error(actual, expected, dtype)
    assert problem is None, f"{what}: {problem}"
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def outputs_and_grads(fn, q, k, v, dout, dlse, **kwargs):
    """out, lse and the gradients of sum(out * dout) + sum(lse * dlse) with respect to q, k, v."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, **kwargs)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    return out, lse, grads


def compare_with_reference(kernel, reference, q, k, v, **kwargs):
    torch.manual_seed(1)
    shape_out = q.shape[:3] + (v.shape[-1],)
    dout = torch.randn(shape_out, dtype=q.dtype).to(q.device)
    dlse = torch.randn(q.shape[:3]).to(q.device)
    out, lse, grads = outputs_and_grads(kernel, q, k, v, dout, dlse, **kwargs)
    out_ref, lse_ref, grads_ref = outputs_and_grads(reference, q, k, v, dout, dlse, **kwargs)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_matches(out, out_ref, q.dtype, "out")
    assert_matches(lse, lse_ref, q.dtype, "lse")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        assert_matches(g, g_ref, q.dtype, name)
    return out, lse


@dataclass(frozen=True)
class ExactCase:
    name: str
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool = False
    padded: bool = False
    transposed: bool = False  # non-contiguous q, k, v: views of a [B, T, H, D] tensor
    dtype: torch.dtype = torch.float32


EXACT_CASES = [
    ExactCase("d16-len37", 1, 2, 37, 37, 16),
    # Lengths that are block multiples and head_dim == BLOCK_D: every bounds mask is compiled out. One head each:
    # without a tail no row or column reaches past its head, and the other cases cover head and batch offsets.
    ExactCase("even-causal-q64-k48-d32", 1, 1, 64, 48, 32, causal=True),
    ExactCase("even-causal-padded-q32-k64-d16", 3, 1, 32, 64, 16, causal=True, padded=True),
    ExactCase("even-len48-d32", 1, 1, 48, 48, 32),
    ExactCase("causal-d32-len50", 1, 2, 50, 50, 32),
    ExactCase("cross-causal-q45-k30-d64", 2, 1, 45, 30, 64, causal=True),
    ExactCase("cross-causal-padded-q20-k45-d24", 3, 1, 20, 45, 24, causal=True, padded=True),
    # Strided views in both batch and heads; 17 queries are a block and a one-row tail.
    ExactCase("cross-padded-transposed-q17-k29-d24", 3, 2, 17, 29, 24, padded=True, transposed=True),
    ExactCase("bf16-causal-padded-len40-d32", 3, 1, 40, 40, 32, causal=True, padded=True, dtype=torch.bfloat16),
    ExactCase("fp16-padded-q24-k40-d16", 3, 1, 24, 40, 16, padded=True, dtype=torch.float16),
]


def case_params(cases: list, slow_dtype: torch.dtype) -> list:
    """`cases` as pytest params named by case, those in `slow_dtype` in the slow tier: a second dtype of a path
    the fast tier runs in another (the comment above each test says why that dtype)."""
    return [pytest.param(c, id=c.name, marks=pytest.mark.slow if c.dtype == slow_dtype else ()) for c in cases]


def make_exact_inputs(case: ExactCase):
    torch.manual_seed(0)
    seq_q, seq_k = case.seq_q * SEQ_SCALE, case.seq_k * SEQ_SCALE

    def tensor(seq: int) -> torch.Tensor:
        if case.transposed:
            x = torch.randn(case.batch, seq, case.heads, case.head_dim, dtype=case.dtype)
            return x.to(DEVICE).transpose(1, 2)
        return torch.randn(case.batch, case.heads, seq, case.head_dim, dtype=case.dtype).to(DEVICE)

    q, k, v = tensor(seq_q), tensor(seq_k), tensor(seq_k)
    mask = None
    if case.padded:
        # Batch 0: leading keys padded, so under causal the first queries see nothing (zeros, lse = -inf).
        # Batch 1: every key padded. Batch 2: trailing half padded.
        mask = torch.zeros(case.batch, seq_k, dtype=torch.bool)
        mask[0, :3] = True
        mask[1, :] = True
        mask[2, seq_k // 2 :] = True
        mask = mask.to(DEVICE)
    return q, k, v, mask


# fp16 is in the slow tier: the second half-precision dtype. bf16 stays: GPU runs train in it, the interpreter
# upcasts its products (_dot's DOT_UPCAST), and the casts to the inputs' dtype (P, dS, the stores) that fp16 would
# also exercise run in bf16 too.
@needs_triton
@pytest.mark.parametrize("case", case_params(EXACT_CASES, slow_dtype=torch.float16))
def test_flash_attention_matches_reference(case: ExactCase) -> None:
    q, k, v, mask = make_exact_inputs(case)
    assert q.is_contiguous() != case.transposed
    out, lse = compare_with_reference(
        flash_attention, exact_attention_reference, q, k, v, causal=case.causal, key_padding_mask=mask
    )
    empty = torch.isinf(lse)
    if case.padded:
        assert empty[1].all(), "a batch row whose keys are all padded must give lse = -inf"
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        assert not torch.isnan(out).any()


def test_lse_gradient_matches_derivation() -> None:
    """d(sum_i g_i lse_i)/dS_ij = g_i P_ij, so dq_i = scale g_i sum_j P_ij k_j, dk_j = scale sum_i g_i P_ij q_i
    and dv = 0: the dlse term of dS = P * (dP - delta + dlse) on its own (docs/kernels.md)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, dtype=torch.float64) for _ in range(3))
    g = torch.randn(1, 2, 9, dtype=torch.float64)
    scale = 0.3
    _, _, (dq, dk, dv) = outputs_and_grads(
        exact_attention_reference, q, k, v, torch.zeros_like(q), g, causal=True, scale=scale
    )
    s = scale * q @ k.transpose(-1, -2)
    s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    torch.testing.assert_close(dq, scale * (g[..., None] * p) @ k)
    torch.testing.assert_close(dk, scale * (g[..., None] * p).transpose(-1, -2) @ q)
    torch.testing.assert_close(dv, torch.zeros_like(v))


# Causal cases whose diagonal band crosses block edges in every way: n_q > n_k, n_q < n_k, lengths that are
# and are not block multiples, padding; run with BLOCK_M != BLOCK_N. A band that starts or ends one block
# late lets queries see later keys (or keeps keys from the queries that see them) and fails parity. One head
# each: the band is the same in every head (test_flash_attention_matches_reference covers the head offsets).
BAND_CASES = [
    ExactCase("causal-len70-d16", 1, 1, 70, 70, 16, causal=True),
    ExactCase("causal-q80-k48-d16", 1, 1, 80, 48, 16, causal=True),
    ExactCase("causal-padded-q40-k96-d16", 3, 1, 40, 96, 16, causal=True, padded=True),
    ExactCase("even-causal-q64-k96-d32", 1, 1, 64, 96, 32, causal=True),
    ExactCase("padded-q36-k50-d24", 3, 1, 36, 50, 24, padded=True),
]


@needs_triton
@pytest.mark.parametrize("blocks", UNEQUAL_BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("case", BAND_CASES, ids=lambda c: c.name)
def test_flash_attention_block_shapes_match_reference(case: ExactCase, blocks: tuple[int, int]) -> None:
    q, k, v, mask = make_exact_inputs(case)
    with fixed_launch_config(*blocks):
        assert tuned_launch_configs(q, k, case.causal)["bwd_dq"]["BLOCK_N"] == blocks[1]
        compare_with_reference(
            flash_attention, exact_attention_reference, q, k, v, causal=case.causal, key_padding_mask=mask
        )


def test_fixed_launch_config_rejects_blocks_tl_dot_cannot_take() -> None:
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"), fixed_launch_config(32, 24):
        pass


def expected_splits(n_q: int, n_k: int, causal: bool, block_m: int, block_n: int):
    """The loop ranges, as sets of block starts, written from their definition (the dense causal mask)
    rather than from the kernels' arithmetic. Key loop of query block m (rows m .. m + BLOCK_M - 1, tail
    rows included, as the kernel computes them): `full` = key blocks inside n_k that every row sees whole,
    `masked` = the other key blocks inside n_k that some row sees. Query loop of key block n: `band` = query
    blocks where some row sees part of the keys, `full` = rows that see them all inside n_q, `tail` = the
    block that does so past n_q."""

    def sees(row: int, key: int) -> bool:
        return not causal or key <= row

    key_loops = {}
    for m in range(0, n_q, block_m):
        rows = range(m, m + block_m)
        full, masked = set(), set()
        for n in range(0, n_k, block_n):
            keys = range(n, n + block_n)
            if n + block_n <= n_k and all(sees(r, j) for r in rows for j in keys):
                full.add(n)
            elif any(sees(r, j) for r in rows for j in keys if j < n_k):
                masked.add(n)
        key_loops[m] = (full, masked)
    query_loops = {}
    for n in range(0, n_k, block_n):
        keys = range(n, n + block_n)
        band, full, tail = set(), set(), set()
        for m in range(0, n_q, block_m):
            rows = range(m, m + block_m)
            if all(sees(r, j) for r in rows for j in keys):
                (full if m + block_m <= n_q else tail).add(m)
            elif any(sees(r, j) for r in rows for j in keys):
                band.add(m)
        query_loops[n] = (band, full, tail)
    return key_loops, query_loops


if HAS_TRITON:
    import triton
    import triton.language as tl

    from kernels.k_flash_attention import _key_split, _query_split

    @triton.jit
    def _split_probe(
        Out, Nq, Nk, n_shapes, n_blocks, CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SHAPES: tl.constexpr, BLOCKS: tl.constexpr,
    ):  # fmt: skip
        """The kernels' loop bounds for query block `block` and key block `block` of every (shape, block) at
        once, as an [SHAPES, BLOCKS] tile (powers of two, masked down to n_shapes x n_blocks). One program
        rather than one per pair: the boundary functions are elementwise arithmetic, so a tile of block starts
        gives each pair what a kernel's scalar program_id gives it, and the interpreter, which costs tens of
        milliseconds per program and per @triton.jit call, runs them once instead of ~500 times."""
        shape = tl.arange(0, SHAPES)[:, None]
        block = tl.arange(0, BLOCKS)[None, :]
        n_q = tl.load(Nq + shape, mask=shape < n_shapes, other=0)
        n_k = tl.load(Nk + shape, mask=shape < n_shapes, other=0)
        full_hi, hi = _key_split(block * BLOCK_M, n_k, CAUSAL, EVEN_N, BLOCK_M, BLOCK_N)
        band_lo, band_hi, q_full_hi = _query_split(block * BLOCK_N, n_q, CAUSAL, EVEN_M, BLOCK_M, BLOCK_N)
        # Bounds that do not depend on the block (or, without CAUSAL, are a constant) broadcast to the tile.
        tile = tl.zeros([SHAPES, BLOCKS], dtype=tl.int32)
        live = (shape < n_shapes) & (block < n_blocks)
        out = Out + (shape * n_blocks + block) * 5
        tl.store(out, full_hi + tile, mask=live)
        tl.store(out + 1, hi + tile, mask=live)
        tl.store(out + 2, band_lo + tile, mask=live)
        tl.store(out + 3, band_hi + tile, mask=live)
        tl.store(out + 4, q_full_hi + tile, mask=live)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_backward_delta_kernel(dtype: torch.dtype, with_dlse: bool) -> None:
    """The pre-processing kernel: rowsum(dO * O) - dlse in fp32, for strided dO, a tail of rows and a head
    dim below its power-of-two block."""
    torch.manual_seed(0)
    out = torch.randn(2, 3, 37, 24, dtype=dtype, device=DEVICE)
    dout = torch.randn(2, 37, 3, 24, dtype=dtype, device=DEVICE).transpose(1, 2)  # [B, H, M, D] view, strided
    dlse = torch.randn(2, 3, 37, device=DEVICE) if with_dlse else None
    expected = (dout.float() * out.float()).sum(-1) - (dlse if with_dlse else 0.0)
    delta = backward_delta(out, dout, dlse)
    assert delta.dtype == torch.float32 and delta.is_contiguous()
    torch.testing.assert_close(delta, expected, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32), (64, 16)], ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_loop_splits_are_tight(causal: bool, blocks: tuple[int, int]) -> None:
    """The kernels' unmasked and masked loop ranges are exactly the blocks that need no mask and the
    blocks that do: a band that starts or ends one block late fails here even where parity cannot see it
    (an extra masked block is slower, not wrong)."""
    block_m, block_n = blocks
    lengths = (1, 15, 16, 17, 32, 33, 48, 50, 64, 70)
    for even_m in (False, True):
        for even_n in (False, True):
            shapes = [
                (n_q, n_k) for n_q in lengths for n_k in lengths
                if (n_q % block_m == 0) == even_m and (n_k % block_n == 0) == even_n
            ]  # fmt: skip
            if not shapes:
                continue
            n_q_s = torch.tensor([s[0] for s in shapes], dtype=torch.int32, device=DEVICE)
            n_k_s = torch.tensor([s[1] for s in shapes], dtype=torch.int32, device=DEVICE)
            n_blocks = max(max(-(-n_q // block_m), -(-n_k // block_n)) for n_q, n_k in shapes)
            out = torch.full((len(shapes), n_blocks, 5), -1, dtype=torch.int32, device=DEVICE)
            _split_probe[(1,)](
                out, n_q_s, n_k_s, len(shapes), n_blocks, CAUSAL=causal, EVEN_M=even_m, EVEN_N=even_n,
                BLOCK_M=block_m, BLOCK_N=block_n, SHAPES=triton.next_power_of_2(len(shapes)),
                BLOCKS=triton.next_power_of_2(n_blocks),
            )
            out = out.cpu().tolist()
            for (n_q, n_k), bounds in zip(shapes, out):
                key_loops, query_loops = expected_splits(n_q, n_k, causal, block_m, block_n)
                where = f"n_q={n_q} n_k={n_k}"
                for m, (full, masked) in key_loops.items():
                    full_hi, hi = bounds[m // block_m][:2]
                    assert set(range(0, full_hi, block_n)) == full, f"{where} query block {m}: unmasked keys"
                    assert set(range(full_hi, hi, block_n)) == masked, f"{where} query block {m}: masked keys"
                for n, (band, full, tail) in query_loops.items():
                    band_lo, band_hi, q_full_hi = bounds[n // block_n][2:]
                    got_band = set(range(band_lo, band_hi, block_m)) if causal else set()
                    assert got_band == band, f"{where} key block {n}: causal band"
                    assert set(range(band_hi, q_full_hi, block_m)) == full, f"{where} key block {n}: unmasked"
                    got_tail = set(range(max(band_hi, q_full_hi), n_q, block_m)) if not even_m else set()
                    assert got_tail == tail, f"{where} key block {n}: query tail"


@needs_triton
@pytest.mark.autotuned
def test_autotuned_launch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA launch path: triton.autotune over the heuristics-wrapped kernels, grids that follow the
    tuned block sizes, the backward tuned on its own, and tuned_launch_configs reading the tuner's cache.
    Without a GPU it runs under the interpreter with a stand-in timer that ranks later candidates faster,
    over three small candidates (the first, the fallback, is pruned away)."""
    from kernels import k_flash_attention as kf

    flash_module = sys.modules["kernels.flash_attention"]
    timings = iter(range(1000, 0, -1))

    def later_is_faster(kernel_call, quantiles):
        kernel_call()
        t = float(next(timings))
        return [t, t, t]

    def config(block_m: int, block_n: int):
        return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=4, num_stages=2)

    winners = {"fwd": (32, 16), "bwd_dkdv": (16, 32), "bwd_dq": (32, 16)}
    for name, winner in winners.items():
        candidates = [config(16, 16), config(16, 16), config(*winner)]
        plain = getattr(kf, f"_flash_{name}")
        monkeypatch.setattr(kf, f"_flash_{name}_tuned", kf.autotuned(name, plain, candidates, later_is_faster))
    monkeypatch.setattr(flash_module, "autotune_enabled", lambda: True)

    case = ExactCase("causal-padded-q40-k50-d24", 3, 1, 40, 50, 24, causal=True, padded=True)
    q, k, v, mask = make_exact_inputs(case)
    assert all(c is None for c in tuned_launch_configs(q, k, True, mask).values())
    compare_with_reference(flash_attention, exact_attention_reference, q, k, v, causal=True, key_padding_mask=mask)
    chosen = tuned_launch_configs(q, k, True, mask)
    for name, (block_m, block_n) in winners.items():
        assert chosen[name] == {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}, name
    # Lengths in the same power-of-two octave share the tuning; no padding mask is another key.
    q2, k2 = q[:, :, : 33 * SEQ_SCALE], k[:, :, : 63 * SEQ_SCALE]
    assert tuned_launch_configs(q2, k2, True, mask) == chosen
    assert tuned_launch_configs(q, k, True)["fwd"] is None


@needs_triton
def test_flash_attention_gradient_through_lse_only() -> None:
    """Only lse feeds the loss: the backward receives dout = None and must still give dq, dk (and dv = 0)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 21 * SEQ_SCALE, 16).to(DEVICE).requires_grad_() for _ in range(3))
    g = torch.randn(1, 1, 21 * SEQ_SCALE).to(DEVICE)
    grads = torch.autograd.grad((flash_attention(q, k, v, causal=True)[1] * g).sum(), (q, k, v))
    loss_ref = (exact_attention_reference(q, k, v, causal=True)[1] * g).sum()
    dq_ref, dk_ref = torch.autograd.grad(loss_ref, (q, k))  # lse does not depend on v
    assert_matches(grads[0], dq_ref, torch.float32, "dq")
    assert_matches(grads[1], dk_ref, torch.float32, "dk")
    assert torch.equal(grads[2], torch.zeros_like(v))


@needs_triton
def test_pieces_write_and_read_the_sequences_row_statistics() -> None:
    """stat_pieces = P: batch rows that are P consecutive pieces of B / P sequences (HyperAttention's causal pieces)
    write lse into, and read lse and delta from, the sequences' own [B / P, H, P * n] rows: bitwise the values of
    the pieces' [B, H, n] rows moved there, in the forward and in both backward kernels."""
    from kernels.flash_attention import _backward, _current_fixed_config, _forward

    B, P, H, n = 2, 3, 2, 21 * SEQ_SCALE  # a query tail: masked stores and loads of the statistics
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(B * P, H, n, 16, generator=gen).to(DEVICE) for _ in range(4))
    cfg, scale = _current_fixed_config(), 0.25

    def as_sequences(x):  # [B * P, H, n] -> [B, H, P * n]
        return x.view(B, P, H, n).transpose(1, 2).reshape(B, H, P * n)

    out, lse = _forward(q, k, v, True, None, scale, cfg)
    out_p, lse_p = _forward(q, k, v, True, None, scale, cfg, stat_pieces=P)
    assert lse_p.shape == (B, H, P * n) and torch.equal(lse_p, as_sequences(lse)) and torch.equal(out_p, out)
    delta = backward_delta(out, dout, None)
    grads = _backward(q, k, v, out, lse, dout, None, True, None, scale, cfg, delta=delta)
    grads_p = _backward(q, k, v, out, lse_p, dout, None, True, None, scale, cfg, delta=as_sequences(delta),
                        stat_pieces=P)
    for name, got, want in zip(("dq", "dk", "dv"), grads_p, grads):
        assert torch.equal(got, want), name
    with pytest.raises(ValueError, match="not whole sequences of stat_pieces=4"):
        _forward(q, k, v, True, None, scale, cfg, stat_pieces=4)
    with pytest.raises(ValueError, match="needs the sequences' delta"):
        _backward(q, k, v, out, lse_p, dout, None, True, None, scale, cfg, stat_pieces=P)


# ---- chunked attention -------------------------------------------------------------------------------------


def dense_chunked_oracle(q, k, v, chunk, lookback, positions, causal, self_mask, key_padding_mask, wrap):
    """The chunked-attention rule written as one dense T x T mask, independent of the references' gathers."""
    seq = q.shape[2]
    n_chunks = math.ceil(seq / chunk)
    chunk_of = torch.arange(seq) // chunk
    visible = torch.zeros(seq, seq, dtype=torch.bool)
    for c in range(n_chunks):
        for look in range(min(lookback, n_chunks - 1) + 1):
            kc = c - look
            if wrap:
                kc %= n_chunks
            if kc >= 0:
                visible |= (chunk_of[:, None] == c) & (chunk_of[None, :] == kc)
    qpos, kpos = positions[..., :, None], positions[..., None, :]
    masked = ~visible | key_padding_mask[:, None, None, :]
    if causal:
        masked = masked | (kpos > qpos)
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if self_mask:
        s = torch.where(kpos == qpos, torch.full_like(s, SELF_LOGIT), s)
    s = s.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v.double(), lse


@dataclass(frozen=True)
class ChunkedCase:
    name: str
    seq: int
    chunk: int
    lookback: int = 1
    wrap: bool = True
    causal: bool = False
    self_mask: bool = False
    padded: bool = False
    permuted: bool = False  # positions: a random permutation per head, as after an LSH sort
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    heads: int = 2


# Three chunks are the fewest where wrapping matters on its own: chunk 0's look-back is chunk 2, not its
# forward neighbour chunk 1 (with two chunks both are the same chunk). The interpreter's cost grows with
# chunks x blocks per chunk x look-backs x heads, so the cases of several chunks keep to three or four.
CHUNKED_CASES = [
    # Chunks shorter than a block: one block per chunk, its rows past the chunk masked. One head, as the next
    # case: nowrap-lookback2 and single-chunk run two, for the head offsets.
    ChunkedCase("wrap-len24-chunk8", 24, 8, heads=1),
    # Chunks longer than a block (two blocks per chunk, the second partial) and a tail chunk of 10.
    ChunkedCase("lsh-causal-self-permuted-tail-len50-chunk20", 50, 20, causal=True, self_mask=True,
                padded=True, permuted=True, heads=1),
    # Four chunks, so that a look-back of 2 stops short of chunk 0 from chunk 3; a tail chunk of 2.
    ChunkedCase("nowrap-lookback2-causal-padded-d32", 50, 16, lookback=2, wrap=False, causal=True,
                self_mask=True, padded=True, permuted=True, head_dim=32),
    ChunkedCase("single-chunk-self-d24", 20, 32, self_mask=True, head_dim=24),
    ChunkedCase("bf16-lsh-causal-self", 40, 16, causal=True, self_mask=True, permuted=True,
                dtype=torch.bfloat16),
]  # fmt: skip


def make_chunked_inputs(case: ChunkedCase, batch: int = 2, device: str | torch.device = "cpu", scale: int = 1):
    """Inputs of a chunked case on `device`, with its sequence and chunk `scale` times longer."""
    torch.manual_seed(0)
    seq, heads = case.seq * scale, case.heads
    q, k, v = (torch.randn(batch, heads, seq, case.head_dim, dtype=case.dtype).to(device) for _ in range(3))
    positions = None
    if case.permuted:
        positions = torch.stack([torch.randperm(seq) for _ in range(batch * heads)]).view(batch, heads, -1)
        positions = positions.to(device)
    mask = None
    if case.padded:
        mask = torch.zeros(batch, seq, dtype=torch.bool)
        mask[0, :5] = True
        mask[1, seq // 2 :] = True
        mask = mask.to(device)
    kwargs = dict(
        chunk=case.chunk * scale, lookback=case.lookback, positions=positions, causal=case.causal,
        self_mask=case.self_mask, key_padding_mask=mask, wrap=case.wrap,
    )  # fmt: skip
    return q, k, v, kwargs


@pytest.mark.parametrize("case", [c for c in CHUNKED_CASES if c.dtype == torch.float32], ids=lambda c: c.name)
def test_chunked_reference_matches_dense_oracle(case: ChunkedCase) -> None:
    q, k, v, kwargs = make_chunked_inputs(case)
    out, lse = chunked_attention_reference(q, k, v, **kwargs)
    positions = kwargs["positions"]
    if positions is None:
        positions = torch.arange(case.seq).expand(*q.shape[:3])
    mask = kwargs["key_padding_mask"]
    if mask is None:
        mask = torch.zeros(q.shape[0], case.seq, dtype=torch.bool)
    oracle_kwargs = {**kwargs, "positions": positions, "key_padding_mask": mask}
    out_dense, lse_dense = dense_chunked_oracle(q, k, v, **oracle_kwargs)
    assert_matches(out, out_dense, torch.float32, "out")
    assert_matches(lse, lse_dense, torch.float32, "lse")


# bf16 is in the slow tier: a second dtype of the fp32 cases' path. The bf16 products the interpreter upcasts
# (_dot's DOT_UPCAST, shared with the exact kernels) stay in the fast tier through bf16-causal-padded-len40-d32.
@needs_triton
@pytest.mark.parametrize("case", case_params(CHUNKED_CASES, slow_dtype=torch.bfloat16))
def test_chunked_flash_attention_matches_reference(case: ChunkedCase) -> None:
    q, k, v, kwargs = make_chunked_inputs(case, device=DEVICE, scale=SEQ_SCALE)
    compare_with_reference(chunked_flash_attention, chunked_attention_reference, q, k, v, **kwargs)


def test_chunk_neighbours_wrap_and_dedupe() -> None:
    assert chunk_neighbours(4, 1, wrap=True).tolist() == [[0, 3], [1, 0], [2, 1], [3, 2]]
    assert chunk_neighbours(4, 2, wrap=False).tolist() == [[0, -1, -1], [1, 0, -1], [2, 1, 0], [3, 2, 1]]
    # Looking back further than the sequence visits each chunk once, not twice.
    assert chunk_neighbours(2, 5, wrap=True).tolist() == [[0, 1], [1, 0]]


def test_self_mask_used_only_when_nothing_else_is_visible() -> None:
    """Causal over positions in order: query 0 sees only itself, so it takes v_0 with lse = SELF_LOGIT;
    query 1 sees key 0 and itself, and gives itself (almost) no weight."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 8, 16) for _ in range(3))
    out, lse = chunked_attention_reference(q, k, v, chunk=4, causal=True, self_mask=True, wrap=False)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])
    assert lse[0, 0, 0].item() == pytest.approx(SELF_LOGIT)
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, 0])
    assert torch.isfinite(lse).all()


# ---- dispatch and input checks ------------------------------------------------------------------------------


def test_dispatch_on_cpu_blockwise_for_large_inputs_reference_for_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTN_BACKEND", raising=False)
    torch.manual_seed(0)
    q = torch.randn(1, 2, 10, 16)
    assert select_backend(q, q, q).name == "reference"
    out, lse = exact_attention(q, q, q, causal=True)
    out_ref, lse_ref = exact_attention_reference(q, q, q, causal=True)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    out, _ = chunked_attention(q, q, q, 4, self_mask=True)
    assert torch.equal(out, chunked_attention_reference(q, q, q, 4, self_mask=True)[0])
    # Past one block of logits (B * H * M * N > 2^22) the dense probabilities would be kept for autograd.
    big_q, big_k = torch.empty(1, 16, 1100, 16), torch.empty(1, 16, 1000, 16)
    assert select_backend(big_q, big_k, big_k).name == "blockwise"
    assert select_backend(big_q, big_k, big_k, dropout_p=0.1).name == "reference"
    monkeypatch.setenv("ATTN_BACKEND", "blockwise")
    out, lse = exact_attention(q, q, q, causal=True)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(lse, lse_ref)


def test_dropout_goes_to_the_reference_and_keeps_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    """lse stays the undropped normaliser, so attention parts still merge with the right weights."""
    monkeypatch.delenv("ATTN_BACKEND", raising=False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 16) for _ in range(3))
    for fn, kwargs in ((exact_attention, {"causal": True}), (chunked_attention, {"chunk": 4})):
        args = (q, k, v, kwargs.pop("chunk")) if "chunk" in kwargs else (q, k, v)
        out, lse = fn(*args, **kwargs)
        out_drop, lse_drop = fn(*args, dropout_p=0.5, **kwargs)
        assert torch.equal(lse, lse_drop)
        assert not torch.allclose(out, out_drop)


@needs_triton
def test_dispatch_forced_triton_runs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTN_BACKEND", "triton")
    q = torch.randn(1, 1, 20, 16).to(DEVICE)
    assert select_backend(q, q, q).name == "triton"
    out, lse = exact_attention(q, q, q, causal=True)
    assert_matches(lse, exact_attention_reference(q, q, q, causal=True)[1], torch.float32, "lse")
    out, lse = chunked_attention(q, q, q, 8, causal=True, self_mask=True)
    assert_matches(out, chunked_attention_reference(q, q, q, 8, causal=True, self_mask=True)[0], torch.float32, "out")


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="the Triton interpreter's scalars; a GPU run compiles")
def test_interpreted_loops_over_tensor_bounds_under_triton_3_6s_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """triton 3.6's interpreter defined a scalar's `__index__` as `int(self.handle.data)` on a one-element 1-D
    array, which NumPy 2 refuses: every kernel's `range(lo, hi, BLOCK_N)` over in-kernel bounds raised
    "only 0-dimensional arrays can be converted to Python scalars" (the first H100 machine's dry run). Here the
    installed interpreter is given 3.6's definition: the kernel fails without kernels/interpreter_compat.py's
    repair and matches the reference with it; the installed (fixed) interpreter is left alone."""
    import numpy as np
    from triton.runtime import interpreter

    from kernels import interpreter_compat

    fa = sys.modules["kernels.flash_attention"]  # the module (the package binds the function to the name)

    installed = interpreter._patch_lang_tensor
    assert not interpreter_compat.needs_repair(inspect.getsource(installed))  # this triton's own is fine

    def triton_3_6_patch_lang_tensor(tensor, scope):
        installed(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))  # triton 3.6, interpreter.py

    assert interpreter_compat.needs_repair(inspect.getsource(triton_3_6_patch_lang_tensor))
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", triton_3_6_patch_lang_tensor)
    q, k, v = (torch.randn(1, 1, 20, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    try:
        int(np.array([1]))
        numpy_refuses = False
    except TypeError:
        numpy_refuses = True
    if numpy_refuses:  # the break itself, with this NumPy
        monkeypatch.setattr(fa, "repair_index", lambda: False)
        with pytest.raises(Exception, match="only 0-dimensional arrays can be converted to Python scalars"):
            flash_attention(q, k, v, causal=True)
        monkeypatch.undo()
        monkeypatch.setattr(interpreter, "_patch_lang_tensor", triton_3_6_patch_lang_tensor)
    out, _ = flash_attention(q, k, v, causal=True)  # jit_module repairs the 3.6 definition
    assert interpreter._patch_lang_tensor is not triton_3_6_patch_lang_tensor
    assert_matches(out, exact_attention_reference(q, k, v, causal=True)[0], torch.float32, "out")


def test_dispatch_errors_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 1, 8, 8)
    monkeypatch.setenv("ATTN_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="valid names: triton, blockwise, reference"):
        exact_attention(q, q, q)
    monkeypatch.setenv("ATTN_BACKEND", "triton")
    with pytest.raises(NotImplementedError, match=r"triton: .*head_dim 8 outside 16\.\.128"):
        exact_attention(q, q, q)
    q16 = torch.randn(1, 1, 8, 16)
    with pytest.raises(NotImplementedError, match=r"triton: .*no attention dropout \(dropout_p=0.1\)"):
        chunked_attention(q16, q16, q16, 4, dropout_p=0.1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        exact_attention(torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(q=torch.randn(1, 8, 2, 16), k=torch.randn(1, 2, 8, 16)), "must agree on batch, heads and head_dim"),
        (dict(key_padding_mask=torch.zeros(1, 8)), "key_padding_mask must be bool"),
        (dict(v=torch.randn(1, 2, 8, 16, dtype=torch.float64)), "must have the same shape|share a dtype"),
    ],
    ids=["wrong-layout", "float-mask", "mixed-dtype"],
)
def test_exact_attention_rejects_bad_inputs(bad: dict, message: str) -> None:
    args = dict(q=torch.randn(1, 2, 8, 16), k=torch.randn(1, 2, 8, 16), v=torch.randn(1, 2, 8, 16))
    args.update(bad)
    mask = args.pop("key_padding_mask", None)
    with pytest.raises(ValueError, match=message):
        exact_attention(args["q"], args["k"], args["v"], key_padding_mask=mask)


def test_chunked_attention_rejects_bad_arguments() -> None:
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_attention(q, q, q, 0)
    with pytest.raises(ValueError, match="positions must be"):
        chunked_attention(q, q, q, 4, positions=torch.zeros(1, 3, 8, dtype=torch.long))


# Compiles every kernel for GPUs with Triton's bundled ptxas, no GPU needed: the interpreter runs the kernels
# as Python and so misses errors only the compiler sees (types across branches, layouts, shared-memory
# limits). Arguments are specialised as a launch on contiguous tensors specialises them (head-dim strides of
# 1 become constants, pointers and other strides divisible by 16), without which Triton does not pipeline the
# loads and the shared memory checked would be a single stage's. Checked: each flash kernel at the largest
# candidate that prune_configs keeps on an H100/H200 (sm_90) at head dim 128, bf16, against the limit and
# against shared_memory_estimate (which must bound the compiler's figure); each flash kernel with the
# opposite masking constexprs on an A100 (sm_80), same check; the chunked kernels, LSH's hash and layout and
# HyperAttention's blocks + samples, SimHash ranks and causal levels' placement and tables, and LSH's unit keys
# on sm_90.
# Runs in a fresh process because this one has TRITON_INTERPRET=1.
_COMPILE_SCRIPT = """
import os
os.environ.pop("TRITON_INTERPRET", None)
from kernels import k_chunked_attention, k_flash_attention as kf, k_hyper_blocks, k_lsh_hash, k_lsh_layout, k_merge_rounds
from kernels import k_hyper_placement, k_simhash, k_unit_rows
from kernels.offline_compile import shared_memory as compile_shared

flash = {"fwd": kf._flash_fwd, "bwd_dkdv": kf._flash_bwd_dkdv, "bwd_dq": kf._flash_bwd_dq}
base = dict(DOT_PRECISION="tf32", DOT_UPCAST=False, BLOCK_D=128)
for arch, masks in ((90, dict(CAUSAL=True, HAS_KPM=False, EVEN_M=True, EVEN_N=True, EVEN_D=True)),
                    (80, dict(CAUSAL=False, HAS_KPM=True, EVEN_M=False, EVEN_N=False, EVEN_D=False))):
    limit = kf.SHARED_MEMORY_BY_ARCH[arch]
    for name, fn in flash.items():
        def estimate(c):
            return kf.shared_memory_estimate(name, {**c.kwargs, "num_stages": c.num_stages}, 128, 2)
        kept = kf.prune_configs(name, kf.CONFIGS[name], 128, 2, limit)
        cfg = max(kept, key=estimate) if arch == 90 else kf.CONFIGS[name][1]
        shared = compile_shared(fn, {**base, **masks, **cfg.kwargs}, cfg.num_warps, cfg.num_stages, arch)
        assert shared <= min(limit, estimate(cfg)), (name, arch, str(cfg), shared, estimate(cfg), limit)
        print(name, f"sm_{arch}", str(cfg), "shared", shared, "estimate", estimate(cfg), "compiled")
common = dict(HAS_KPM=True, DOT_PRECISION="tf32", DOT_UPCAST=False, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64,
              WRAP=True, CAUSAL=True, SELF_MASK=True, HAS_POS=True, INDEXED=True)  # LSH's index-loaded layout
for fn in (k_chunked_attention._chunked_fwd, k_chunked_attention._chunked_bwd_dkdv,
           k_chunked_attention._chunked_bwd_dq):
    shared = compile_shared(fn, common, 4, 2, 90)
    assert shared <= kf.SHARED_MEMORY_BY_ARCH[90], (fn.__name__, shared)
    print(fn.__name__, "compiled")
cfg = k_lsh_hash.launch_config(interpret=False)
hash_args = dict(BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], BLOCK_E=64, DOT_PRECISION="tf32", DOT_UPCAST=False,
                 ROUND_TO_INPUT=True)
for per_row in (True, False):  # each row's half count loaded, or the rotation's width for every row
    shared = compile_shared(k_lsh_hash._angular_hash, {**hash_args, "HALF_PER_ROW": per_row}, cfg["num_warps"],
                            cfg["num_stages"], 90)
    assert shared <= kf.SHARED_MEMORY_BY_ARCH[90], ("_angular_hash", shared)
    print("_angular_hash", "compiled")
cfg = k_lsh_layout.launch_config(interpret=False)
shared = compile_shared(k_lsh_layout._bucket_layout, {"BLOCK": cfg["BLOCK"]}, cfg["num_warps"], 1, 90)
assert shared <= kf.SHARED_MEMORY_BY_ARCH[90], ("_bucket_layout", shared)
print("_bucket_layout", "compiled")
cfg = k_hyper_blocks.launch_config(64, 2, 256, interpret=False)
hyper_args = dict(HAS_KPM=True, DOT_PRECISION="tf32", DOT_UPCAST=False, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  BLOCK_D=64)
for fn in (k_hyper_blocks._hyper_fwd, k_hyper_blocks._hyper_bwd_dq, k_hyper_blocks._hyper_bwd_samples,
           k_hyper_blocks._hyper_bwd_dkdv):
    extra = {"BLOCK_S": cfg["BLOCK_S"]} if "BLOCK_S" in fn.arg_names else {}
    # The causal recursion's variants (kernels/hyper_levels.py): merging into stored parts, adding gradients.
    extra.update({flag: True for flag in ("MERGE", "ACCUMULATE") if flag in fn.arg_names})
    shared = compile_shared(fn, {**hyper_args, **extra}, cfg["num_warps"], cfg["num_stages"], 90)
    assert shared <= kf.SHARED_MEMORY_BY_ARCH[90], (fn.__name__, shared)
    print(fn.__name__, "compiled")
cfg = k_merge_rounds.launch_config(interpret=False)
# The backward with and without the merged lse's gradient (LSH's layer leaves its lse unused: no gradient).
for fn, extra in ((k_merge_rounds._merge_rounds_fwd, {"R": 4}), (k_merge_rounds._merge_rounds_bwd,
                   {"R": 4, "HAS_G_LSE": True}), (k_merge_rounds._merge_rounds_bwd, {"R": 4, "HAS_G_LSE": False}),
                  (k_merge_rounds._merge_below_fwd, {}), (k_merge_rounds._merge_below_bwd, {"HAS_G_LSE": True}),
                  (k_merge_rounds._merge_below_bwd, {"HAS_G_LSE": False})):
    shared = compile_shared(fn, {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_E": 64, **extra}, cfg["num_warps"], 1, 90)
    assert shared <= kf.SHARED_MEMORY_BY_ARCH[90], (fn.__name__, shared)
    print(fn.__name__, "compiled")
cfg = k_simhash.launch_config(interpret=False)
simhash_args = dict(BLOCK_T=cfg["BLOCK_T"], BLOCK_E=64, BLOCK_R=16, DOT_PRECISION="tf32", DOT_UPCAST=False,
                    ROUND_TO_INPUT=True)
shared = compile_shared(k_simhash._simhash_rank, simhash_args, cfg["num_warps"], cfg["num_stages"], 90)
assert shared <= kf.SHARED_MEMORY_BY_ARCH[90], ("_simhash_rank", shared)
print("_simhash_rank", "compiled")
cfg = k_hyper_placement.launch_config(interpret=False)
for fn in (k_hyper_placement._stacked_keys, k_hyper_placement._routed_blocks, k_hyper_placement._level_positions):
    shared = compile_shared(fn, {"BLOCK": cfg["BLOCK"]}, cfg["num_warps"], 1, 90)
    assert shared <= kf.SHARED_MEMORY_BY_ARCH[90], (fn.__name__, shared)
    print(fn.__name__, "compiled")
cfg = k_hyper_placement.tables_config(interpret=False, samples=256)
for shared_draws, diagonal in ((False, False), (True, False), (False, True)):  # training's draws (the bit
    # reversal), evaluation's, and the non-causal layer's groups written by the kernel
    tables_args = dict(SHARED=shared_draws, HAS_SAMPLES=True, DIAGONAL=diagonal,
                       **{k: v for k, v in cfg.items() if k != "num_warps"})
    shared = compile_shared(k_hyper_placement._level_tables, tables_args, cfg["num_warps"], 1, 90)
    assert shared <= kf.SHARED_MEMORY_BY_ARCH[90], ("_level_tables", shared)
    print("_level_tables", "compiled")
cfg = k_unit_rows.launch_config(interpret=False)
for fn in (k_unit_rows._unit_rows_fwd, k_unit_rows._unit_rows_bwd):
    shared = compile_shared(fn, {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_E": 64}, cfg["num_warps"], 1, 90)
    assert shared <= kf.SHARED_MEMORY_BY_ARCH[90], (fn.__name__, shared)
    print(fn.__name__, "compiled")
"""


@needs_triton
@pytest.mark.slow
def test_kernels_compile_for_gpu() -> None:
    stdout = run_gpu_compile_script(_COMPILE_SCRIPT, timeout=900)
    assert stdout.count("compiled") == 31, stdout


def test_shared_memory_pruning_keeps_a_config_that_fits() -> None:
    """Every supported (head dim, dtype) keeps at least one candidate per kernel, within the device's shared
    memory by the estimate, on A100 (163 KB), sm_86/89 (99 KB) and H100/H200 (227 KB); and the largest
    tiles survive where they fit (128 x 128, 3 stages, on sm_90 at head dim 128 in bf16)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from kernels import k_flash_attention as kf

    for name, configs in kf.CONFIGS.items():
        for limit in kf.SHARED_MEMORY_BY_ARCH.values():
            for block_d in (16, 32, 64, 128):
                for elem_bytes in (2, 4):
                    kept = kf.prune_configs(name, configs, block_d, elem_bytes, limit)
                    assert kept, (name, limit, block_d, elem_bytes)
                    for c in kept:
                        cfg = {**c.kwargs, "num_stages": c.num_stages}
                        assert kf.shared_memory_estimate(name, cfg, block_d, elem_bytes) <= limit, (name, str(c))
    kept = kf.prune_configs("fwd", kf.CONFIGS["fwd"], 128, 2, kf.SHARED_MEMORY_BY_ARCH[90])
    assert any(c.kwargs == {"BLOCK_M": 128, "BLOCK_N": 128} and c.num_stages == 3 for c in kept)


def test_the_estimate_bounds_every_recorded_compile() -> None:
    """`shared_memory_estimate` against the shared memory the compiler allocated for every flash candidate, as
    benchmarks/methods/kernel_shared_memory.py recorded it with each Triton a GPU may bring (3.6, the GPU image's,
    and 3.9, CI's; sm_90 and sm_80). The estimate, recomputed now, must bound each: a candidate that
    `prune_configs` keeps but that needs more than the device has fails at launch."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    import csv

    from kernels import k_flash_attention as kf

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cpu-2core" / "kernel_shared_memory.csv"
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {r["triton"].rsplit(".", 1)[0] for r in rows} >= {"3.6", "3.9"}, sorted({r["triton"] for r in rows})
    over = []
    for r in rows:
        cfg = {"BLOCK_M": int(r["block_m"]), "BLOCK_N": int(r["block_n"]), "num_stages": int(r["num_stages"])}
        estimate = kf.shared_memory_estimate(r["kernel"], cfg, int(r["head_dim"]), 2)
        if int(r["compiler_bytes"]) > estimate:
            over.append((r["triton"], r["kernel"], r["arch"], r["head_dim"], cfg, int(r["compiler_bytes"]), estimate))
    assert len(rows) >= 152 and not over, over


@pytest.mark.slow
def test_import_needs_neither_triton_nor_cuda() -> None:
    """With triton hidden, `import kernels` works and dispatch falls back to the reference."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "q = torch.randn(1, 1, 5, 16)\n"
        "assert kernels.select_backend(q, q, q).name == 'reference'\n"
        "out, lse = kernels.exact_attention(q, q, q, causal=True)\n"
        "assert out.shape == q.shape and lse.shape == (1, 1, 5)\n"
    )
    env = {**os.environ, "ATTN_BACKEND": ""}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120
    )
    assert result.returncode == 0, result.stderr
