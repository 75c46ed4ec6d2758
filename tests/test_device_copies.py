"""Host-made constants (LSH's fixed rotations, HyperAttention's evaluation draw) go to a device once
(models/attention/device_copies.py): the values the seeds define, no copy from the host after the first call, no
fake tensor kept, nothing kept that autograd cannot save."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.attention.device_copies import DeviceCopies
from models.attention.hyper import _LEVEL_SEED_STRIDE, HyperMechanism, HyperMechanismConfig
from models.attention.lsh import LSHMechanism, LSHMechanismConfig

META = torch.device("meta")  # a device other than the host's, with no values: any host copy to it is an op here


class HostCopies(TorchDispatchMode):
    """Counts the ops that take a host tensor and give one on another device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if isinstance(out, torch.Tensor) and any(a.device.type == "cpu" for a in inputs) and out.device.type != "cpu":
            self.count += 1
        return out


def lsh(**knobs) -> LSHMechanism:
    cfg = LSHMechanismConfig(bucket_size=4, n_hashes=3, rotations="fixed", **knobs)
    return LSHMechanism(cfg, head_dim=8, layer_index=2).eval()


def seeded_columns(mech: LSHMechanism, n: int) -> torch.Tensor:
    """The definition: column c of the fixed rotations depends only on (seed, layer, c)."""
    return torch.stack([torch.randn(mech.n_hashes, mech.head_dim,
                                    generator=torch.Generator().manual_seed(mech.layer_seed * 7919 + c))
                        for c in range(n)], dim=-1)


def test_lsh_fixed_rotations_are_the_seeded_columns_for_any_order_of_lengths() -> None:
    mech = lsh()
    for n_half in (3, 5, 2, 11, 4):  # shorter after longer: a prefix of the kept copy
        rot = mech.rotations(2, n_half, torch.device("cpu"), torch.bfloat16)
        assert rot.shape == (2, 3, 8, n_half) and rot.dtype == torch.bfloat16
        assert torch.equal(rot[1], seeded_columns(mech, n_half).to(torch.bfloat16))


def test_lsh_evaluation_copies_its_rotations_to_the_device_once() -> None:
    mech = lsh()
    k_BHTE = torch.randn(1, 2, 16, 8, device=META)
    with HostCopies() as first:
        mech.buckets(k_BHTE, None, fused=False)
    with HostCopies() as again:
        for _ in range(3):
            mech.buckets(k_BHTE, None, fused=False)
        mech.buckets(torch.randn(1, 2, 8, 8, device=META), None, fused=False)  # a shorter row: the same copy
    assert first.count == 1 and again.count == 0
    with HostCopies() as longer:  # more columns than kept: copied once more, twice as many as were kept
        mech.buckets(torch.randn(1, 2, 24, 8, device=META), None, fused=False)
        mech.buckets(torch.randn(1, 2, 32, 8, device=META), None, fused=False)
    assert longer.count == 1


def test_hyper_evaluation_draw_is_the_seeded_draw_and_goes_to_the_device_once() -> None:
    mech = HyperMechanism(HyperMechanismConfig(block_size=4, sample_size=5), head_dim=8, layer_index=1).eval()
    for level in (0, 1):
        seed = mech.eval_seed + _LEVEL_SEED_STRIDE * level
        seeded = torch.rand(1, 3, 5, generator=torch.Generator().manual_seed(seed))
        draw = mech._uniform(2, 3, 5, torch.device("cpu"), level)
        assert torch.equal(draw, seeded.expand(2, 3, 5))
    with HostCopies() as first:
        mech._uniform(2, 3, 5, META, 0)
    with HostCopies() as again:
        mech._uniform(4, 3, 5, META, 0)  # another batch size: the same draw, expanded
        mech.sample_rows(4, 3, 40, 40, META, 0)
    assert first.count == 1 and again.count == 0


def test_a_copy_made_on_fake_tensors_is_not_kept() -> None:
    copies = DeviceCopies()
    with FakeTensorMode():
        fake = copies.get(torch.device("cpu"), torch.float32, "x", lambda _kept: torch.ones(3))
    assert len(copies) == 0
    real = copies.get(torch.device("cpu"), torch.float32, "x", lambda _kept: torch.ones(3))
    assert type(real) is torch.Tensor and type(fake) is not torch.Tensor and len(copies) == 1


def test_a_copy_made_in_inference_mode_serves_a_later_backward() -> None:
    mech = lsh()
    with torch.inference_mode():
        mech.rotations(2, 4, torch.device("cpu"))
    k = torch.randn(2, 3, 8, requires_grad=True)
    rot = mech.rotations(2, 4, torch.device("cpu"))
    assert not rot.is_inference()
    torch.einsum("hre,hren->hrn", k, rot).sum().backward()  # saving an inference tensor would raise here
    assert k.grad is not None


def test_copies_are_kept_per_device_and_dtype() -> None:
    """One copy per (device, dtype): asked again, the same tensor; another device or dtype, a copy of its own."""
    copies, made = DeviceCopies(), []

    def make(kept: torch.Tensor | None) -> torch.Tensor:
        made.append(kept)
        return torch.arange(4.0)

    a = copies.get(META, torch.float32, "k", make)
    assert copies.get(META, torch.float32, "k", make) is a and len(made) == 1
    b = copies.get(META, torch.bfloat16, "k", make)
    c = copies.get(torch.device("cpu"), torch.float32, "k", make)
    assert b.dtype == torch.bfloat16 and c.device.type == "cpu" and len(made) == 3 and len(copies) == 3
    grown = copies.get(META, torch.float32, "k", make, large_enough=lambda kept: kept.shape[-1] > 4)
    assert made[-1] is a and grown is not a  # a copy too small is handed to make(), then replaced
