"""Reversible layers: gradients equal plain autograd's, saved activations flat in depth, RNG replay, errors."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from models import LanguageModel, ModelConfig, Seq2SeqTransformer
from models.reversible import irreversible_stack, reversible_stack
from tests.training import fit, next_token_loss

VOCAB = 23
ATTENTION = {
    "mha": {"kind": "mha", "heads": 2},
    "lsh": {"kind": "lsh", "heads": 2, "bucket_size": 4, "n_hashes": 2, "dropout": 0.1},
    "hyper": {"kind": "hyper", "heads": 2, "block_size": 4, "sample_size": 4, "min_seq_len": 4, "lsh_bits": 2},
    # one E shared by every layer: its gradient is the sum of every block's contribution
    "linformer": {"kind": "linformer", "heads": 2, "k": 4, "sharing": "layerwise"},
}


def config(layers: int = 3, attention: str = "mha", **overrides) -> ModelConfig:
    fields = dict(d_model=16, layers=layers, ffn=32, max_seq_len=32, dropout=0.1, reversible=True,
                  attention=ATTENTION[attention])
    return ModelConfig(**{**fields, **overrides})


def grads_of(stack_fn, model, x, seed: int = 123):
    model.zero_grad()
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)  # identical dropout masks and samples in runs with the same seed
    y1, y2 = stack_fn(x)
    weights = torch.randn_like(y1, generator=torch.Generator().manual_seed(9))
    ((y1 * weights).sum() + (y2 * weights.flip(-1)).sum()).backward()
    return x.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention, causal", [
    (kind, causal) for kind in ATTENTION for causal in (False, True) if not (kind == "linformer" and causal)])
def test_gradients_equal_those_of_the_same_network_without_reversibility(attention, causal):
    torch.manual_seed(0)
    model = LanguageModel(config(attention=attention), VOCAB, causal=causal).double().train()
    layers = list(model.stack.layers)
    params = list(model.parameters())
    x = torch.randn(2, 14, 16, dtype=torch.float64)
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[1, 10:] = True
    gx_rev, g_rev = grads_of(lambda x_: reversible_stack(layers, x_, x_, params, mask), model, x)
    gx_ref, g_ref = grads_of(lambda x_: irreversible_stack(layers, x_, x_, mask), model, x)
    torch.testing.assert_close(gx_rev, gx_ref, atol=1e-9, rtol=1e-7)
    assert g_rev.keys() == g_ref.keys() and len(g_ref) > 0
    for name in g_ref:
        torch.testing.assert_close(g_rev[name], g_ref[name], atol=1e-9, rtol=1e-7, msg=name)


def test_dropout_is_replayed_not_redrawn():
    """Without restoring the RNG the recomputed dropout masks differ and the gradient is wrong."""
    torch.manual_seed(0)
    model = LanguageModel(config(dropout=0.5), VOCAB, causal=False).double().train()
    layers, params = list(model.stack.layers), list(model.parameters())
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    gx_rev, _ = grads_of(lambda x_: reversible_stack(layers, x_, x_, params), model, x)
    gx_ref, _ = grads_of(lambda x_: irreversible_stack(layers, x_, x_), model, x)
    torch.testing.assert_close(gx_rev, gx_ref, atol=1e-9, rtol=1e-7)
    # A different mask for the same input changes the gradient: dropout is live in this test.
    gx_other, _ = grads_of(lambda x_: irreversible_stack(layers, x_, x_), model, x, seed=1)
    assert not torch.allclose(gx_other, gx_ref)


def saved_bytes(model: LanguageModel, tokens: torch.Tensor) -> int:
    """Bytes of activations autograd saves for backward in the transformer stack (parameters excluded)."""
    param_ptrs = {p.data_ptr() for p in model.parameters()}
    x = model.embed(tokens).detach().requires_grad_()
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        if t.data_ptr() not in param_ptrs:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.stack(x)
    return total


def test_saved_activations_do_not_grow_with_depth():
    tokens = torch.randint(0, VOCAB, (2, 16))
    per_depth = {}
    for reversible in (True, False):
        for layers in (2, 8):
            torch.manual_seed(0)
            model = LanguageModel(config(layers=layers, reversible=reversible), VOCAB, causal=True).train()
            per_depth[reversible, layers] = saved_bytes(model, tokens)
    assert per_depth[True, 8] == per_depth[True, 2]
    assert per_depth[False, 8] > 3 * per_depth[False, 2]  # the measurement does see per-layer activations
    assert per_depth[True, 8] < per_depth[False, 2]


def test_reversible_language_model_trains():
    torch.manual_seed(0)
    model = LanguageModel(config(layers=2, attention="lsh", dropout=0.0), VOCAB, causal=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (4, 12))
    losses = fit(lambda _: next_token_loss(model, tokens), opt, steps=10)
    assert losses[-1] < 0.8 * losses[0]


def test_reversible_stack_under_ddp_gets_every_gradient_once(tmp_path):
    """Parameters are inputs of the autograd function, so DDP's gradient hooks fire normally."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    ddp = None
    try:
        torch.manual_seed(0)
        model = LanguageModel(config(layers=2), VOCAB, causal=True)
        ddp = DistributedDataParallel(model)
        tokens = torch.randint(0, VOCAB, (2, 10))
        for _ in range(2):  # a second step fails if a parameter was marked ready twice
            ddp.zero_grad()
            ddp(tokens).sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    finally:
        # DDP's Reducer goes first, while the group lives, so that the group's last reference drops in
        # destroy_process_group, through the Python class that frees its groups without the GIL. Freed by the
        # Reducer as the test returned, the group was freed with the GIL held, its destructor joining gloo's
        # threads while one of them waited for the GIL (to release a finished work's tensors): the fast tier once
        # hung there for 12 minutes.
        del ddp
        gc.collect()
        dist.destroy_process_group()


