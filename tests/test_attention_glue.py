"""The CPU proxies of benchmarks/methods/attention_glue.py: the op counter counts what it says, and the stand-in for the
Triton kernels (kernels.dispatch.stand_in_kernels) allocates and launches what the real kernels do under the
interpreter, at tiny shapes."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first launch imports the @triton.jit modules

import importlib.util  # noqa: E402
from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from benchmarks.methods.attention_glue import GlueCounter, run_case  # noqa: E402
from kernels import stand_in  # noqa: E402
from kernels.chunked_attention import chunked_flash_attention  # noqa: E402
from kernels.dispatch import select_backend, stand_in_kernels  # noqa: E402
from kernels.flash_attention import flash_attention  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_counter_counts_a_known_op_sequence() -> None:
    with FakeTensorMode():
        a = torch.ones(4, 8)  # 128 bytes, a fill: one launch
        with GlueCounter() as counter:
            b = a + 1  # new 128 bytes, one launch
            b.view(32)  # a view: nothing
            b.t().contiguous()  # the transpose is a view; contiguous copies: 128 bytes, one launch
            b.add_(1)  # in place: a launch, no new bytes
            torch.empty(2, 8)  # an allocation: 64 bytes, no launch
            b.reshape(2, 16)  # contiguous: a view
    assert (counter.glue_launches, counter.glue_bytes) == (3, 128 + 128 + 64)
    assert counter.ops == {"add": 1, "clone": 1, "add_": 1}
    assert (counter.kernel_ops, counter.kernel_bytes) == (0, 0)


def test_counter_attributes_a_kernels_buffers_to_the_kernel() -> None:
    log = stand_in.KernelLog()
    with FakeTensorMode(), GlueCounter() as counter, stand_in.installed(log):
        x = torch.zeros(3, 4)  # glue: a launch and 48 bytes
        with stand_in.kernel_region(log):
            torch.empty_like(x)  # the kernel's output buffer: 48 bytes, no launch
            stand_in.launch("k", lambda: pytest.fail("a stood-in launch must not run"))
    assert (counter.glue_launches, counter.glue_bytes, counter.kernel_bytes) == (1, 48, 48)
    assert log.launches == Counter({"k": 1}) and log.depth == 0
    # Glue inside a kernel's Function (the chunked backward's rounds sum into a buffer it allocates): its buffer's
    # bytes are the glue's, as a sum that allocates its own output charges them there.
    with FakeTensorMode(), GlueCounter() as counter, stand_in.installed(log):
        with stand_in.kernel_region(log):
            parts = torch.empty(2, 3, 4)
            with stand_in.glue_inside_kernel():
                torch.sum(parts, dim=0, out=torch.empty(3, 4))
            assert log.depth == 1
    assert (counter.glue_launches, counter.glue_bytes, counter.kernel_bytes) == (1, 48, 96)


def test_the_rounds_merge_hands_heads_to_the_output_projection_without_copies() -> None:
    """LSH's merged heads [B, H, T, E] come out laid out [B, T, H, E], so a layer's output projection reads them as
    [B, T, H * E] without a copy, and the gradient it hands back in that layout is read as it is: the forward and
    the backward make no copy (each did before: a clone of the merged heads, and one of their gradient)."""
    from kernels.merge_rounds import merge_rounds

    B, H, R, T, E = 1, 2, 3, 8, 16
    log = stand_in.KernelLog()
    with FakeTensorMode(), GlueCounter() as counter, stand_in.installed(log):
        out_R = torch.randn(B, H, R, T, E, requires_grad=True)
        lse_R = torch.randn(B, H, R, T, requires_grad=True)
        merged, _ = merge_rounds(out_R, lse_R, dim=2)
        assert merged.shape == (B, H, T, E) and merged.transpose(1, 2).is_contiguous()
        g_BTD = torch.randn(B, T, H * E)  # the output projection's gradient: [B, T, D], contiguous
        merged.transpose(1, 2).reshape(B, T, H * E).backward(g_BTD)
    assert counter.ops == {"randn": 3}, counter.ops  # the inputs'; nothing of the merge's
    assert log.launches == Counter({"merge_rounds_fwd": 1, "merge_rounds_bwd": 1})


def test_stand_in_only_inside_its_context() -> None:
    q = torch.randn(1, 1, 8, 16)
    assert select_backend(q, q, q).name != "stand-in"
    with stand_in_kernels():
        assert select_backend(q, q, q).name == "stand-in"
        # What the Triton kernels refuse goes down the priority list, as on a GPU.
        q8 = torch.randn(1, 1, 8, 8)
        assert select_backend(q8, q8, q8).name != "stand-in"


def _run(fn, fake: bool):
    """forward + backward of `fn` on tiny inputs, fake under the stand-in or real under the interpreter (the kernels
    launched and counted): the launches by name, the bytes of the kernels' buffers, the outputs' and gradients'
    shapes and dtypes."""
    with FakeTensorMode() if fake else torch.device("cpu"):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 24, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        log = stand_in.KernelLog(run_kernels=not fake)
        with stand_in.installed(log), GlueCounter() as counter:
            out, lse = fn(q, k, v)
            (out.float().sum() + lse.sum()).backward()
        meta = [(tuple(t.shape), t.dtype) for t in (out, lse, q.grad, k.grad, v.grad)]
    return log.launches, counter.kernel_bytes, meta


# The flash case in the slow tier: a second kernel family through the same launch hook (about 5 s under the
# interpreter each).
@needs_triton
@pytest.mark.parametrize("which", [pytest.param("flash", marks=pytest.mark.slow), "chunked"])
def test_stand_in_allocates_and_launches_as_the_kernels(which: str) -> None:
    fn = {"flash": lambda q, k, v: flash_attention(q, k, v, causal=True),
          "chunked": lambda q, k, v: chunked_flash_attention(q, k, v, 8, causal=True, self_mask=True)}[which]
    real_launches, real_bytes, real_meta = _run(fn, fake=False)
    fake_launches, fake_bytes, fake_meta = _run(fn, fake=True)
    assert real_launches == fake_launches and sum(real_launches.values()) == 4
    assert real_meta == fake_meta
    # out, lse, delta, dq, dk, dv: what the kernels fill, allocated by their wrappers, the same on both sides.
    assert real_bytes == fake_bytes == 4 * 2 * 24 * 16 * 2 + 2 * 2 * 24 * 4


@pytest.mark.slow  # a whole layer's forward and backward on fake tensors: about 3 s
def test_benchmark_row_of_a_small_layer() -> None:
    row = run_case("lsh", 4096, False)
    assert row["kernels"] == ("bwd_delta:1 chunked_bwd_dkdv:1 chunked_bwd_dq:1 chunked_fwd:1 lsh_hash:1 "
                              "merge_rounds_bwd:1 merge_rounds_fwd:1 unit_rows_bwd:1 unit_rows_fwd:1")
    assert row["kernel_launches"] == 9
    assert 0 < row["peak_mib"] and 0 < row["glue_mib"] and row["glue_launches"] > 0


def _layer_on_fake_tensors(kind: str, causal: bool, stood_in: bool, padded: bool = False) -> None:
    """Forward + backward of a toy layer of the GPU suite's long_attention (speed.DRY_LONG_MODEL) on fake tensors,
    with the Triton kernels stood in for (`stood_in`: the path a GPU takes) or on PyTorch's path; `padded`: with a
    key padding mask (whose values, fake too, no read can see)."""
    from benchmarks.gpu.speed import DRY_LONG_MODEL
    from benchmarks.methods.attention_scaling import Settings, Variant, build_layer

    n, d_model, heads = 64, DRY_LONG_MODEL["d_model"], DRY_LONG_MODEL["heads"]
    settings = Settings(lengths=(n,), d_model=d_model, heads=heads)
    with FakeTensorMode():
        layer, _ = build_layer(Variant(kind, kind, DRY_LONG_MODEL["knobs"][kind]), n, settings)
        x_BTD = torch.randn(1, n, d_model, requires_grad=True)
        mask_BT = torch.zeros(1, n, dtype=torch.bool) if padded else None
        with stand_in_kernels() if stood_in else torch.device("cpu"):
            layer.train()(x_BTD, key_padding_mask_BS=mask_BT, causal=causal).sum().backward()


@pytest.mark.parametrize("kind", ["lsh", "hyper"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_the_layers_on_the_kernels_read_nothing_back_from_the_device(kind: str, causal: bool) -> None:
    """On the kernels' path (a GPU's), the lsh and hyper layers' forward and backward read no value back from the
    device and make no tensor whose shape depends on values: each would be a wait for the device in the middle of
    the layer and would make the layer impossible to capture in a CUDA graph (benchmarks/gpu/speed.py GRAPHED).
    Fake tensors have no values, so either raises here. PyTorch's path for causal LSH sizes its layout from the
    hashes (one read: cheap on a CPU), which shows that the check sees such a read. Unpadded inputs, as the GPU
    suite's (padded ones: the next test)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    _layer_on_fake_tensors(kind, causal, stood_in=True)
    if kind == "lsh" and causal:
        with pytest.raises(DataDependentOutputException):
            _layer_on_fake_tensors(kind, causal, stood_in=False)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_a_padded_lsh_layer_on_the_kernels_reads_nothing_back(causal: bool) -> None:
    """A padded batch at LSH's default n_buckets hashes each row into its own length's buckets: the counts are
    made on the device (`default_n_buckets_of`), the shapes take the longest row's bound, so nothing is read back.
    HyperAttention still reads the longest real row (its exact path below min_seq_len is a branch on it)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    _layer_on_fake_tensors("lsh", causal, stood_in=True, padded=True)
    with pytest.raises(DataDependentOutputException):
        _layer_on_fake_tensors("hyper", causal, stood_in=True, padded=True)
