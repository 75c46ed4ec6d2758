"""The attention module, exact and relative mechanisms and the registry: values against independent
computations, written against mutants that the other method tests let live (docs/mutation_testing.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from models import ModelConfig
from models.attention import ATTENTION_REGISTRY, make_registry
from models.attention.exact import (
    ExactMechanism,
    ExactMechanismConfig,
    exact_attention_bias,
)
from models.attention.hyper import HyperMechanismConfig
from models.attention.linformer import LinformerMechanismConfig
from models.attention.lse import exact_attention
from models.attention.projections import MHAConfig, _ProjectionKindConfig
from models.attention.registry import ATTENTION, RELATIVE_KINDS
from models.attention.relative import (
    RELATIVE_BIASES,
    RelativeBiases,
    RelativeMechanism,
    relative_sinusoids,
)
from models.reversible import reversible_stack
from tests.attention_cases import D_MODEL, attention_cfg, make_attention


def test_attend_over_cached_keys_is_unmasked_cross_attention_with_the_padding():
    """`attend` (the decoder's step over cached keys) is the forward pass with that context: every given key
    visible (no causal mask, even when as many keys as queries), padded keys hidden."""
    attn = make_attention("mha")
    gen = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(2, 5, D_MODEL, generator=gen), torch.randn(2, 5, D_MODEL, generator=gen)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    k, v = attn.keys_values(ctx)
    out = attn.attend(x, k, v, key_padding_mask_BS=pad)
    torch.testing.assert_close(out, attn(x, ctx, key_padding_mask_BS=pad))
    q_BHTE = attn.projection.queries(x)
    k_BHSE, v_BHSE = attn.projection.expand_heads(k, v)
    expected, _ = exact_attention(q_BHTE, k_BHSE, v_BHSE, key_padding_mask=pad)
    torch.testing.assert_close(out, attn.projection.output(expected), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "kind, reasons",
    [
        ("mha", []),
        ("gqa", []),
        ("linformer", ["linformer: mechanism LinformerMechanism is not exact attention"]),
        (
            "lsh",
            [
                "lsh: mechanism LSHMechanism is not exact attention",
                "lsh: projection SharedQKProjection cannot cache keys/values",
            ],
        ),
    ],
)
def test_kv_cache_unsupported_reasons_name_each_part(kind, reasons):
    assert make_attention(kind).kv_cache_unsupported_reasons() == reasons


def test_a_registry_made_afresh_derives_every_config_and_union():
    """`make_registry` run in the test (the project's ATTENTION is made at import, before any test): each
    projection kind's config is a copy of the row's class (same name, module and docstring) whose `mechanism`
    field takes the crossable mechanisms, keeping the row's default and description; other kinds keep the
    row's class; the union tells kinds apart by `kind` and lists the valid ones."""
    registry = make_registry(ATTENTION_REGISTRY)
    assert registry.rows == ATTENTION_REGISTRY and registry.kinds == tuple(row.name for row in ATTENTION_REGISTRY)
    assert registry.mechanisms == tuple(dict.fromkeys(row.mechanism for row in ATTENTION_REGISTRY))
    block = registry.configs["mhe"](heads=2, d_model=8, mechanism={"kind": "hyper", "block_size": 4})
    built = registry.build_attention(block, 0, torch.nn.ModuleDict())
    assert built.kind == "mhe" and type(built.mechanism).config_cls is HyperMechanismConfig
    for row in ATTENTION_REGISTRY:
        derived = registry.configs[row.name]
        if not issubclass(row.config_cls, _ProjectionKindConfig):
            assert derived is row.config_cls
            continue
        assert derived is not row.config_cls and derived.__bases__ == (row.config_cls,)
        assert (derived.__name__, derived.__module__, derived.__doc__) == (
            row.config_cls.__name__,
            row.config_cls.__module__,
            row.config_cls.__doc__,
        )
        field, own = derived.model_fields["mechanism"], row.config_cls.model_fields["mechanism"]
        assert field.description == own.description
        cfg = derived(heads=2, d_model=8)
        assert type(cfg.mechanism) is ExactMechanismConfig
        hyper = derived(heads=2, d_model=8, mechanism={"kind": "hyper", "block_size": 4})
        assert type(hyper.mechanism) is HyperMechanismConfig and hyper.mechanism.block_size == 4
    adapter = TypeAdapter(registry.attention_config)
    assert type(adapter.validate_python({"kind": "mha", "heads": 2})) is registry.configs["mha"]
    assert type(adapter.validate_python({"kind": "hyper", "heads": 2})) is registry.configs["hyper"]
    with pytest.raises(
        ValidationError,
        match=r"'mla' found using 'kind' does not match any of the expected tags: "
        r"'mha', 'sha', 'mqa'",
    ):
        adapter.validate_python({"kind": "mla", "heads": 2})
    with pytest.raises(
        ValidationError,
        match=r"'lsh' found using 'kind' does not match any of the expected tags: "
        r"'exact', 'linformer', 'hyper'",
    ):
        TypeAdapter(registry.mechanism_config).validate_python({"kind": "lsh"})

    alone = make_registry(ATTENTION_REGISTRY[:1])
    assert alone.attention_config is alone.configs["mha"] and issubclass(alone.configs["mha"], MHAConfig)
    assert alone.mechanism_config is ExactMechanismConfig  # one crossable mechanism: the class, not a union
    assert alone.configs["mha"](heads=2, d_model=8).mechanism == ExactMechanismConfig()


def _loops(q, k, v, allowed):
    """Softmax attention written out per query over the allowed keys (float64); none allowed: the uniform
    average of every value, which is what the dtype's most negative logit on every key gives."""
    B, H, T, E = q.shape
    out = torch.zeros(B, H, T, E, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys = [j for j in range(k.shape[2]) if allowed(b, i, j)]
                if not keys:
                    out[b, h, i] = v[b, h].mean(0)
                    continue
                w = torch.softmax(torch.stack([q[b, h, i] @ k[b, h, j] for j in keys]) * E**-0.5, 0)
                out[b, h, i] = sum(w_j * v[b, h, j] for w_j, j in zip(w, keys))
    return out


@pytest.mark.parametrize("T, S", [(4, 4), (3, 5), (5, 3)], ids=["square", "fewer-queries", "more-queries"])
def test_exact_mechanism_masks_top_left_and_pads(T, S):
    """Causal alignment is top-left (query i sees keys j <= i) for any T, S; padded keys are hidden; a query
    whose keys are all hidden averages every value uniformly instead of producing NaN."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 4, generator=gen, dtype=torch.float64) for n in (T, S, S))
    pad = torch.zeros(2, S, dtype=torch.bool)
    pad[1, 0] = True
    pad[1, -1] = True
    mech = ExactMechanism().eval()
    cases = [(False, None), (True, None), (False, pad), (True, pad)]
    for causal, mask in cases:
        out = mech(q, k, v, key_padding_mask_BS=mask, causal=causal)

        def allowed(b, i, j, causal=causal, mask=mask):
            return (not causal or j <= i) and (mask is None or not mask[b, j])

        torch.testing.assert_close(out, _loops(q, k, v, allowed), atol=1e-12, rtol=1e-10)
    assert exact_attention_bias(None, False, T, S, torch.float64, q.device) is None
    padded_only = exact_attention_bias(pad, False, T, S, torch.float64, q.device)  # documented: [B, 1, T, S]
    assert padded_only.shape == (2, 1, T, S) and torch.equal(padded_only[:, 0] == 0, ~pad[:, None].expand(2, T, S))
    bias = exact_attention_bias(pad, True, T, S, torch.float32, q.device)
    assert bias.shape == (2, 1, T, S) and bias.dtype == torch.float32
    assert bias.max() == 0 and bias.min() == torch.finfo(torch.float32).min
    causal_only = exact_attention_bias(None, True, T, S, torch.float16, q.device)
    assert causal_only.shape == (1, 1, T, S) and causal_only.dtype == torch.float16
    assert torch.equal(causal_only[0, 0] == 0, torch.ones(T, S, dtype=torch.bool).tril())


def test_exact_mechanism_drops_out_in_training_only_at_the_blocks_rate():
    """Dropout comes from the attention block (`from_config`), acts in training (mean output unchanged over
    draws, single draws differ) and never in evaluation."""
    plain = ExactMechanism().train()  # no dropout unless the block asks for it
    x = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(plain(x, x, x), plain.eval()(x, x, x), atol=0, rtol=0)
    mech = ExactMechanism.from_config(ExactMechanismConfig(), attention_cfg("mha", dropout=0.5), 0, None)
    assert mech.dropout == 0.5 and mech.attention_parameters() == 0
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    ref = _loops(q, k, v, lambda b, i, j: True)
    for causal in (False, True):
        torch.testing.assert_close(
            mech.eval()(q, k, v, causal=causal), _loops(q, k, v, lambda b, i, j, c=causal: not c or j <= i)
        )
    torch.manual_seed(0)
    rows = 20000  # independent dropout draws side by side
    drawn = mech.train()(*(x.expand(rows, 1, 3, 4) for x in (q, k, v)))
    assert not torch.allclose(drawn[0], ref[0])
    torch.testing.assert_close(drawn.mean(0), ref[0], atol=0.05, rtol=0)
    kept = (drawn[:, 0, 0] == 0).double().mean()  # P(an output row's every weight dropped) is 0.5^3 here
    assert abs(kept.item() - 0.5**3) < 0.02
    # The causal path without padding (SDPA's is_causal): query 0 sees key 0 only, dropped half the time.
    causal = mech(*(x.expand(rows, 1, 3, 4) for x in (q, k, v)), causal=True)
    assert abs((causal[:, 0, 0] == 0).all(-1).double().mean().item() - 0.5) < 0.02


META = torch.device("meta")
"""Tensors with a shape and dtype but no data: mixing one with a CPU tensor raises, so running a function on
meta inputs shows that every tensor it creates follows the inputs' device (a dropped `device=` would put it on
the CPU, where on this CPU-only machine it is otherwise indistinguishable). The first meta operation of a
process imports torch's meta registrations (with sympy): a few seconds once, which the fast tier's torch.compile
tests pay anyway."""


@pytest.mark.parametrize("T, S", [(3, 3), (3, 5)])
def test_exact_attention_builds_its_masks_on_the_inputs_device(T, S):
    """Every mask of the exact mechanism (causal, padding, both, neither) is made on the device of q."""
    q = torch.empty(2, 2, T, 4, device=META)
    k, v = torch.empty(2, 2, S, 4, device=META), torch.empty(2, 2, S, 4, device=META)
    pad = torch.zeros(2, S, dtype=torch.bool, device=META)
    mech = ExactMechanism()
    for causal in (False, True):
        for mask in (None, pad):
            out = mech(q, k, v, key_padding_mask_BS=mask, causal=causal)
            assert out.device == META and out.shape == (2, 2, T, 4)
            bias = exact_attention_bias(mask, causal, T, S, torch.float16, META)
            if mask is not None or causal:
                assert bias.device == META and bias.dtype == torch.float16
                assert bias.shape == (2 if mask is not None else 1, 1, T, S)


def test_relative_attention_builds_its_terms_on_the_inputs_device():
    """R, the distances, the causal and padding masks and the position logits of Transformer-XL's mechanism
    are made on the device of q (here meta, with the layer's parameters moved there too)."""
    mech = RelativeMechanism(8, 2, 4, RelativeBiases(2, 4)).to(META)
    mech._biases.to(META)
    T, S = 3, 5
    q = torch.empty(2, 2, T, 4, device=META)
    k, v = torch.empty(2, 2, S, 4, device=META), torch.empty(2, 2, S, 4, device=META)
    assert relative_sinusoids(torch.arange(S, dtype=torch.float32, device=META), 8).device == META
    assert mech.position_logits(q, S).device == META
    for mask in (None, torch.zeros(2, S, dtype=torch.bool, device=META)):
        out = mech(q, k, v, key_padding_mask_BS=mask, causal=True)
        assert out.device == META and out.shape == (2, 2, T, 4)


def test_relative_biases_are_built_once_per_model_at_the_references_scale():
    """The first layer creates the model's u, v ([heads, head_dim], Normal(0, 0.02) as mem_transformer.py's
    init_weight); later layers share them; W_R is each layer's own and is what a layer counts."""
    torch.manual_seed(0)
    biases = RelativeBiases(8, 256)
    for p in (biases.u_HE, biases.v_HE):
        assert p.shape == (8, 256)
        assert abs(p.std().item() - 0.02) < 0.002 and abs(p.mean().item()) < 0.002
    assert not torch.equal(biases.u_HE, biases.v_HE)
    cfg = attention_cfg("mha", d_model=24, heads=3, dropout=0.25)
    shared = torch.nn.ModuleDict()
    first = RelativeMechanism.build(cfg, 3, shared)
    second = RelativeMechanism.build(cfg, 3, shared)
    assert list(shared) == [RELATIVE_BIASES] and first._biases is second._biases is shared[RELATIVE_BIASES]
    assert shared[RELATIVE_BIASES].u_HE.shape == (3, cfg.head_dim)
    assert (first.d_model, first.heads, first.head_dim, first.dropout) == (24, 3, cfg.head_dim, 0.25)
    assert first.w_r.weight.shape == (3 * cfg.head_dim, 24) and first.w_r.bias is None
    assert first.attention_parameters() == 24 * 3 * cfg.head_dim
    assert first.w_r is not second.w_r


def test_relative_mechanism_refuses_non_causal_and_drops_out_in_training_only():
    torch.manual_seed(0)
    mech = RelativeMechanism(8, 2, 4, RelativeBiases(2, 4), dropout=0.5).double()
    mech._biases.double()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    with pytest.raises(
        ValueError,
        match=r"model.positional: relative is implemented for causal self-attention "
        r"only \(task.kind: clm\); use learned or sinusoidal positions otherwise",
    ):
        mech(q, k, v)
    ref = mech.eval()(q, k, v, causal=True)
    assert torch.equal(mech(q, k, v, causal=True), ref)
    torch.manual_seed(0)
    rows = 20000
    drawn = mech.train()(*(x.expand(rows, 2, 3, 4) for x in (q, k, v)), causal=True)
    assert not torch.allclose(drawn[0], ref[0])
    torch.testing.assert_close(drawn.mean(0), ref[0], atol=0.05, rtol=0)
    assert abs((drawn[:, :, 0] == 0).all(-1).double().mean().item() - 0.5) < 0.02  # row 0 sees one key


def test_relative_sinusoids_keep_the_distances_precision():
    """Frequencies are computed in the distances' dtype: in float64, R at distance 1000 matches the formula
    sin/cos(d * 10000^(-2k/D)) to 1e-12 (float32 frequencies would be off by ~1e-4 there)."""
    D = 64
    distances = torch.tensor([0.0, 1.0, 999.0, 1000.0], dtype=torch.float64)
    r = relative_sinusoids(distances, D)
    assert r.dtype == torch.float64 and r.shape == (4, D)
    freqs = torch.tensor([10000 ** (-2 * k / D) for k in range(D // 2)], dtype=torch.float64)
    angles = distances[:, None] * freqs[None]
    torch.testing.assert_close(r, torch.cat([angles.sin(), angles.cos()], -1), atol=1e-12, rtol=0)


def test_relative_positions_with_an_approximate_kind_are_refused_naming_the_choices():
    reason = ATTENTION.relative_unsupported_reason(attention_cfg("hyper"))
    assert reason == (
        f"model.positional: relative is supported with attention kinds {list(RELATIVE_KINDS)}; got hyper: the "
        "relative terms extend exact softmax logits, which hyper approximates. Use one of those kinds, or learned "
        "/ sinusoidal positions"
    )
    assert ATTENTION.relative_unsupported_reason(attention_cfg("mha")) is None


def test_an_empty_reversible_stack_returns_its_inputs():
    """No blocks: nothing to recompute, so no autograd function is recorded; the streams come back as given."""
    x1, x2 = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 3, 4, requires_grad=True)
    y1, y2 = reversible_stack([], x1, x2, [])
    assert y1 is x1 and y2 is x2


def test_construction_refusals_say_what_to_fix():
    """The refusals of the attention module and the registry's builder, word for word where they name the fix."""
    with pytest.raises(
        ValueError,
        match=r"attends with 1 head\(s\) but its mechanism holds per-head projections for "
        r"4 \(linformer sharing=none\); use sharing=headwise, which is the same thing "
        r"for one head$",
    ):
        make_attention("sha", mechanism={"kind": "linformer", "k": 4, "sharing": "none"})
    attn = make_attention("mha")
    with pytest.raises(
        ValueError,
        match=r"key_padding_mask has shape \(2, 7\) but keys are \(2, 8\) \(batch, seq\); "
        r"it must be bool with True at padded key positions$",
    ):
        attn(torch.randn(2, 8, D_MODEL), key_padding_mask_BS=torch.zeros(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^model.attention.d_model is unset: build attention through ModelConfig$"):
        ATTENTION.build_attention(MHAConfig(heads=2), 0, torch.nn.ModuleDict())
    with pytest.raises(ValueError, match=r"^cross-attention has no relative positions$"):
        ATTENTION.build_attention(attention_cfg("mha"), 0, torch.nn.ModuleDict(), cross=True, relative=True)
    with pytest.raises(ValueError, match=r"model.attention.kind=None is not known"):
        ATTENTION.build_attention(SimpleNamespace(d_model=D_MODEL), 0, torch.nn.ModuleDict())


def test_a_mechanism_given_as_a_config_object_takes_the_models_fields():
    """A `mechanism:` given as a config object (not a dict) is dumped and filled like a dict: an unset Linformer
    max_seq_len becomes the model's."""
    block = {"kind": "mha", "heads": 2, "mechanism": LinformerMechanismConfig.model_construct(k=4, max_seq_len=None)}
    cfg = ModelConfig(d_model=16, layers=1, ffn=32, max_seq_len=48, attention=block)
    assert type(cfg.attention.mechanism) is LinformerMechanismConfig and cfg.attention.mechanism.max_seq_len == 48


def test_a_relative_layer_keeps_its_kind():
    built = ATTENTION.build_attention(attention_cfg("gqa", groups=2), 0, torch.nn.ModuleDict(), relative=True)
    assert built.kind == "gqa" and type(built.mechanism) is RelativeMechanism
