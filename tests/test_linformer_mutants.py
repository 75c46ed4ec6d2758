"""Linformer (Wang et al., 2020, arXiv 2006.04768) behaviour that surviving mutants showed untested.

Each test checks a value against an independent computation (eq. 7 written out in float64, the slot-by-slot
projection oracle of tests/test_linformer_projection.py) or pins a documented default or refusal.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from models import ModelConfig
from models.attention.base import _AttentionConfig
from models.attention.linformer import LinformerMechanism, LinformerMechanismConfig, SequenceProjection
from tests.test_linformer_projection import B, E, H, K, N, projection_oracle


def _mechanism_cfg(**knobs) -> LinformerMechanismConfig:
    return LinformerMechanismConfig(**{"k": K, "max_seq_len": N, **knobs})


@pytest.mark.parametrize("given, expected", [(16, 16), (None, 32)], ids=["set", "null"])
def test_a_mechanism_block_keeps_the_max_seq_len_it_sets(given, expected):
    """`mechanism: {kind: linformer, max_seq_len: 16}` under a model of 32 keeps 16; only an unset (null)
    max_seq_len is the model's."""
    block = {"kind": "mha", "heads": 2, "mechanism": {"kind": "linformer", "k": 4, "max_seq_len": given}}
    cfg = ModelConfig(d_model=16, layers=1, ffn=32, max_seq_len=32, attention=block)
    assert cfg.attention.mechanism.max_seq_len == expected


@pytest.mark.parametrize("kind, per_head", [("linear", False), ("mean", False), ("max", False), ("conv", False),
                                            ("conv", True)])
def test_projection_without_a_padding_mask_equals_the_oracle_with_no_padding(kind, per_head):
    """No key_padding_mask means every position is real: E x equals the slot-by-slot oracle given an all-false
    mask, with a partial last slot (S = 10, stride 3) whose missing position is not a member."""
    torch.manual_seed(1)
    proj = SequenceProjection(kind, K, N, E, H if per_head else None).double()
    x = torch.randn(B, H, 10, E, dtype=torch.float64) - 2.0  # negative values: a max over a zero pad would show
    out, empty = proj(x, None)
    ref, ref_empty = projection_oracle(proj, x, torch.zeros(B, 10, dtype=torch.bool))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert (empty is None) if ref_empty is None else torch.equal(empty, ref_empty)


@pytest.mark.parametrize("kind", ["mean", "max", "conv"])
def test_pooled_projection_builds_its_masks_on_the_input_device(kind):
    """The all-valid mask made when no padding mask is given lives on the input's device. On the `meta` device a
    mask made on the CPU cannot be combined with the input, so this checks on a CPU-only machine what a GPU
    run would."""
    proj = SequenceProjection(kind, K, N, E, None).to("meta")
    out, empty = proj(torch.empty(B, H, 10, E, device="meta"), None)
    assert out.device.type == "meta" and empty.device.type == "meta"
    assert out.shape == (B, H, K, E) and empty.shape == (B, K)


