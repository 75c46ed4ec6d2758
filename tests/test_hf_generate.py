"""Cached decoding and batch independence of patched Hugging Face models (models/hf_patching.py).

Tiny random-weight models of five families are built from configs (no download): Llama (4 query heads over 2
key/value heads), GPT-2 (per-layer 1/(l+1) logit scale), Qwen2 (biased q/k/v), Phi (partial rotary) and Mistral
(its sliding window, longer than every input here). The definition a cached step must meet is uncached scoring:
the logits of a step equal the last position's logits of the whole prefix scored with use_cache=False, so greedy
generate() gives the same tokens either way. A cache holds keys made at shorter lengths, so it can meet that
definition only above layers whose earlier outputs do not move as tokens are appended: exact attention and LSH with
a fixed n_buckets through every layer; HyperAttention and LSH with the default n_buckets as the model's last layer,
and below another layer through generate()'s default, which patching turns to use_cache=False there (a cached
step asked for is refused, `test_a_stale_cache_is_refused_naming_the_fixes`).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from benchmarks.system.host_reads import HostReads
from models.attention.exact import ExactMechanism
from models.attention.hyper import HyperMechanism, HyperMechanismConfig
from models.attention.lsh import LSHMechanismConfig
from models.dropin import PatchConfig, build_dropin_mechanism
from models.hf_patching import patch_hf_model

VOCAB, LAYERS, PROMPT, NEW = 100, 2, 13, 20
HYPER = {"kind": "hyper", "min_seq_len": 8, "block_size": 4, "sample_size": 4, "lsh_bits": 2}
LSH_FIXED = {"kind": "lsh", "bucket_size": 4, "n_hashes": 2, "n_buckets": 8}
LSH_DEFAULT = {"kind": "lsh", "bucket_size": 4, "n_hashes": 2}
PATCHES = {
    # every layer: appending tokens changes no earlier output, so every layer's cached keys are current
    "exact": PatchConfig(layers="all", attention={"kind": "exact"}),
    "lsh-fixed-buckets": PatchConfig(layers="all", attention=LSH_FIXED),
    # the last layer: its cached keys come from exact layers; its own rows are recomputed as the full pass's
    "hyper-last": PatchConfig(layers="last:1", attention=HYPER),
    "lsh-default-buckets-last": PatchConfig(layers="last:1", attention=LSH_DEFAULT),
    # below another layer: generate()'s default becomes use_cache=False (each step scores the whole prefix)
    "hyper-all": PatchConfig(layers="all", attention=HYPER),
    "lsh-default-buckets-all": PatchConfig(layers="all", attention=LSH_DEFAULT),
}


DECODER = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
           "num_attention_heads": 4, "max_position_embeddings": 128, "attn_implementation": "sdpa"}
"""The size every family but GPT-2 (which names its fields its own way) is built at; GQA ones add 2 key/value heads."""


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER, num_key_value_heads=2))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=128, scale_attn_by_inverse_layer_idx=True,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=0))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER, num_key_value_heads=2))


def phi():
    return transformers.PhiForCausalLM(transformers.PhiConfig(**DECODER, partial_rotary_factor=0.5))


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**DECODER, num_key_value_heads=2,
                                                                      sliding_window=4096))


FAMILIES = {"llama": llama, "gpt2": gpt2, "qwen2": qwen2, "phi": phi, "mistral": mistral}


def build(family: str, patch: PatchConfig | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    if patch is not None:
        patch_hf_model(model, patch)
    return model


def prompt(batch: int = 1, length: int = PROMPT, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, **kwargs) -> torch.Tensor:
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)
    return out[:, ids.shape[1]:]


# ---- generate(): the cache's tokens are uncached scoring's


@pytest.mark.parametrize("kind", sorted(PATCHES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_greedy_generation_gives_the_tokens_of_uncached_generation(family, kind):
    model = build(family, PATCHES[kind])
    ids = prompt()
    cached = greedy(model, ids)
    assert torch.equal(cached, greedy(model, ids, use_cache=False))
    if kind == "exact":  # the control: the model's own tokens
        assert torch.equal(cached, greedy(build(family), ids))


@pytest.mark.parametrize("kind", sorted(kind for kind in PATCHES if not kind.endswith("-all")))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_cached_step_has_the_logits_of_the_whole_prefix(family, kind):
    """Prefill, then one token per step over the cache: the step's logits are the last position's logits of the
    whole prefix scored without a cache (the mechanism's own definition there), to float32 rounding."""
    model = build(family, PATCHES[kind])
    ids = prompt(length=PROMPT + 12)
    with torch.no_grad():
        out = model(ids[:, :PROMPT], use_cache=True)
        cache = out.cache
        for t in range(PROMPT, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            whole = model(ids[:, :t + 1], use_cache=False).logits[:, -1]
            torch.testing.assert_close(out.logits[:, -1], whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["lsh-fixed-buckets", "hyper-last"])
def test_left_padded_batched_generation_gives_each_prompt_its_own_tokens(kind):
    """generate() left-pads a batch of prompts; each row decodes over its own tokens, cache included."""
    model = build("llama", PATCHES[kind])
    short, long = prompt(length=9, seed=2), prompt(length=PROMPT, seed=3)
    ids = torch.cat([torch.cat([torch.zeros(1, PROMPT - 9, dtype=torch.long), short], 1), long])
    mask = (torch.arange(PROMPT) >= torch.tensor([[PROMPT - 9], [0]])).long()
    batched = greedy(model, ids, attention_mask=mask)
    assert torch.equal(batched[0], greedy(model, short)[0])
    assert torch.equal(batched[1], greedy(model, long)[0])


def test_a_padded_step_reads_the_mask_back_once_whatever_the_patched_layers():
    """transformers hands one mask tensor to every layer: its check and its rows' grouping, which read values back
    from the device, run once a forward. A left-padded cached step of a model patched in every layer reads as much
    with 4 layers as with 2 (it read about 6 times a layer)."""
    def reads_of_a_step(layers: int) -> int:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{**DECODER, "num_hidden_layers": layers}, num_key_value_heads=2)).eval()
        patch_hf_model(model, PATCHES["lsh-fixed-buckets"])
        short = torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt(length=PROMPT - 4, seed=2)], 1)
        ids = torch.cat([short, prompt(length=PROMPT, seed=3)])
        mask = (torch.arange(PROMPT) >= torch.tensor([[4], [0]])).long()
        with torch.no_grad():
            cache = model(ids, attention_mask=mask, use_cache=True).cache
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            with HostReads() as reads:
                model(torch.tensor([[5], [6]]), attention_mask=step_mask, cache=cache, use_cache=True)
        return reads.count

    two, four = reads_of_a_step(2), reads_of_a_step(4)
    assert 0 < two == four, (two, four)


