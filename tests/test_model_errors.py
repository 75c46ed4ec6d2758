"""Bad input gets a clear error that names the field and says how to fix it."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from models import LanguageModel, ModelConfig, Seq2SeqTransformer
from tests.attention_cases import make_attention


def _cfg(**attention):
    return ModelConfig(d_model=32, layers=2, ffn=64, max_seq_len=16, attention=attention)


def test_unknown_kind_lists_the_valid_kinds():
    with pytest.raises(ValidationError) as err:
        _cfg(kind="linfomer")
    msg = str(err.value)
    assert "linfomer" in msg and "attention" in msg and "'linformer'" in msg and "'mhe'" in msg


def test_heads_must_divide_d_model():
    with pytest.raises(ValidationError, match=r"model.attention.heads=5 does not divide model.d_model=32"):
        _cfg(kind="mha", heads=5)


@pytest.mark.parametrize("layers", [0, -1])
def test_decoder_layers_below_one_are_refused_naming_the_field(layers):
    with pytest.raises(ValidationError, match=rf"model.decoder_layers must be >= 1 \(got {layers}\); leave it unset"):
        ModelConfig(d_model=32, layers=2, decoder_layers=layers, ffn=64, max_seq_len=16, attention={"kind": "mha"})
    assert ModelConfig(d_model=32, layers=2, decoder_layers=1, ffn=64, max_seq_len=16).decoder_layers == 1


def test_gqa_groups_must_divide_heads():
    with pytest.raises(ValidationError, match=r"model.attention.groups=3"):
        _cfg(kind="gqa", heads=4, groups=3)


def test_linformer_k_larger_than_max_seq_len():
    with pytest.raises(ValidationError, match=r"model.attention.k=32 is larger than model.attention.max_seq_len=16"):
        _cfg(kind="linformer", k=32)


def test_linformer_k_list_must_have_one_value_per_layer():
    with pytest.raises(ValidationError, match=r"model.attention.k lists 3 values for 2 layers"):
        _cfg(kind="linformer", k=[8, 4, 2], sharing="headwise")


def test_linformer_pooling_needs_k_dividing_max_seq_len():
    with pytest.raises(ValidationError, match=r"divisible by k"):
        _cfg(kind="linformer", k=5, projection="mean")


def test_unknown_knob_is_refused():
    with pytest.raises(ValidationError, match=r"bucket_size"):
        _cfg(kind="mha", bucket_size=4)


def test_sequence_longer_than_max_seq_len_in_the_model():
    lm = LanguageModel(_cfg(kind="mha"), vocab_size=20, causal=False)
    with pytest.raises(ValueError, match=r"sequence length 20 exceeds model.max_seq_len=16"):
        lm(torch.zeros(1, 20, dtype=torch.long))


def test_sequence_longer_than_linformer_projection():
    attn = make_attention("linformer", k=4, max_len=16)
    with pytest.raises(ValueError, match=r"sequence length 20 exceeds model.attention.max_seq_len=16 of the Linformer "
                                         r"projection; raise max_seq_len"):
        attn(torch.randn(1, 20, 32))


def test_linformer_refuses_causal_use():
    with pytest.raises(ValueError, match=r"linformer cannot be used with causal attention"):
        LanguageModel(_cfg(kind="linformer", k=8), vocab_size=20, causal=True)
    with pytest.raises(ValueError, match=r"causal"):
        Seq2SeqTransformer(_cfg(kind="linformer", k=8), vocab_size=20)


@pytest.mark.parametrize("sharing", ["headwise", "none"], ids=["compress-input-first", "project-first"])
def test_linformer_attention_refuses_a_causal_call_on_both_paths(sharing):
    """Shared linear E compresses the layer input before W^K (attend_compressed); sharing none projects
    keys first (the mechanism's forward). A causal call must fail on both, not run bidirectionally."""
    attn = make_attention("linformer", k=4, sharing=sharing)
    with pytest.raises(ValueError, match=r"linformer cannot run causal attention: its sequence projection mixes "
                                         r"future tokens"):
        attn(torch.randn(1, 8, 32), causal=True)


def test_bad_key_padding_mask_shape():
    attn = make_attention("mha")
    with pytest.raises(ValueError, match=r"key_padding_mask has shape"):
        attn(torch.randn(2, 8, 32), key_padding_mask_BS=torch.zeros(2, 7, dtype=torch.bool))
