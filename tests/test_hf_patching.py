"""Drop-in attention in trained models (models/dropin.py, models/hf_patching.py).

Tiny random-weight Hugging Face models are built from configs (no download): Llama with grouped-query heads
(4 query heads over 2 key/value heads) and GPT-2 with its per-layer 1/(l+1) logit scale, so a wrong head layout,
a missed grouped-query repeat or a dropped model scale changes the logits. The adapter is proven where the
mechanisms are exact (the `exact` control; HyperAttention with min_seq_len above n, or with one block of every key
and no samples through its whole causal recursion; LSH with one chunk under paper routing, put in by hand since a
patch cannot choose it): there the patched model's logits equal the model's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models import ModelConfig
from models.attention.hyper import HyperMechanism
from models.attention.lsh import LSHMechanism, LSHMechanismConfig
from models.dropin import (
    PatchConfig,
    build_dropin_mechanism,
    patch_project_model,
    selected_layers,
)
from models.hf_patching import (
    DROPIN_ATTENTION,
    attention_modules,
    key_padding_from_mask,
    mechanisms_detached,
    patch_hf_model,
    register_dropin_attention,
)
from models.transformer import LanguageModel

T, VOCAB, LAYERS = 40, 97, 3
HYPER_ACTIVE = {"kind": "hyper", "min_seq_len": 8, "block_size": 4, "sample_size": 4, "lsh_bits": 2}
LSH_ACTIVE = {"kind": "lsh", "bucket_size": 4, "n_hashes": 2}


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=128,
                                     scale_attn_by_inverse_layer_idx=True, attn_implementation="sdpa",
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


MODELS = {"llama": llama, "gpt2": gpt2}


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def tokens(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


def logits(model, ids, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits


def put_mechanism(model, config, layers="all"):
    """Patch, then swap in a mechanism built from `config` (for configs PatchConfig refuses, e.g. paper routing
    with one chunk, which reads no future because the chunk is the whole sequence)."""
    chosen = patch_hf_model(model, PatchConfig(layers=layers))
    modules = attention_modules(model)
    for index in chosen:
        modules[index].dropin_mechanism = build_dropin_mechanism(config, 16, index).eval()


# ---- exact regimes: the adapter's layout, scaling, mask and grouped-query handling


@pytest.mark.parametrize("attention", [
    {"kind": "exact"},  # the control: the model's own attention through the adapter
    {"kind": "hyper", "min_seq_len": 64},  # shorter than min_seq_len: the mechanism's exact path
    # the full causal recursion and past-only placement, with one block holding every key and no samples
    {"kind": "hyper", "min_seq_len": 8, "block_size": 64, "sample_size": 0, "lsh_bits": 3},
])
def test_hyper_in_its_exact_regime_leaves_the_logits_unchanged(model, attention):
    ids = tokens()
    reference = logits(model, ids)
    assert patch_hf_model(model, PatchConfig(layers="all", attention=attention)) == list(range(LAYERS))
    torch.testing.assert_close(logits(model, ids), reference, atol=2e-5, rtol=1e-4)


def test_lsh_with_one_chunk_leaves_the_logits_unchanged(model):
    """The adapter with LSH where LSH is exact: paper routing with one chunk, which PatchConfig refuses (it is
    put in by hand), so this proves the adapter's layout, not a regime a patch can reach."""
    ids = tokens()
    reference = logits(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the paper-routing warning: one chunk holds the whole sequence
        put_mechanism(model, LSHMechanismConfig(bucket_size=64, n_hashes=2, causal_routing="paper"))
        torch.testing.assert_close(logits(model, ids), reference, atol=2e-5, rtol=1e-4)


def test_lsh_has_no_exact_regime_under_the_routing_a_patch_can_use(model):
    """PatchConfig takes past-only routing only (paper routing reads the future), under which a query sees no
    earlier key hashed to another bucket, even with one chunk of every key: the docs do not list LSH as exact, and
    this is why (the adapter itself is exact under paper routing with one chunk, the test above)."""
    ids = tokens()
    reference = logits(model, ids)
    patch_hf_model(model, PatchConfig(layers="all", attention={"kind": "lsh", "bucket_size": 64, "n_hashes": 2}))
    assert (logits(model, ids) - reference).abs().max() > 1e-2


def test_padding_reaches_the_mechanism_through_the_registered_mask_function():
    model = llama()
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding of row 0
    mask[1, -5:] = 0  # right padding of row 1
    reference = logits(model, ids, mask)
    patch_hf_model(model, PatchConfig(layers="all", attention={"kind": "hyper", "min_seq_len": 8,
                                                               "block_size": 64, "sample_size": 0}))
    patched = logits(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(patched[real], reference[real], atol=2e-5, rtol=1e-4)
    # ... and the padding changes the patched result: without it the real rows would differ
    unmasked = logits(model, ids)
    assert (unmasked[0, 7:] - patched[0, 7:]).abs().max() > 1e-3


# ---- with the mechanisms active


@pytest.mark.parametrize("attention", [HYPER_ACTIVE, LSH_ACTIVE], ids=["hyper", "lsh"])
def test_patched_model_is_causal_in_value(model, attention):
    patch_hf_model(model, PatchConfig(layers="all", attention=attention))
    ids = tokens()
    reference = logits(model, ids)
    assert torch.equal(logits(model, ids), reference)  # evaluation repeats its hashes and samples
    for j in (1, 17, 25, T - 1):
        changed = ids.clone()
        changed[:, j:] = (changed[:, j:] + 1 + torch.arange(T - j)) % VOCAB
        after = logits(model, changed)
        assert (after[:, :j] - reference[:, :j]).abs().max() == 0, f"a logit before {j} read a later token"
        assert (after[:, j:] - reference[:, j:]).abs().max() > 0


@pytest.mark.parametrize("selector,expected", [(2, [1, 2]), ("last:1", [2]), ("first:1", [0]), ("every:2", [0, 2]),
                                               ("0,2", [0, 2]), ("all", [0, 1, 2]), (0, []), ("none", [])])
def test_only_the_selected_layers_run_the_mechanism(selector, expected):
    model = llama()
    chosen = patch_hf_model(model, PatchConfig(layers=selector, attention=HYPER_ACTIVE))
    assert chosen == expected
    calls: list[int] = []
    for index, module in attention_modules(model).items():
        mechanism = getattr(module, "dropin_mechanism", None)
        if mechanism is not None:
            assert isinstance(mechanism, HyperMechanism) and not mechanism.training
            mechanism.register_forward_hook(lambda *_, index=index: calls.append(index))
    out = logits(model, tokens())
    assert calls == expected
    if not expected:
        torch.testing.assert_close(out, logits(llama(), tokens()))


def test_mechanisms_detached_runs_the_unpatched_model():
    model = llama()
    ids = tokens()
    reference = logits(model, ids)
    patch_hf_model(model, PatchConfig(layers="all", attention=HYPER_ACTIVE))
    patched = logits(model, ids)
    assert (patched - reference).abs().max() > 1e-3
    with mechanisms_detached(model):
        assert torch.equal(logits(model, ids), reference)
    assert torch.equal(logits(model, ids), patched)


def test_repatching_replaces_the_previous_selection():
    model = llama()
    patch_hf_model(model, PatchConfig(layers="all", attention=LSH_ACTIVE))
    patch_hf_model(model, PatchConfig(layers="last:1", attention=HYPER_ACTIVE))
    held = {i: type(getattr(m, "dropin_mechanism", None)) for i, m in attention_modules(model).items()}
    assert held == {0: type(None), 1: type(None), 2: HyperMechanism}


@pytest.mark.parametrize("selector", ["last:4", "0,3"])
def test_a_refused_repatch_leaves_the_model_as_it_was(selector):
    """The selector is checked before anything in the model changes: after the refusal the model runs the
    mechanisms of the previous patch (same logits, bit for bit) and still names the adapter."""
    model = llama()
    ids = tokens()
    patch_hf_model(model, PatchConfig(layers="all", attention=LSH_ACTIVE))
    before = logits(model, ids)
    held = {i: getattr(m, "dropin_mechanism", None) for i, m in attention_modules(model).items()}
    with pytest.raises(ValueError, match="layer"):
        patch_hf_model(model, PatchConfig(layers=selector, attention=HYPER_ACTIVE))
    assert {i: getattr(m, "dropin_mechanism", None) for i, m in attention_modules(model).items()} == held
    assert model.config._attn_implementation == DROPIN_ATTENTION
    assert torch.equal(logits(model, ids), before)


def test_a_model_that_refuses_the_adapter_is_left_unpatched(monkeypatch):
    """A model whose set_attn_implementation does not take the adapter keeps its own attention and no
    mechanism: it runs exactly as before the call."""
    model = llama()
    ids = tokens()
    before = logits(model, ids)
    monkeypatch.setattr(model, "set_attn_implementation", lambda name: None)
    with pytest.raises(ValueError, match="did not accept"):
        patch_hf_model(model, PatchConfig(layers="all", attention=LSH_ACTIVE))
    assert not any(hasattr(m, "dropin_mechanism") for m in attention_modules(model).values())
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids), before)


