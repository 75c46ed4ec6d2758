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
  is run where it has no effect, over at most its own length of keys, and refused where it would have one);
- rows: each row runs over its own real tokens, packed (`causal_rows_over_own_tokens`), so its result does not
  depend on the rows or padding beside it;
- cached decoding: a step's queries over the cached keys go to the mechanism's `causal_last_rows`, the last rows
  of its causal pass over the whole prefix; a step whose cache a lower patched layer made stale (it moves earlier
  outputs as tokens are appended, `prefix_stable_length`) is refused (docs/patching.md, "Cached decoding").
"""

from __future__ import annotations

import functools
import math
import weakref
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


class _PerTensor:
    """A value kept per tensor object while it lives, under a key that must match: by identity, since a
    WeakKeyDictionary compares colliding keys with ==, which is elementwise for tensors."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[weakref.ref, tuple, Any]] = {}

    def get(self, t: torch.Tensor, key: tuple) -> tuple[bool, Any]:
        entry = self._kept.get(id(t))
        if entry is None or entry[0]() is not t or entry[1] != (_version(t), *key):
            return False, None
        return True, entry[2]

    def keep(self, t: torch.Tensor, key: tuple, value: Any) -> None:
        index = id(t)
        self._kept[index] = (weakref.ref(t, lambda _, index=index: self._kept.pop(index, None)),
                             (_version(t), *key), value)


def _version(t: torch.Tensor) -> int:
    """Changes when `t` is written in place (an inference tensor keeps no counter: 0)."""
    return 0 if t.is_inference() else t._version


_READ_MASKS = _PerTensor()
"""A mask's per-key padding: transformers makes one mask a forward and hands that tensor to every layer, so the mask
is checked and read back from the device once a forward, not once a patched layer (each read is a wait for the
device: a 32-layer model made about 200 a generated token)."""
_ROW_GROUPS = _PerTensor()
"""The rows' groups of a padding tensor (the one `key_padding_from_mask` keeps), likewise."""


def key_padding_from_mask(mask: torch.Tensor | None, causal: bool, T: int, S: int) -> torch.Tensor | None:
    """Per-key padding [B, S] (True = padding) of a 4-D mask [B, 1, T, S] (bool: True = may attend; float:
    additive), after checking that the mask is exactly causal-plus-padding on every real query row. Read once
    per mask tensor (`_READ_MASKS`)."""
    if mask is None:
        return None
    found, padding = _READ_MASKS.get(mask, (causal, T, S))
    if not found:
        padding = _read_key_padding(mask, causal, T, S)
        _READ_MASKS.keep(mask, (causal, T, S), padding)
    return padding


