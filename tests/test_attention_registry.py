"""The registry (models/attention/registry.py) is the one table of kinds: every row agrees with its config,
and a name it does not hold is refused with the list of names it does."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from typing import get_args

import pytest
import torch.nn as nn
from pydantic import BaseModel, ValidationError

from models import ModelConfig
from models.attention import ATTENTION, ATTENTION_KINDS, ATTENTION_REGISTRY, build_attention, make_registry
from models.attention.projections import MHAConfig, _ProjectionKindConfig, mha_projection
from models.attention.registry import MECHANISMS, AttentionKind, MechanismConfig
from tests.attention_cases import D_MODEL, attention_cfg, make_attention


def _tag(config_cls) -> str:
    return config_cls.model_fields["kind"].default


@pytest.mark.parametrize("row", ATTENTION_REGISTRY, ids=lambda row: row.name)
def test_row_agrees_with_its_config_and_builds_its_parts(row):
    cfg = attention_cfg(row.name)
    assert _tag(row.config_cls) == row.name
    assert type(cfg) is ATTENTION.configs[row.name] and isinstance(cfg, row.config_cls)
    assert type(cfg.mechanism) is row.mechanism.config_cls  # the row names the kind's default pairing
    attn = make_attention(row.name)
    assert attn.kind == row.name and type(attn.mechanism) is row.mechanism


@pytest.mark.parametrize("row", ATTENTION_REGISTRY, ids=lambda row: row.name)
def test_a_kind_validates_into_its_own_class_and_only_projection_kinds_are_copied(row):
    """A projection kind's class is copied with the registry's `mechanism:` union; every other is the row's."""
    derived = ATTENTION.configs[row.name]
    assert (derived is not row.config_cls) == issubclass(row.config_cls, _ProjectionKindConfig)
    assert derived.__name__ == row.config_cls.__name__ and issubclass(derived, row.config_cls)
    assert derived.tiny_knobs == row.config_cls.tiny_knobs and derived.bench_knobs == row.config_cls.bench_knobs


def test_kinds_and_mechanisms_come_from_the_table():
    assert ATTENTION_KINDS == tuple(row.name for row in ATTENTION_REGISTRY)
    assert len(set(ATTENTION_KINDS)) == len(ATTENTION_KINDS)
    assert MECHANISMS == tuple(dict.fromkeys(row.mechanism for row in ATTENTION_REGISTRY))
    assert len({_tag(m.config_cls) for m in MECHANISMS}) == len(MECHANISMS)
    crossable = [m.config_cls for m in MECHANISMS if m.config_cls.crossable]
    assert list(get_args(get_args(MechanismConfig)[0])) == crossable


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=lambda m: _tag(m.config_cls))
def test_every_projection_kind_takes_exactly_the_crossable_mechanisms(mechanism):
    tag = _tag(mechanism.config_cls)
    for row in ATTENTION_REGISTRY:
        if not issubclass(row.config_cls, _ProjectionKindConfig):
            continue
        block = {"kind": row.name, "heads": 4, **row.config_cls.tiny_knobs, "mechanism": {"kind": tag}}
        if mechanism.config_cls.crossable:
            cfg = ModelConfig(d_model=D_MODEL, attention=block).attention
            assert type(cfg.mechanism) is mechanism.config_cls, row.name
        else:
            valid = ", ".join(repr(_tag(m.config_cls)) for m in MECHANISMS if m.config_cls.crossable)
            with pytest.raises(ValidationError, match=f"'{tag}' found using 'kind' does not match any of the "
                                                      f"expected tags: {valid}"):
                ModelConfig(d_model=D_MODEL, attention=block)


def test_a_kind_twice_in_a_table_is_refused():
    with pytest.raises(ValueError, match=r"attention kinds \['mha'\] have more than one registry row"):
        make_registry(ATTENTION_REGISTRY + (ATTENTION_REGISTRY[0],))


def test_a_row_whose_name_differs_from_its_config_kind_is_refused():
    with pytest.raises(TypeError, match=r"registry row 'mqa' holds MHAConfig, whose kind is 'mha'"):
        AttentionKind("mqa", MHAConfig, projection=mha_projection, mechanism=ATTENTION_REGISTRY[0].mechanism)


def test_rows_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ATTENTION_REGISTRY[0].name = "other"  # type: ignore[misc]


def test_build_attention_refuses_an_unknown_kind_and_lists_the_valid_ones():
    cfg = SimpleNamespace(kind="linfomer", d_model=D_MODEL)
    with pytest.raises(ValueError, match=r"kind='linfomer' is not known; valid kinds: mha, sha, .*, lsh, hyper$"):
        build_attention(cfg, 0, nn.ModuleDict())


def test_build_attention_refuses_an_unknown_mechanism_and_lists_the_valid_ones():
    class OtherMechanismConfig(BaseModel):
        kind: str = "other"

    cfg = MHAConfig.model_construct(kind="mha", heads=4, d_model=D_MODEL, mechanism=OtherMechanismConfig())
    with pytest.raises(ValueError, match=r"mechanism.kind='other' is not known; valid mechanisms: exact, linformer, "
                                         r"lsh, hyper"):
        build_attention(cfg, 0, nn.ModuleDict())
