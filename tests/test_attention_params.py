"""Parameter counts against the MHE paper's formulas (Table 4 and the BERT-base totals) and Linformer's
extra k x n matrices per sharing mode."""

from __future__ import annotations

import pytest
import torch.nn as nn

from models import LanguageModel, ModelConfig
from models.attention import build_attention
from tests.attention_cases import attention_cfg

N, D = 4, 8  # heads, head dim; d_m = n d = 32
DM = N * D

# Q/K/V parameters per layer, output projection excluded (MHE Table 4 as reconstructed in papers/mhe.md).
QKV_FORMULA = {
    "mha": 3 * N**2 * D**2,
    "sha": 3 * N * D**2,
    "mhe": 3 * N * D**2 + 3 * N * D,
    "el_att": N**2 * D**2,
    "mqa": N**2 * D**2 + 2 * N * D**2,
    "skv": 2 * N**2 * D**2,
}


@pytest.mark.parametrize("kind", sorted(QKV_FORMULA))
@pytest.mark.parametrize("with_output", [False, True], ids=["output-excluded", "output-included"])
def test_counts_match_mhe_table_4(kind, with_output):
    attn = build_attention(attention_cfg(kind, d_model=DM, heads=N), 0, nn.ModuleDict())
    expected = QKV_FORMULA[kind] + (DM * DM if with_output else 0)
    got = attn.attention_parameters() - (0 if with_output else attn.projection.out.weight.numel())
    assert got == expected


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_gqa_count_interpolates_mqa_and_mha(groups):
    attn = build_attention(attention_cfg("gqa", d_model=DM, heads=N, groups=groups), 0, nn.ModuleDict())
    assert attn.attention_parameters() == N**2 * D**2 + 2 * groups * N * D**2 + DM * DM


@pytest.mark.parametrize(
    "kind,millions", [("mhe", 8.88), ("mqa", 15.34), ("skv", 21.23), ("sha", 8.85), ("mha", 28.31)]
)
def test_bert_base_totals_stated_in_the_mhe_paper(kind, millions):
    """12 layers, d_m = 768, 12 heads, W^O included, no biases: 8.88M / 15.34M / 21.23M (MHE §4.7)."""
    per_layer = build_attention(attention_cfg(kind, d_model=768, heads=12, max_len=512), 0, nn.ModuleDict())
    assert round(12 * per_layer.attention_parameters() / 1e6, 2) == millions


def test_mhe_has_3nd_more_than_sha():
    sha = build_attention(attention_cfg("sha", d_model=768, heads=12), 0, nn.ModuleDict())
    mhe = build_attention(attention_cfg("mhe", d_model=768, heads=12), 0, nn.ModuleDict())
    assert mhe.attention_parameters() - sha.attention_parameters() == 3 * 12 * 64 == 2304


K, MAXLEN, LAYERS = 8, 32, 3


@pytest.mark.parametrize(
    "sharing,extra_per_model",
    [
        ("none", LAYERS * 2 * N * K * MAXLEN),
        ("headwise", LAYERS * 2 * K * MAXLEN),
        ("kv", LAYERS * K * MAXLEN),
        ("layerwise", K * MAXLEN),
    ],
)
def test_linformer_extra_matrices_per_sharing_mode(sharing, extra_per_model):
    def model(attention):
        cfg = ModelConfig(d_model=DM, layers=LAYERS, ffn=64, max_seq_len=MAXLEN, attention=attention)
        return LanguageModel(cfg, vocab_size=50, causal=False)

    lin = model({"kind": "linformer", "heads": N, "k": K, "sharing": sharing})
    mha = model({"kind": "mha", "heads": N})
    assert lin.attention_parameters() - mha.attention_parameters() == extra_per_model
    assert lin.parameter_counts()["total"] - mha.parameter_counts()["total"] == extra_per_model


def test_linformer_conv_projection_counts_one_kernel_per_projection():
    stride = MAXLEN // K
    attn = build_attention(
        attention_cfg("linformer", d_model=DM, heads=N, k=K, sharing="kv", projection="conv"), 0, nn.ModuleDict()
    )
    assert attn.attention_parameters() == 4 * DM * DM + D * D * stride


def test_linformer_nonuniform_k_per_layer():
    cfg = ModelConfig(d_model=DM, layers=3, ffn=64, max_seq_len=MAXLEN,
                      attention={"kind": "linformer", "heads": N, "k": [16, 8, 4], "sharing": "kv"})
    lm = LanguageModel(cfg, vocab_size=50, causal=False)
    extras = [layer.attn.mechanism.attention_parameters() for layer in lm.stack.layers]
    assert extras == [16 * MAXLEN, 8 * MAXLEN, 4 * MAXLEN]


def test_model_reports_attention_and_total_counts():
    cfg = ModelConfig(d_model=DM, layers=2, ffn=64, max_seq_len=MAXLEN, attention={"kind": "mha", "heads": N})
    counts = LanguageModel(cfg, vocab_size=50, causal=True).parameter_counts()
    assert counts["attention"] == 2 * 4 * DM * DM
    assert counts["total"] > counts["attention"]