def _read_key_padding(mask: torch.Tensor, causal: bool, T: int, S: int) -> torch.Tensor | None:
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (T, S):
        raise ValueError(f"drop-in attention expects a [batch, 1, {T}, {S}] mask (got {tuple(mask.shape)}); "
                         "per-head masks are not supported")
    allowed_BTS = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min / 2
    padding_BS = ~allowed_BTS.any(dim=-2)
    expected_BTS = ~padding_BS[:, None, :].expand(-1, T, S)
    if causal:
        expected_BTS = expected_BTS & torch.ones(T, S, dtype=torch.bool, device=mask.device).tril(S - T)
    real_query_BT = (~padding_BS[:, S - T:] if S >= T
                     else torch.ones(mask.shape[0], T, dtype=torch.bool, device=mask.device))
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
    H, T, E = query.shape[1:]
    S = key.shape[2]
    if T < S:
        _check_cache_is_current(module, S)
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
    key, value = repeat_kv(key, H // key.shape[1]), repeat_kv(value, H // value.shape[1])
    scale = E ** -0.5 if scaling is None else scaling
    query = query * (scale * E ** 0.5)
    if not getattr(module, "is_causal", True):
        if T != S:
            raise ValueError(f"layer {module.layer_idx} is not causal and got {T} queries over {S} keys; drop-in "
                             "attention decodes from a cache in causal layers only")
        padding_BS = key_padding_from_mask(attention_mask, False, T, S)
        out_BHTE = mechanism(query, key, value, key_padding_mask_BS=padding_BS, causal=False)
    else:
        padding_BS = key_padding_from_mask(attention_mask, True, T, S)
        out_BHTE = causal_rows_over_own_tokens(mechanism, query, key, value, padding_BS)
    return out_BHTE.transpose(1, 2).contiguous(), None


def causal_rows_over_own_tokens(mechanism: nn.Module, q_BHTE: torch.Tensor, k_BHSE: torch.Tensor,
                                v_BHSE: torch.Tensor, padding_BS: torch.Tensor | None) -> torch.Tensor:
    """The mechanism's causal output [B, H, T, E] for the last T of S positions, each row computed over its own
    real tokens only: its unpadded keys, packed in order, so that a row gives what it gives alone, whatever rows and
    padding share its batch (HyperAttention's recursion halves the length it is given, and a padded length would
    move its split points). Rows with the same numbers of real keys and real queries run as one batch; padded
    query rows get zeros (transformers drops them)."""
    if padding_BS is None:
        return _causal_rows(mechanism, q_BHTE, k_BHSE, v_BHSE)
    B, H, T, E = q_BHTE.shape
    S = k_BHSE.shape[2]
    out_BHTE = q_BHTE.new_zeros(B, H, T, E)
    for rows_G, keys_GN, queries_Gt in _row_groups(padding_BS, T, S):
        pick = lambda x, idx: torch.gather(x[rows_G], 2, idx[:, None, :, None].expand(-1, H, -1, E))  # noqa: E731
        out_GHtE = _causal_rows(mechanism, pick(q_BHTE, queries_Gt), pick(k_BHSE, keys_GN), pick(v_BHSE, keys_GN))
        out_BHTE[rows_G] = out_BHTE[rows_G].scatter(2, queries_Gt[:, None, :, None].expand(-1, H, -1, E),
                                                    out_GHtE.to(out_BHTE.dtype))
    return out_BHTE


def _row_groups(padding_BS: torch.Tensor, T: int, S: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The rows of each (real keys n, real queries t) group with t > 0, as (rows [G], their real keys' positions
    [G, n], their real queries' positions among the last T [G, t]); made once per padding tensor (`_ROW_GROUPS`):
    the counts are read back from the device."""
    found, groups = _ROW_GROUPS.get(padding_BS, (T, S))
    if found:
        return groups
    n_keys_B = (~padding_BS).sum(-1)
    n_queries_B = (~padding_BS[:, S - T:]).sum(-1)
    real_first_BS = torch.argsort(padding_BS.to(torch.int8), dim=-1, stable=True)  # real positions, in order
    groups = []
    for n, t in sorted(set(zip(n_keys_B.tolist(), n_queries_B.tolist()))):
        if t == 0:
            continue
        rows_G = ((n_keys_B == n) & (n_queries_B == t)).nonzero().squeeze(1)
        keys_GN = real_first_BS[rows_G, :n]
        # The real queries are the row's last t real tokens: every position after a query is a query too.
        groups.append((rows_G, keys_GN, keys_GN[:, n - t:] - (S - T)))
    _ROW_GROUPS.keep(padding_BS, (T, S), groups)
    return groups


def _causal_rows(mechanism: nn.Module, q_BHTE: torch.Tensor, k_BHSE: torch.Tensor,
                 v_BHSE: torch.Tensor) -> torch.Tensor:
    """A whole sequence (T == S) through the mechanism's causal pass; the last T of S positions (a cached
    decoding step) through its `causal_last_rows`, which gives the rows of that pass over all S tokens."""
    if q_BHTE.shape[2] == k_BHSE.shape[2]:
        return mechanism(q_BHTE, k_BHSE, v_BHSE, causal=True)
    return mechanism.causal_last_rows(q_BHTE, k_BHSE, v_BHSE)


def _check_cache_is_current(module: nn.Module, S: int) -> None:
    """A cached step reads keys and values that earlier calls made at shorter lengths. They are those of a full
    pass over the S tokens only if no patched layer below changes its outputs at earlier positions when tokens are
    appended (`prefix_stable_length`: exact and LSH with a fixed n_buckets never do; HyperAttention does beyond
    min_seq_len). Otherwise the cached step would silently score other tokens than uncached scoring, so it is
    refused."""
    for lower in getattr(module, "dropin_lower_layers", ()):
        mechanism = getattr(lower, "dropin_mechanism", None)
        if mechanism is not None and S > mechanism.prefix_stable_length():
            raise ValueError(
                f"cached decoding at {S} tokens: layer {lower.layer_idx}'s {type(mechanism).__name__} changes its "
                f"outputs at earlier positions when tokens are appended beyond {mechanism.prefix_stable_length()} "
                f"({mechanism.length_dependence}), so the keys and values cached for layer {module.layer_idx} are "
                "not those a pass over the whole sequence makes; run the model with use_cache=False (each step "
                "scores the whole prefix), or patch only the model's last layer")


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
    for index, module in modules.items():
        # A plain tuple, not a submodule: which layers feed this one's cached keys (`_check_cache_is_current`).
        module.dropin_lower_layers = tuple(modules[lower] for lower in range(index))
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
    _decode_without_a_stale_cache(model, built, last=max(modules))
    return chosen


def _decode_without_a_stale_cache(model: nn.Module, built: dict[int, nn.Module], last: int) -> None:
    """`generate()`'s default cache on only where a cache can be current: a mechanism below the last layer whose
    earlier outputs move as tokens are appended (`prefix_stable_length`) leaves the layers above it a cache of
    other keys than a pass over the whole sequence makes, so the model's generation default becomes
    use_cache=False (each step scores the whole prefix, the mechanism's own definition) and `generate()` with its
    defaults decodes exactly; use_cache=True asked for explicitly is refused once the cache goes stale
    (`_check_cache_is_current`). A later patch without such a layer gives the model its own default back."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    if not hasattr(model, "dropin_own_use_cache"):
        model.dropin_own_use_cache = config.use_cache  # the model's own default, before any patch
    stale = any(mechanism.prefix_stable_length() < math.inf for index, mechanism in built.items() if index < last)
    config.use_cache = False if stale else model.dropin_own_use_cache


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