@pytest.mark.parametrize("attention,limit", [(HYPER, 8), (LSH_DEFAULT, 5)], ids=["hyper", "lsh-default-buckets"])
def test_a_stale_cache_is_refused_naming_the_fixes(attention, limit):
    """Below another layer, a mechanism whose earlier outputs move as tokens are appended would leave that layer's
    cache holding other keys than a full pass makes: the model's generation default is then no cache, and a
    cached step asked for is refused once the cache is stale. Patching only the last layer gives the model its
    own default back."""
    model = build("llama", PatchConfig(layers="all", attention=attention))
    assert model.generation_config.use_cache is False
    ids = prompt(length=limit - 1)
    with pytest.raises(ValueError, match=f"cached decoding at {limit + 1} tokens: layer 0's .* beyond {limit} "
                                         ".*use_cache=False.*only the model's last layer"):
        greedy(model, ids, use_cache=True)
    assert torch.equal(greedy(model, ids), greedy(model, ids, use_cache=False))
    patch_hf_model(model, PatchConfig(layers="last:1", attention=attention))
    assert model.generation_config.use_cache is True


@pytest.mark.parametrize("attention,stable", [(HYPER, False), (LSH_DEFAULT, False), (LSH_FIXED, True)],
                         ids=["hyper", "lsh-default-buckets", "lsh-fixed-buckets"])