def mistral(window: int) -> torch.nn.Module:
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=window, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).eval()


@pytest.mark.parametrize("window", [4096, T])
def test_a_sliding_window_at_least_the_input_is_patched(window):
    """Over at most `window` keys a sliding window is plain causal attention (MistralConfig's default 4096 at a
    short input; a window of exactly T): the layers are patched, and in the exact regime the logits are the
    model's."""
    model = mistral(window)
    ids = tokens()
    reference = logits(model, ids)
    patch_hf_model(model, PatchConfig(layers="all", attention={"kind": "hyper", "min_seq_len": 64}))
    torch.testing.assert_close(logits(model, ids), reference, atol=2e-5, rtol=1e-4)


def test_a_sliding_window_shorter_than_the_input_is_refused_with_both_lengths():
    model = mistral(T - 1)
    patch_hf_model(model, PatchConfig(layers="all", attention={"kind": "hyper", "min_seq_len": 64}))
    with pytest.raises(ValueError, match=f"sliding attention window of {T - 1} keys, shorter than the {T} keys"):
        logits(model, tokens())


def test_lsh_drop_in_attends_to_its_own_key_with_the_models_scale():
    mechanism = build_dropin_mechanism(PatchConfig(attention=LSH_ACTIVE).attention, 16, 0)
    assert isinstance(mechanism, LSHMechanism) and mechanism.self_mask is False and mechanism.scale is None