def test_attend_compressed_is_bidirectional_by_default():
    """attend_compressed(q, EK, FV) without `causal` is eq. 7's softmax(q (EK)^T / sqrt(d)) FV over all k slots,
    with the slots marked empty left out: a bidirectional call, not a causal refusal."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64) for n in (6, K, K))
    empty = torch.tensor([[False, True, False, False], [False] * K])
    mech = LinformerMechanism(_mechanism_cfg(), H, E, 0, nn.ModuleDict()).double()
    out = mech.attend_compressed(q, k, v, empty_BK=empty)
    logits = q @ k.transpose(-1, -2) / math.sqrt(E)
    logits = logits.masked_fill(empty[:, None, None, :], float("-inf"))
    torch.testing.assert_close(out, logits.softmax(-1) @ v, rtol=1e-12, atol=1e-12)


def test_mechanism_built_directly_has_no_attention_dropout():
    """The constructor's dropout defaults to 0: in training the output equals evaluation's."""
    torch.manual_seed(3)
    mech = LinformerMechanism(_mechanism_cfg(), H, E, 0, nn.ModuleDict())
    q, k, v = (torch.randn(B, H, N, E) for _ in range(3))
    train_out = mech.train()(q, k, v)
    torch.testing.assert_close(train_out, mech.eval()(q, k, v), rtol=0, atol=0)


def test_mechanism_built_directly_needs_max_seq_len():
    """A config that did not go through ModelConfig has no max_seq_len; the constructor names who fills it."""
    with pytest.raises(AssertionError, match=r"^max_seq_len is filled in by ModelConfig$"):
        LinformerMechanism(LinformerMechanismConfig(k=K), H, E, 0, nn.ModuleDict())


def test_causal_refusal_names_the_alternatives_word_for_word():
    """The refusal says why (the projection mixes the future), where Linformer fits, and which kinds to use."""
    mech = LinformerMechanism(_mechanism_cfg(), H, E, 0, nn.ModuleDict())
    q = torch.randn(B, H, N, E)
    expected = (
        "model.attention.kind=linformer cannot run causal attention: its sequence projection mixes future tokens "
        "into every compressed key. Use it for masked LM / encoders, or choose a causal-capable kind (mha, mhe, "
        "lsh, hyper, ...) for causal LM and decoders"
    )
    with pytest.raises(ValueError) as err:
        mech(q, q, q, causal=True)
    assert str(err.value) == expected


def test_linear_projection_init_is_fairseqs_xavier_uniform_with_gain_one_over_root_two():
    """fairseq initialises E and F with xavier_uniform_(gain=1/sqrt(2)): U(-a, a), a = sqrt(6 / (k + n)) / sqrt(2)
    per (k, n) matrix. Over 16,384 draws the extremes come within 0.1% of +-a and the variance is a^2 / 3."""
    torch.manual_seed(4)
    k, n = 64, 256
    a = math.sqrt(6.0 / (k + n)) / math.sqrt(2.0)
    for heads in (None, 2):
        w = SequenceProjection("linear", k, n, E, heads).weight.detach().double()
        assert w.shape == ((k, n) if heads is None else (heads, k, n))
        assert a * 0.999 < w.max() <= a and -a <= w.min() < -a * 0.999
        assert abs(w.var().item() - a * a / 3) < 0.03 * a * a / 3


def test_k_for_layer_reads_the_list_and_refuses_a_layer_past_its_end():
    """A per-layer list gives layer i its i-th k; layer len(list) has none, and the error says so."""
    cfg = LinformerMechanismConfig(k=[4, 8], max_seq_len=16)
    assert [cfg.k_for_layer(0), cfg.k_for_layer(1)] == [4, 8]
    assert LinformerMechanismConfig(k=4, max_seq_len=16).k_for_layer(5) == 4
    with pytest.raises(ValueError) as err:
        cfg.k_for_layer(2)
    assert str(err.value) == "model.attention.k lists 2 values but layer 2 needs one: give one k per layer"


def test_layerwise_sharing_gives_every_layer_the_models_one_E():
    """sharing=layerwise: the first layer creates E in the model's shared state and every later layer uses that
    same module (one E for keys and values of every layer), not a new one."""
    shared = nn.ModuleDict()
    layers = [LinformerMechanism(_mechanism_cfg(sharing="layerwise"), H, E, i, shared) for i in range(3)]
    assert list(shared) == ["linformer_E"]
    for layer in layers:
        E_, F_ = layer._projections()
        assert E_ is shared["linformer_E"] and F_ is E_


def test_check_model_refusals_word_for_word():
    """A projection longer than the model's positions, and a k list whose length is not the model's layer count
    (the larger of encoder and decoder depth), are refused with the fields and the fix."""
    model = SimpleNamespace(max_seq_len=32, layers=2, decoder_layers=None)
    with pytest.raises(ValueError) as err:
        LinformerMechanismConfig(k=4, max_seq_len=64).check_model(model, "model.attention")
    assert str(err.value) == ("model.attention.max_seq_len=64 exceeds model.max_seq_len=32; positions beyond "
                              "model.max_seq_len cannot occur")
    with pytest.raises(ValueError) as err:
        LinformerMechanismConfig(k=[4, 4, 4], max_seq_len=32).check_model(model, "model.attention.mechanism")
    assert str(err.value) == "model.attention.mechanism.k lists 3 values for 2 layers; give exactly one k per layer"
    with_decoder = SimpleNamespace(**{**vars(model), "decoder_layers": 3})
    LinformerMechanismConfig(k=[4, 4, 4], max_seq_len=32).check_model(with_decoder, "model.attention")


def test_from_config_refuses_an_unset_max_seq_len_word_for_word():
    """The registry's builder needs the max_seq_len that ModelConfig fills in, and says so."""
    attention = _AttentionConfig(heads=H, d_model=H * E)
    with pytest.raises(ValueError) as err:
        LinformerMechanism.from_config(LinformerMechanismConfig(k=K), attention, 0, nn.ModuleDict())
    assert str(err.value) == ("model.attention.max_seq_len is unset: build attention through ModelConfig, which "
                              "fills it from model.max_seq_len")


def test_from_config_passes_the_attention_dropout_to_the_softmax():
    """model.attention.dropout reaches the attention weights over the k slots: in training two calls draw
    different masks (and differ from evaluation's output); in evaluation the output is deterministic."""
    attention = _AttentionConfig(heads=H, d_model=H * E, dropout=0.5)
    mech = LinformerMechanism.from_config(_mechanism_cfg(), attention, 0, nn.ModuleDict())
    torch.manual_seed(5)
    q, k, v = (torch.randn(B, H, N, E) for _ in range(3))
    evaluated = mech.eval()(q, k, v)
    mech.train()
    first, second = mech(q, k, v), mech(q, k, v)
    assert not torch.allclose(first, second) and not torch.allclose(first, evaluated)
    torch.testing.assert_close(mech.eval()(q, k, v), evaluated, rtol=0, atol=0)
