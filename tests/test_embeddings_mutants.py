"""Embeddings: the documented initial scales, the position tables against their formulas, dtypes under
autocast, and the builders. Written against mutants that tests/test_embeddings.py let live
(docs/mutation_testing.md); each test checks a value against an independent computation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from models import ModelConfig
from models.embeddings import (
    AdaptiveInput,
    DeFINEEmbedding,
    GroupLinear,
    LearnedPositions,
    SinusoidalPositions,
    StandardEmbedding,
    build_positions,
    build_token_embedding,
    split_mix,
)

V, D = 40, 32


def assert_std(weight: torch.Tensor, expected: float, rel: float = 0.06) -> None:
    """The sample std of a normal init is within `rel` of the documented one (thousands of draws: the
    sample's relative error is about 1/sqrt(2 n) < 1%)."""
    assert weight.numel() >= 2000
    std = weight.detach().double().std().item()
    assert abs(std - expected) <= rel * expected, (std, expected)


def define_cfg(**knobs):
    block = {"kind": "define", "input_dim": 16, "width": 64, "depth": 3, "g_max": 4, **knobs}
    return ModelConfig(
        d_model=D, layers=1, ffn=2 * D, max_seq_len=32, attention={"kind": "mha", "heads": 2}, embedding=block
    )


def test_standard_table_has_std_d_model_to_the_minus_half():
    torch.manual_seed(0)
    assert_std(StandardEmbedding(500, 64).table.weight, 64**-0.5)


def test_group_linear_init_is_uniform_within_the_fan_in_bound():
    """Each group's matrix is U(-b, b) with b = (in / g)^-1/2, the fan-in of one group (nn.Linear's rule)."""
    torch.manual_seed(0)
    layer = GroupLinear(64, 256, groups=4)  # fan-in 16 per group: b = 0.25
    bound = 16**-0.5
    w = layer.weight.detach()
    assert w.abs().max() <= bound
    assert w.min() < -0.95 * bound and w.max() > 0.95 * bound
    assert abs(w.mean().item()) < 0.1 * bound


def test_split_mix_takes_any_leading_shape():
    """A flat [N, I] input (the function's own naming) gives [N, I + H], the same rows as a [B, T, I] one."""
    e, h = torch.randn(6, 8), torch.randn(6, 12)
    flat = split_mix(e, h, groups=4)
    assert flat.shape == (6, 20)
    torch.testing.assert_close(flat.view(2, 3, 20), split_mix(e.view(2, 3, 8), h.view(2, 3, 12), groups=4))
    torch.testing.assert_close(flat[:, :5], torch.cat([e[:, :2], h[:, :3]], -1))


def test_define_scales_and_the_count_of_other_parameters():
    """Table std n^-1/2, tied projection std d_model^-1/2 and bias-free; `other` holds exactly the tied
    projection P (d_model x n) and the output LayerNorm (2 d_model)."""
    torch.manual_seed(0)
    cfg = define_cfg(input_dim=64, width=64, depth=2, g_max=2).embedding
    emb = DeFINEEmbedding(cfg, 200, 128, tie_output=True)
    assert_std(emb.table.weight, 64**-0.5)
    assert emb.output_projection.bias is None
    assert_std(emb.output_projection.weight, 128**-0.5)
    assert emb.reduce.bias is None
    counts = emb.parameter_counts()
    assert counts["other"] == 128 * 64 + 2 * 128
    assert sum(counts.values()) == sum(p.numel() for p in emb.parameters())


def test_adaptive_bands_scales_and_bias_free_projections():
    """Band tables have std d_i^-1/2 (unit-norm rows), projections std d_model^-1/2 and no bias."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, embedding={"kind": "adaptive", "cutoffs": [100, 300]}).embedding
    emb = AdaptiveInput(cfg, 1000, 64)
    for table, proj, d in zip(emb.tables, emb.projections, [64, 16, 4]):
        assert_std(table.weight, d**-0.5, rel=0.1)
        assert proj.bias is None
    assert_std(torch.cat([p.weight.flatten() for p in emb.projections]), 64**-0.5, rel=0.1)


def test_adaptive_refuses_a_last_cutoff_beyond_the_vocabulary_with_three_bands():
    cfg = ModelConfig(d_model=D, embedding={"kind": "adaptive", "cutoffs": [4, 8, V], "factor": 2.0}).embedding
    with pytest.raises(ValueError, match="drop or lower the last cutoff$"):
        AdaptiveInput(cfg, V, D)


def test_adaptive_output_keeps_the_weights_dtype_and_matches_fp32_under_autocast():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=D, embedding={"kind": "adaptive", "cutoffs": [10, 25]}).embedding
    emb = AdaptiveInput(cfg, V, D)
    tokens = torch.tensor([[0, 9, 10, 24, 25, V - 1]])
    expected = emb(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = emb(tokens)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, expected, atol=0.05, rtol=0.02)
    emb64 = emb.double()
    out64 = emb64(tokens)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, emb64.output_weight()[tokens[0]][None] * math.sqrt(D))


def test_build_token_embedding_ties_define_and_names_an_unknown_kind():
    cfg = define_cfg()
    assert cfg.tie_output
    emb = build_token_embedding(cfg, V)
    assert isinstance(emb, DeFINEEmbedding) and emb.output_weight().shape == (V, D)
    untied = build_token_embedding(cfg.model_copy(update={"tie_output": False}), V)
    assert untied.output_weight() is None
    with pytest.raises(ValueError, match=r"model.embedding.kind='other' is not known"):
        build_token_embedding(SimpleNamespace(embedding=SimpleNamespace(kind="other"), d_model=D), V)


def test_sinusoidal_table_is_vaswanis_formula():
    """PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d)) (Vaswani et al. 2017, Sec. 3.5),
    written out entry by entry in float64; a buffer that is not saved in checkpoints."""
    max_len, d = 50, 12
    pe = SinusoidalPositions(max_len, d)
    expected = torch.zeros(max_len, d, dtype=torch.float64)
    for p in range(max_len):
        for i in range(d // 2):
            angle = p / 10000 ** (2 * i / d)
            expected[p, 2 * i], expected[p, 2 * i + 1] = math.sin(angle), math.cos(angle)
    assert pe.table.dtype == torch.float32
    torch.testing.assert_close(pe.table.double(), expected, atol=2e-5, rtol=0)
    torch.testing.assert_close(pe(7), pe.table[:7])
    assert pe(7).shape == (7, d)
    assert "table" in dict(pe.named_buffers()) and "table" not in pe.state_dict()


def test_learned_positions_init_std_and_build_positions():
    torch.manual_seed(0)
    assert_std(LearnedPositions(200, 64).table, 0.02)
    base = {"d_model": D, "layers": 1, "ffn": 2 * D, "max_seq_len": 24, "attention": {"kind": "mha", "heads": 2}}
    learned = build_positions(ModelConfig(**base))
    assert isinstance(learned, LearnedPositions) and learned.table.shape == (24, D)
    sinusoidal = build_positions(ModelConfig(**base, positional="sinusoidal"))
    assert isinstance(sinusoidal, SinusoidalPositions) and sinusoidal.table.shape == (24, D)
    assert build_positions(ModelConfig(**base, positional="relative")) is None
