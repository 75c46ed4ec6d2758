"""Reversible layers' autocast replay in the two cases tests/test_reversible.py does not run: a float32
forward without autocast (the backward must not switch autocast on) and fp16 autocast (the backward must
recompute in fp16, not autocast's default bf16). Gradients equal plain autograd's in each case. Also a loss
that reads one stream only, and the CUDA half of the RNG record, checked through a stand-in for torch.cuda's
RNG functions (this machine has no CUDA)."""

from __future__ import annotations

import pytest
import torch

from models import LanguageModel, ModelConfig
from models.reversible import _RNGState, irreversible_stack, reversible_stack

VOCAB = 23


def grads_of(stack_fn, model, x, autocast_dtype):
    """Forward under autocast (when a dtype is given), backward outside it, as a training step does."""
    model.zero_grad()
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        y1, y2 = stack_fn(x)
    weights = torch.randn(y1.shape, generator=torch.Generator().manual_seed(9))
    ((y1.float() * weights).sum() + (y2.float() * weights.flip(-1)).sum()).backward()
    return x.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def small_model(**overrides) -> LanguageModel:
    cfg = ModelConfig(
        d_model=16, layers=3, ffn=32, max_seq_len=32, dropout=0.0, reversible=True,
        attention={"kind": "mha", "heads": 2}, **overrides,
    )
    return LanguageModel(cfg, VOCAB, causal=True).train()


@pytest.mark.parametrize("autocast_dtype", [None, torch.float16], ids=["fp32", "fp16-autocast"])
def test_recomputation_runs_in_the_forwards_precision(autocast_dtype):
    torch.manual_seed(0)
    model = small_model()
    layers, params = list(model.stack.layers), list(model.parameters())
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1))
    gx_rev, g_rev = grads_of(lambda x_: reversible_stack(layers, x_, x_, params), model, x, autocast_dtype)
    gx_ref, g_ref = grads_of(lambda x_: irreversible_stack(layers, x_, x_), model, x, autocast_dtype)
    tol = 1e-5 if autocast_dtype is None else 2e-4  # fp16 rounding of the rebuilt inputs, not bf16's ~1e-2
    torch.testing.assert_close(gx_rev, gx_ref, atol=tol, rtol=tol)
    assert g_rev.keys() == g_ref.keys() and len(g_ref) > 0
    for name in g_ref:
        torch.testing.assert_close(g_rev[name], g_ref[name], atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("stream", [0, 1])
def test_a_loss_of_one_stream_gets_the_gradients_of_plain_autograd(stream):
    """The backward of a loss that ignores one output stream: autograd hands the reversible function zeros
    for it (never None), and the gradients are those of the same stack without reversibility."""
    torch.manual_seed(0)
    model = small_model()
    layers, params = list(model.stack.layers), list(model.parameters())
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))
    grads = []
    for reversible in (True, False):
        model.zero_grad()
        x_ = x.clone().requires_grad_()
        ys = reversible_stack(layers, x_, x_, params) if reversible else irreversible_stack(layers, x_, x_)
        ys[stream].square().sum().backward()
        # a parameter the loss does not reach has no gradient in plain autograd and zeros here
        grads.append([x_.grad, *(torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters())])
    assert grads[1][0].abs().sum() > 0
    for rev, ref in zip(*grads):
        torch.testing.assert_close(rev, ref, atol=1e-5, rtol=1e-5)


class _FakeCudaRNG:
    """Stand-ins for torch.cuda.get_rng_state / set_rng_state that record the device each call names and
    hand out a distinct state per call, so a test can follow which state is restored where."""

    def __init__(self):
        self.got: list = []
        self.set: list = []

    def get_rng_state(self, device="cuda"):
        self.got.append(device)
        return torch.tensor([len(self.got)], dtype=torch.uint8)

    def set_rng_state(self, new_state, device="cuda"):
        self.set.append((int(new_state), device))


def test_the_rng_record_saves_and_replays_the_cuda_generator_of_the_inputs_device(monkeypatch):
    """Branch inputs on a CUDA device: the record holds that device's CUDA RNG state next to the CPU one, and
    replaying it sets that state on that device inside `fork_rng` (which saves and restores the device's own
    state around it). Inputs on the CPU touch no CUDA generator."""
    fake = _FakeCudaRNG()
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    device = torch.device("cuda", 1)

    cpu_state = _RNGState(torch.device("cpu"))
    assert cpu_state.cuda is None and fake.got == []
    with cpu_state.replay():
        pass
    assert fake.got == [] and fake.set == []

    state = _RNGState(device)
    assert state.device == device and fake.got == [device] and int(state.cuda) == 1
    assert torch.equal(state.cpu, torch.get_rng_state())
    torch.rand(3)  # move the CPU generator on: replay must rewind it
    with state.replay():
        assert torch.equal(torch.get_rng_state(), state.cpu)
        assert fake.got == [device, device]  # fork_rng saved the device's current state (2)
        assert fake.set == [(1, device)]  # the recorded state, on the recorded device
    assert fake.set == [(1, device), (2, device)]  # and fork_rng restored the saved one