def test_which_mechanisms_change_earlier_outputs_when_tokens_are_appended(attention, stable):
    """Why the refusal above: HyperAttention's halves and the default LSH bucket count follow the whole length,
    so appending tokens moves the outputs at earlier positions; a fixed bucket count does not."""
    model = build("llama", PatchConfig(layers="all", attention=attention))
    ids = prompt(length=40)
    with torch.no_grad():
        whole, prefix = model(ids, use_cache=False).logits, model(ids[:, :29], use_cache=False).logits
    moved = (whole[:, :29] - prefix).abs().max()
    assert (moved < 1e-5) if stable else (moved > 1e-2)


# ---- the mechanisms' cached rows are the last rows of their causal pass


MECHANISMS = {
    "exact": lambda: ExactMechanism(),
    "hyper": lambda: HyperMechanism(HyperMechanismConfig(**{k: v for k, v in HYPER.items() if k != "kind"}), 8, 1),
    "lsh-default-buckets": lambda: build_dropin_mechanism(LSHMechanismConfig(bucket_size=4, n_hashes=2), 8, 1),
    "lsh-fixed-buckets": lambda: build_dropin_mechanism(LSHMechanismConfig(bucket_size=4, n_hashes=2, n_buckets=6),
                                                        8, 1),
}


@pytest.mark.parametrize("kind", sorted(MECHANISMS))
def test_causal_last_rows_are_the_last_rows_of_the_causal_pass(kind):
    """Lengths below, at and above min_seq_len, odd ones (hyper pads a row) and several last rows at once, in
    float64: the rows come from the same hashes, samples and blocks as the whole pass's."""
    mechanism = MECHANISMS[kind]().eval()
    gen = torch.Generator().manual_seed(0)
    for S in (5, 8, 9, 16, 17, 23, 40):
        q, k, v = (2 * torch.randn(2, 3, S, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        whole = mechanism(q, k, v, causal=True)
        for T in (1, 4):
            rows = mechanism.causal_last_rows(q[:, :, S - T:], k, v)
            torch.testing.assert_close(rows, whole[:, :, S - T:], atol=1e-10, rtol=1e-10, msg=f"S={S}, T={T}")


# ---- a row's result does not depend on its batch


def documents() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in (40, 29, 17, 29)]


def scored(model, docs, order, length, left=False) -> dict[int, torch.Tensor]:
    """Per-document logits of one batch of docs[order], padded to `length` on the right (or left)."""
    ids = torch.zeros(len(order), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, i in enumerate(order):
        place = slice(length - len(docs[i]), length) if left else slice(0, len(docs[i]))
        ids[row, place], mask[row, place] = docs[i], 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # a left-padded row's tokens keep their own positions
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return {i: logits[row, mask[row].bool()] for row, i in enumerate(order)}


@pytest.mark.parametrize("attention", [HYPER, LSH_DEFAULT], ids=["hyper", "lsh"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_documents_scores_do_not_depend_on_its_batch(family, attention):
    """The same documents alone, in two right-padded batches of other orders and lengths, and left-padded:
    bitwise the same logits for every document."""
    model = build(family, PatchConfig(layers="all", attention=attention))
    docs = documents()
    alone = {i: scored(model, docs, [i], len(doc))[i] for i, doc in enumerate(docs)}
    batchings = [scored(model, docs, [0, 1, 2, 3], 40), scored(model, docs, [2, 3, 0, 1], 48),
                 {**scored(model, docs, [1, 2], 33, left=True), **scored(model, docs, [3, 0], 45, left=True)}]
    for batching in batchings:
        for i in range(len(docs)):
            assert torch.equal(batching[i], alone[i]), f"document {i}"
