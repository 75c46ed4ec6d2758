"""The attention module, exact and relative mechanisms and the registry: values against independent
computations, written against mutants that the other method tests let live (docs/mutation_testing.md)."""

from __future__ import annotations

import pytest
import torch

from models.attention.lse import exact_attention
from tests.attention_cases import D_MODEL, make_attention


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
    from pydantic import TypeAdapter, ValidationError

    from models.attention import ATTENTION_REGISTRY, make_registry
    from models.attention.exact import ExactMechanismConfig
    from models.attention.hyper import HyperMechanismConfig
    from models.attention.projections import MHAConfig, _ProjectionKindConfig

    registry = make_registry(ATTENTION_REGISTRY)
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
