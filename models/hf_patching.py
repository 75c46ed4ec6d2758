"""The project's weight-free mechanisms (models/dropin.py) inside any Hugging Face decoder, through its registry.

transformers routes every attention call of its standard decoders (Llama, Mistral, Qwen2, GPT-2, Phi, ...)
through `AttentionInterface`: a function `fn(module, query, key, value, attention_mask, **kwargs) ->
(attn_output, attn_weights | None)` registered under a name and selected with
`model.set_attn_implementation(name)` (transformers docs, attention_interface.md). Since 4.53 the mask is made
by a function registered under the same name in `AttentionMaskInterface`; without one the mask arrives as None
and padding (and, for functions that do not read `module.is_causal`, causality) is silently lost. So both are
registered together here, and the attention function refuses to run when the mask function is missing.

One name, `DROPIN_ATTENTION`, serves every layer: a layer whose attention module holds a `dropin_mechanism`
(set by `patch_hf_model`) runs it; every other layer runs transformers' own SDPA function, so unpatched layers
are exactly the model's. What the adapter owns, and the tests pin (tests/test_hf_patching.py):
- layout: q [B, H, T, d] and k, v [B, G, S, d] in, [B, T, H, d] out, as transformers' functions return;
- grouped-query heads: k and v repeated to H heads with transformers' own `repeat_kv`;
- scaling: the model's `scaling` (GPT-2's per-layer 1/(l+1), a custom query scale) is folded into q as
  q * scaling * sqrt(d), because every mechanism applies 1/sqrt(d);
- masks: `module.is_causal` gives causality; a 4-D boolean mask is read back into per-key padding and must be
  exactly causal-plus-padding (packed sequences or a prefix mask are refused, not ignored; a sliding window
  is run where it has no effect, over at most its own length of keys, and refused where it would have one).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from models.dropin import PatchConfig, build_dropin_mechanism, selected_layers

DROPIN_ATTENTION = "orchestrator_dropin"
"""The name under which the adapter is registered in transformers' attention and mask interfaces."""

_UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping (Gemma 2)",
    "s_aux": "attention sinks (gpt-oss)",
}
"""Refused whenever a layer passes them. A sliding window (Mistral, Gemma) is refused only where it has an effect
(`_check_window`)."""


