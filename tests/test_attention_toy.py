"""Adding a kind is one file and one registry row: the toy kind `mean` of tests/toy_attention.py, given one row
on top of the project's table, validates, builds and trains through the model config's normal path.

The row goes into a registry of its own (`make_registry`), which `ModelConfig.for_registry` turns into the
model config that validates against it and builds from it; the project's ATTENTION and ModelConfig are left
as they are, which the last test checks.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from models import LanguageModel, ModelConfig
from models.attention import ATTENTION_REGISTRY, AttentionKind, make_registry
from models.attention.projections import mha_projection
from tasks import check_compatible
from tasks.config import CausalLMTaskConfig
from tests.toy_attention import MeanConfig, MeanMechanism
from tests.training import fit, next_token_loss

TOY_REGISTRY = make_registry(
    ATTENTION_REGISTRY + (AttentionKind("mean", MeanConfig, projection=mha_projection, mechanism=MeanMechanism),)
)
ToyModelConfig = ModelConfig.for_registry(TOY_REGISTRY)

VOCAB, T = 24, 16


def _cfg(attention: dict) -> ModelConfig:
    return ToyModelConfig(d_model=32, layers=2, ffn=64, dropout=0.0, max_seq_len=T, attention=attention)


def test_the_toy_kind_trains_one_step_through_the_model_config():
    cfg = _cfg({"kind": "mean", "heads": 4, **MeanConfig.tiny_knobs})
    assert type(cfg.attention) is TOY_REGISTRY.configs["mean"] and cfg.attention.value_scale == 0.5
    check_compatible(CausalLMTaskConfig(seq_len=T), cfg)  # asks the built attention whether it is causal
    torch.manual_seed(0)
    model = LanguageModel(cfg, VOCAB, causal=True)
    attn = model.stack.layers[0].attn
    assert attn.kind == "mean" and isinstance(attn.mechanism, MeanMechanism) and attn.mechanism.value_scale == 0.5
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    tokens = torch.randint(1, VOCAB, (4, T), generator=torch.Generator().manual_seed(0))
    (loss,) = fit(lambda _: next_token_loss(model, tokens), torch.optim.AdamW(model.parameters(), lr=1e-2), 1)
    assert torch.isfinite(torch.tensor(loss))
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert "stack.layers.0.attn.projection.v.weight" in moved and "stack.layers.1.attn.projection.out.weight" in moved


def test_the_toy_mechanism_averages_the_visible_values():
    cfg = _cfg({"kind": "mean", "heads": 4, "value_scale": 2.0}).attention
    attn = TOY_REGISTRY.build_attention(cfg, 0, torch.nn.ModuleDict()).eval()
    q, k, v = torch.randn(3, 1, 2, 5, 8).unbind(0)
    padding = torch.tensor([[False, False, False, True, True]])
    out = attn.mechanism(q, k, v, key_padding_mask_BS=padding, causal=True)
    expected = 2.0 * torch.stack([v[:, :, : min(i, 2) + 1].mean(dim=2) for i in range(5)], dim=2)
    torch.testing.assert_close(out, expected)


def test_a_misspelt_kind_or_mechanism_lists_the_toy_registry_names():
    with pytest.raises(ValidationError, match=r"expected tags: 'mha', .*, 'hyper', 'mean' \["):
        _cfg({"kind": "meen"})
    with pytest.raises(ValidationError, match=r"expected tags: 'exact', 'linformer', 'hyper', 'mean' \["):
        _cfg({"kind": "mha", "mechanism": {"kind": "meen"}})


@pytest.mark.parametrize("kind", ["mha", "gqa", "mhe"])
def test_projection_kinds_of_the_toy_registry_cross_with_the_toy_mechanism(kind):
    cfg = _cfg({"kind": kind, "heads": 4, "mechanism": {"kind": "mean", "value_scale": 3.0}})
    assert cfg.attention.mechanism.value_scale == 3.0
    model = LanguageModel(cfg, VOCAB, causal=False)
    assert isinstance(model.stack.layers[1].attn.mechanism, MeanMechanism)


def test_the_project_registry_is_left_as_it_was():
    with pytest.raises(ValidationError, match="'mean' found using 'kind' does not match any of the expected tags: "
                                              r"'mha', 'sha', .*, 'hyper' \["):
        ModelConfig(attention={"kind": "mean"})
    with pytest.raises(ValidationError, match=r"expected tags: 'exact', 'linformer', 'hyper' \["):
        ModelConfig(attention={"kind": "mha", "mechanism": {"kind": "mean"}})
    assert "mean" not in ModelConfig.attention_registry.kinds and "mean" in ToyModelConfig.attention_registry.kinds