def test_a_missing_mask_function_fails_loudly():
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )

    model = llama()
    patch_hf_model(model, PatchConfig(layers="all", attention=HYPER_ACTIVE))
    saved = AttentionMaskInterface._global_mapping.pop(DROPIN_ATTENTION)
    try:
        assert DROPIN_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS
        with pytest.raises(RuntimeError, match="mask function"):
            logits(model, tokens())
    finally:
        AttentionMaskInterface._global_mapping[DROPIN_ATTENTION] = saved
    register_dropin_attention()
    logits(model, tokens())


# ---- refusals


@pytest.mark.parametrize("kind", ["linformer", "mhe", "gqa"])
def test_mechanisms_with_trained_weights_are_refused_with_the_fine_tuning_route(kind):
    with pytest.raises(ValueError, match=f"kind={kind} cannot be dropped into a trained model.*fine-tune"):
        PatchConfig(layers=1, attention={"kind": kind})


@pytest.mark.parametrize("kind", ["hyper", "lsh"])
def test_future_reading_routing_is_refused(kind):
    with pytest.raises(ValueError, match="causal_routing must be past_only"):
        PatchConfig(layers=1, attention={"kind": kind, "causal_routing": "paper"})


@pytest.mark.parametrize("selector,message", [("last:4", "asks for 4 layers but the model has 3"),
                                              ("0,3", "names layer 3"), ("middle", "is not a layer selector"),
                                              (-1, "is not a layer selector"), ("every:0", "not a layer selector")])
def test_bad_layer_selectors_are_refused(selector, message):
    with pytest.raises(ValueError, match=message):
        selected_layers(selector, LAYERS)


def test_masks_other_than_causal_plus_padding_are_refused():
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    window = causal & ~torch.ones(T, T, dtype=torch.bool).tril(-8)
    with pytest.raises(ValueError, match="sliding window"):
        key_padding_from_mask(window[None, None], True, T, T)
    padded = causal[None, None].repeat(2, 1, 1, 1)
    padded[1, :, :, 30:] = False
    padding = key_padding_from_mask(padded, True, T, T)
    assert padding[0].sum() == 0 and padding[1].tolist() == [False] * 30 + [True] * 10


# ---- the project's own trained models


def project_lm() -> LanguageModel:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, layers=LAYERS, ffn=64, max_seq_len=64, dropout=0.0,
                      attention={"kind": "mha", "heads": 2})
    return LanguageModel(cfg, vocab_size=VOCAB, causal=True).eval()


def test_project_model_in_the_exact_regime_is_unchanged_and_active_patching_stays_causal():
    model = project_lm()
    ids = tokens()
    with torch.no_grad():
        reference = model(ids)
        patch_project_model(model, PatchConfig(layers="all", attention={"kind": "hyper", "min_seq_len": 8,
                                                                        "block_size": 64, "sample_size": 0}))
        torch.testing.assert_close(model(ids), reference, atol=2e-5, rtol=1e-4)
        model = project_lm()
        assert patch_project_model(model, PatchConfig(layers="last:2", attention=LSH_ACTIVE)) == [1, 2]
        assert [type(layer.attn.mechanism).__name__ for layer in model.stack.layers] == \
            ["ExactMechanism", "LSHMechanism", "LSHMechanism"]
        assert (model(ids) - reference).abs().max() > 1e-3
        patched = model(ids)
        changed = ids.clone()
        changed[:, 20:] = (changed[:, 20:] + 1) % VOCAB
        assert (model(changed)[:, :20] - patched[:, :20]).abs().max() == 0