@functools.cache
def _transformers():
    """The parts of transformers the adapter uses, imported once on first use (the project's own models need none;
    the attention function runs on every layer's forward, so it does not repeat the imports)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import (
        repeat_kv,
        sdpa_attention_forward,
    )
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
        sdpa_mask,
    )

    return AttentionInterface, AttentionMaskInterface, ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask, repeat_kv, \
        sdpa_attention_forward


def register_dropin_attention() -> None:
    """Register the adapter and its mask function (SDPA's boolean mask) under `DROPIN_ATTENTION`; idempotent."""
    attention_interface, mask_interface, _, sdpa_mask, _, _ = _transformers()
    attention_interface.register(DROPIN_ATTENTION, dropin_attention_forward)
    mask_interface.register(DROPIN_ATTENTION, sdpa_mask)


def key_padding_from_mask(mask: torch.Tensor | None, causal: bool, T: int, S: int) -> torch.Tensor | None:
    """Per-key padding [B, S] (True = padding) of a 4-D mask [B, 1, T, S] (bool: True = may attend; float:
    additive), after checking that the mask is exactly causal-plus-padding on every real query row."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (T, S):
        raise ValueError(f"drop-in attention expects a [batch, 1, {T}, {S}] mask (got {tuple(mask.shape)}); "
                         "per-head masks are not supported")
    allowed_BTS = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min / 2
    padding_BS = ~allowed_BTS.any(dim=-2)
    expected_BTS = ~padding_BS[:, None, :].expand(-1, T, S)
    if causal:
        expected_BTS = expected_BTS & torch.ones(T, S, dtype=torch.bool, device=mask.device).tril(S - T)
    real_query_BT = ~padding_BS[:, S - T:] if S >= T else torch.ones(mask.shape[0], T, dtype=torch.bool)
    mismatch = (allowed_BTS != expected_BTS) & real_query_BT[:, :, None]
    if bool(mismatch.any()):
        raise ValueError("the model's attention mask is not causal attention over unpadded keys (a sliding window, "
                         "packed sequences or a prefix-LM mask?); drop-in attention supports causal masks with "
                         "padding only: leave those layers unpatched")
    return padding_BS if bool(padding_BS.any()) else None


def dropin_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q [B, H, T, d], k, v [B, G, S, d] -> ([B, T, H, d], None)."""
    _, _, all_masks, _, repeat_kv, sdpa_attention_forward = _transformers()
    mechanism = getattr(module, "dropin_mechanism", None)
    if mechanism is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if DROPIN_ATTENTION not in all_masks:
        raise RuntimeError(f"the mask function of {DROPIN_ATTENTION!r} is not registered, so transformers would "
                           "pass no mask and padding would be lost; call models.hf_patching."
                           "register_dropin_attention() (patch_hf_model does)")
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"layer {module.layer_idx} uses {what}, which the drop-in mechanisms do not "
                             "implement; leave this layer unpatched (task.patch.layers)")
    _check_window(module, kwargs.get("sliding_window"), key.shape[2])
    if dropout:
        raise ValueError(f"layer {module.layer_idx} has attention dropout {dropout} in training; the drop-in "
                         "mechanisms merge their parts through log-sum-exps and take no dropout: set the model's "
                         "attention dropout to 0")
    H, T, E = query.shape[1:]
    S = key.shape[2]
    if T != S:
        raise ValueError(f"drop-in attention scores whole sequences (got {T} queries over {S} cached keys); "
                         "run the patched model with use_cache=False, without a KV cache")
    key, value = repeat_kv(key, H // key.shape[1]), repeat_kv(value, H // value.shape[1])
    scale = E ** -0.5 if scaling is None else scaling
    query = query * (scale * E ** 0.5)
    causal = bool(getattr(module, "is_causal", True))
    padding_BS = key_padding_from_mask(attention_mask, causal, T, S)
    out_BHTE = mechanism(query, key, value, key_padding_mask_BS=padding_BS, causal=causal)
    return out_BHTE.transpose(1, 2).contiguous(), None


def _check_window(module: nn.Module, window: int | None, S: int) -> None:
    """A sliding window of `window` keys lets query i see keys i - window < j <= i (transformers'
    `sliding_window_overlay`); over S <= window keys that is every earlier key, plain causal attention, so the
    layer runs its mechanism. A shorter window changes what a query sees, which no mechanism here implements."""
    if window is not None and window < S:
        raise ValueError(f"layer {module.layer_idx} uses a sliding attention window of {window} keys, shorter than "
                         f"the {S} keys it attends over here, and the drop-in mechanisms do not implement windows: "
                         f"score sequences of at most {window} tokens, or leave this layer unpatched "
                         "(task.patch.layers)")


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The self-attention module of every decoder layer, by `layer_idx`; ValueError when the model does not
    expose them the standard way (a `layer_idx` on each layer's causal attention module)."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if (isinstance(index, int) and type(module).__name__.endswith("Attention")
                and getattr(module, "is_causal", False)):
            if index in found:
                raise ValueError(f"{type(model).__name__} has two causal attention modules with layer_idx {index}")
            found[index] = module
    n_layers = getattr(model.config, "num_hidden_layers", None)
    if not found or (n_layers is not None and sorted(found) != list(range(n_layers))):
        raise ValueError(f"{type(model).__name__}: could not find one causal attention module per layer "
                         f"(found layer_idx {sorted(found)}, config.num_hidden_layers={n_layers}); patching needs a "
                         "decoder whose attention goes through transformers' AttentionInterface")
    return found


def patch_hf_model(model: nn.Module, patch: PatchConfig, seed_offset: int = 0) -> list[int]:
    """Give the layers `patch.layers` selects `patch.attention`'s mechanism, switch the model to the adapter and
    return the patched layer indices; the weights are untouched and the other layers stay exact (SDPA).

    All or nothing: the selector is checked and every mechanism built before the model changes, and a model that
    refuses the adapter gets its previous mechanisms and attention implementation back, so a refused (re-)patch
    leaves the model running as it did before the call."""
    register_dropin_attention()
    modules = attention_modules(model)
    chosen = selected_layers(patch.layers, len(modules))
    device = next(model.parameters()).device
    built = {}
    for index in chosen:
        module = modules[index]
        head_dim = getattr(module, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
        mechanism = build_dropin_mechanism(patch.attention, head_dim, index, seed_offset)
        # A new module starts in training mode: it follows the model's (hyper samples afresh in training).
        built[index] = mechanism.to(device).train(model.training)
    previous = {index: module._modules.pop("dropin_mechanism", None) for index, module in modules.items()}
    previous_implementation = model.config._attn_implementation
    for index, mechanism in built.items():
        modules[index].dropin_mechanism = mechanism
    try:
        model.set_attn_implementation(DROPIN_ATTENTION)
        if model.config._attn_implementation != DROPIN_ATTENTION:
            raise ValueError(f"{type(model).__name__} did not accept attn_implementation={DROPIN_ATTENTION!r}: it "
                             "does not route attention through transformers' AttentionInterface, so it cannot be "
                             "patched")
    except BaseException:
        for index, module in modules.items():
            module._modules.pop("dropin_mechanism", None)
            if previous[index] is not None:
                module.dropin_mechanism = previous[index]
        if model.config._attn_implementation != previous_implementation:
            model.set_attn_implementation(previous_implementation)
        raise
    return chosen


@contextmanager
def mechanisms_detached(model: nn.Module) -> Iterator[None]:
    """Run every layer exactly (SDPA) inside the block, e.g. to time the unpatched model in the same process."""
    held = {}
    for module in model.modules():
        if "dropin_mechanism" in getattr(module, "_modules", {}):
            held[module] = module._modules.pop("dropin_mechanism")
    try:
        yield
    finally:
        for module, mechanism in held.items():
            module.dropin_mechanism = mechanism
