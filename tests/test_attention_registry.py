"""The registry (models/attention/registry.py) is the one table of kinds: every row agrees with its config,
and a name it does not hold is refused with the list of names it does."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch.nn as nn
from pydantic import BaseModel

from models.attention import ATTENTION_KINDS, ATTENTION_REGISTRY, build_attention
from models.attention.config import MHAConfig
from models.attention.projections import mha_projection
from models.attention.registry import MECHANISMS, AttentionKind
from tests.attention_cases import D_MODEL, attention_cfg, make_attention


@pytest.mark.parametrize("row", ATTENTION_REGISTRY, ids=lambda row: row.name)
def test_row_agrees_with_its_config_and_builds_its_parts(row):
    cfg = attention_cfg(row.name)
    assert type(cfg) is row.config_cls
    assert type(cfg.mechanism) is row.mechanism.config_cls  # the row names the kind's default pairing
    attn = make_attention(row.name)
    assert attn.kind == row.name and type(attn.mechanism) is row.mechanism


def test_kinds_and_mechanisms_come_from_the_table():
    assert ATTENTION_KINDS == ("mha", "sha", "mqa", "gqa", "skv", "el_att", "mhe", "linformer", "lsh", "hyper")
    assert [m.config_cls.model_fields["kind"].default for m in MECHANISMS] == ["exact", "linformer", "lsh", "hyper"]


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