def test_translation_decoder_refuses_reversible_with_the_field_to_fix():
    with pytest.raises(ValueError, match="model.reversible"):
        Seq2SeqTransformer(config(), VOCAB)


def test_reversible_flag_keeps_parameter_names_and_counts():
    plain = LanguageModel(config(reversible=False), VOCAB, causal=True)
    rev = LanguageModel(config(reversible=True), VOCAB, causal=True)
    assert plain.state_dict().keys() == rev.state_dict().keys()
    assert plain.parameter_counts() == rev.parameter_counts()


def test_recomputation_replays_autocast():
    """Under bf16 autocast the backward must recompute in bf16 too, or the rebuilt inputs drift by bf16 rounding."""
    torch.manual_seed(0)
    model = LanguageModel(config(dropout=0.0), VOCAB, causal=True).train()
    layers, params = list(model.stack.layers), list(model.parameters())
    x = torch.randn(2, 12, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gx_rev, g_rev = grads_of(lambda x_: reversible_stack(layers, x_, x_, params), model, x)
        gx_ref, g_ref = grads_of(lambda x_: irreversible_stack(layers, x_, x_), model, x)
    torch.testing.assert_close(gx_rev, gx_ref, atol=1e-5, rtol=1e-4)
    for name in g_ref:
        torch.testing.assert_close(g_rev[name], g_ref[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("attention", ["mha", "lsh"])
def test_inference_without_grad_gives_the_training_forward_values(attention):
    """Under no_grad (evaluation, decoding) the stack runs plainly, with nothing saved for a backward; the
    outputs are those of the reversible forward, padding mask included."""
    torch.manual_seed(0)
    model = LanguageModel(config(attention=attention, dropout=0.0), VOCAB, causal=True).double().eval()
    layers = list(model.stack.layers)
    x1, x2 = torch.randn(2, 2, 14, 16, dtype=torch.float64)
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[1, 10:] = True
    ref = irreversible_stack(layers, x1, x2, mask)
    with torch.no_grad():
        out = reversible_stack(layers, x1, x2, list(model.parameters()), mask)
    for o, r in zip(out, ref):
        assert not o.requires_grad
        torch.testing.assert_close(o, r.detach(), atol=1e-12, rtol=1e-12)
