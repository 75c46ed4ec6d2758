"""Pre-LN transformer: encoder, decoder, encoder-decoder, and the LM / translation heads.

Read top to bottom: a layer is x + Attention(LN(x)) then x + FFN(LN(x)) (pre-LN, Xiong et al., 2020),
the attention of each layer comes from the model config's registry (`cfg.attention_registry.build_attention`),
and every head is tied to the token embedding unless `model.tie_output` is false. Masks follow the attention
contract: bool, True = padding.

With `model.reversible` the same layers run as RevNet blocks (models/reversible.py, as in Reformer): the input
is duplicated into two streams, y1 = x1 + Attention(LN(x2)), y2 = x2 + FFN(LN(y1)), and the final LayerNorm
sees the mean of the two streams. The parameters (and their names) are those of the ordinary stack.

With `model.positional: relative` every self-attention carries Transformer-XL's relative terms instead of
positions added at the input, and with `model.memory` a causal LM runs segment by segment: each layer also
attends to its own input states of the previous segments (`forward(..., memory=...)`), as Transformer-XL
(Dai et al., 2019, Sec. 3.2; mem_transformer.py `_forward` and `_update_mems`).

The translation decoder also runs one position at a time (`start_decoding` / `decode_step`) over a
key/value cache (models/kv_cache.py) when every decoder attention can cache; decoding (tasks/beam_search.py)
otherwise reruns `decode` over the whole prefix.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.config import REVERSIBLE_DECODER, ModelConfig
from models.embeddings import build_positions, build_token_embedding
from models.kv_cache import DecoderCache, LayerKV
from models.reversible import reversible_stack


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ffn)
        self.down = nn.Linear(cfg.ffn, cfg.d_model)
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.ReLU()
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(self.act(self.up(x_BTD))))


class TransformerLayer(nn.Module):
    """Self-attention (+ cross-attention when `cross`) + feed-forward, each a pre-LN residual branch."""

    def __init__(self, cfg: ModelConfig, layer_index: int, shared_state: nn.ModuleDict, *, causal: bool, cross: bool):
        super().__init__()
        self.causal = causal
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = cfg.attention_registry.build_attention(cfg.attention, layer_index, shared_state,
                                                         relative=cfg.positional == "relative")
        if causal and not self.attn.supports_causal:
            raise ValueError(
                f"model.attention.kind={cfg.attention.kind} cannot be used with causal attention (causal LM or "
                "a translation decoder): its mechanism mixes future positions. Use it for masked LM, or pick "
                "a causal-capable kind"
            )
        self.ln_cross = nn.LayerNorm(cfg.d_model) if cross else None
        self.cross = (cfg.attention_registry.build_attention(cfg.attention, layer_index, shared_state, cross=True)
                      if cross else None)
        self.ln_ffn = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def attention_branch(self, x_BTD: torch.Tensor, key_padding_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        """The self-attention residual branch (F of a reversible block)."""
        return self.dropout(self.attn(self.ln_attn(x_BTD), key_padding_mask_BS=key_padding_mask_BT, causal=self.causal))

    def feed_forward_branch(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """The feed-forward residual branch (G of a reversible block)."""
        return self.ffn(self.ln_ffn(x_BTD))

    def forward(self, x_BTD, key_padding_mask_BT=None, memory_BSD=None, memory_padding_mask_BS=None):
        x_BTD = x_BTD + self.attention_branch(x_BTD, key_padding_mask_BT)
        if self.cross is not None:
            x_BTD = x_BTD + self.dropout(
                self.cross(self.ln_cross(x_BTD), memory_BSD, key_padding_mask_BS=memory_padding_mask_BS)
            )
        return x_BTD + self.feed_forward_branch(x_BTD)

    def forward_with_memory(self, x_BTD: torch.Tensor, memory_BMD: torch.Tensor) -> torch.Tensor:
        """`forward` of a causal layer whose keys and values also cover `memory_BMD`, its input states of the
        previous positions (pre-LN: one LayerNorm over [memory; x], as the reference's pre_lnorm branch)."""
        h_BSD = self.ln_attn(torch.cat([memory_BMD, x_BTD], dim=1))
        M = memory_BMD.shape[1]
        attn_BTD = self.attn(h_BSD[:, M:], h_BSD, causal=True)
        x_BTD = x_BTD + self.dropout(attn_BTD)
        return x_BTD + self.feed_forward_branch(x_BTD)

    def decode_step(self, x_N1D: torch.Tensor, kv: LayerKV, memory_padding_mask_NS: torch.Tensor | None) -> torch.Tensor:
        """`forward` for the newest position of a causal decoder, its prefix's keys/values read from `kv`.

        The new position sees every cached key and its own, which is the causal mask's row for it.
        """
        assert self.cross is not None, "decode_step is for the translation decoder"
        h_N1D = self.ln_attn(x_N1D)
        k_NGTE, v_NGTE = kv.append(*self.attn.keys_values(h_N1D))
        x_N1D = x_N1D + self.dropout(self.attn.attend(h_N1D, k_NGTE, v_NGTE))
        cross_N1D = self.cross.attend(self.ln_cross(x_N1D), kv.cross_k_NGSE, kv.cross_v_NGSE, memory_padding_mask_NS)
        x_N1D = x_N1D + self.dropout(cross_N1D)
        return x_N1D + self.feed_forward_branch(x_N1D)

    def attention_parameters(self) -> int:
        return self.attn.attention_parameters() + (self.cross.attention_parameters() if self.cross else 0)


class TransformerStack(nn.Module):
    """A stack of layers with a final LayerNorm (needed by pre-LN, whose residual stream is unnormalised)."""

    def __init__(self, cfg: ModelConfig, n_layers: int, shared_state: nn.ModuleDict, *, causal: bool, cross: bool):
        super().__init__()
        if cfg.reversible and cross:
            raise ValueError(REVERSIBLE_DECODER)
        self.reversible = cfg.reversible
        self.mem_len = cfg.memory.mem_len if cfg.memory is not None else None
        self.layers = nn.ModuleList(
            TransformerLayer(cfg, i, shared_state, causal=causal, cross=cross) for i in range(n_layers)
        )
        # Held, not registered (the model owns it): a reversible backward must return its gradients too.
        object.__setattr__(self, "_shared_state", shared_state)
        self.ln_final = nn.LayerNorm(cfg.d_model)
        self.checkpoint_layers = False
        """Set from outside (`checkpoint_activations`): recompute each layer in backward instead of storing it."""

    def forward(self, x_BTD, key_padding_mask_BT=None, memory_BSD=None, memory_padding_mask_BS=None):
        if self.reversible:
            # RevNet blocks store no activations already: they recompute them from the outputs in backward.
            params = list(self.layers.parameters()) + list(self._shared_state.parameters())
            y1_BTD, y2_BTD = reversible_stack(list(self.layers), x_BTD, x_BTD, params, key_padding_mask_BT)
            return self.ln_final((y1_BTD + y2_BTD) / 2)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                # Non-reentrant checkpoint: keeps the RNG state, so dropout and LSH hashing draw the same in the
                # recompute; shared cross-layer parameters receive their gradients as usual.
                x_BTD = checkpoint(layer, x_BTD, key_padding_mask_BT, memory_BSD, memory_padding_mask_BS,
                                   use_reentrant=False)
            else:
                x_BTD = layer(x_BTD, key_padding_mask_BT, memory_BSD, memory_padding_mask_BS)
        return self.ln_final(x_BTD)


    def forward_with_memory(
        self, x_BTD: torch.Tensor, memory: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final states [B, T, D] of a segment whose layer l also attends to memory[l] [B, M, D], and the
        next segment's memory: the last mem_len inputs of each layer over [memory; segment], detached so that
        no gradient crosses a segment boundary (the reference's `_update_mems`, ext_len = 0)."""
        assert self.mem_len is not None, "forward_with_memory needs model.memory"
        if len(memory) != len(self.layers):
            raise ValueError(f"memory holds {len(memory)} layers' states; the model has {len(self.layers)}")
        new_memory = []
        for layer, memory_BMD in zip(self.layers, memory):
            states_BSD = torch.cat([memory_BMD, x_BTD], dim=1)
            new_memory.append(states_BSD[:, max(0, states_BSD.shape[1] - self.mem_len):].detach())
            x_BTD = layer.forward_with_memory(x_BTD, memory_BMD)
        return self.ln_final(x_BTD), new_memory


def checkpoint_activations(model: nn.Module) -> int:
    """Turn on activation checkpointing in every layer stack of `model` (run.activation_checkpointing: applied
    from outside, the model code stays single-device and eager); returns how many stacks it reached."""
    stacks = [m for m in model.modules() if isinstance(m, TransformerStack)]
    for stack in stacks:
        stack.checkpoint_layers = True
    return len(stacks)


class EmbeddingInput(nn.Module):
    """Token embedding + absolute positions (none under relative positions) + dropout."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.max_seq_len = cfg.max_seq_len
        self.tokens = build_token_embedding(cfg, vocab_size)
        self.positions = build_positions(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, tokens_BT: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """`offset`: position of the first token (> 0 when a decoder feeds one position at a time)."""
        end = offset + tokens_BT.shape[1]
        if end > self.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds model.max_seq_len={self.max_seq_len}; "
                             "raise model.max_seq_len or shorten the task's seq_len")
        if self.positions is None:
            return self.dropout(self.tokens(tokens_BT))
        return self.dropout(self.tokens(tokens_BT) + self.positions(end)[offset:])


class OutputHead(nn.Module):
    """Projection to the vocabulary, tied to the token embedding when it offers a [V, D] weight."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, embedding: nn.Module):
        super().__init__()
        tied = embedding.output_weight() if cfg.tie_output else None
        if tied is not None:
            object.__setattr__(self, "_tied_module", embedding)  # not a submodule: counted once
        else:
            self.proj = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        tied = getattr(self, "_tied_module", None)
        weight = tied.output_weight() if tied is not None else self.proj.weight
        return F.linear(h_BTD, weight, self.bias)


def _init_weights(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class _CountsMixin:
    def attention_parameters(self) -> int:
        """Attention-only count (MHE paper convention), model-owned shared extras counted once."""
        layers = [m for m in self.modules() if isinstance(m, TransformerLayer)]  # type: ignore[attr-defined]
        shared = sum(p.numel() for p in self.shared_state.parameters())  # type: ignore[attr-defined]
        return sum(layer.attention_parameters() for layer in layers) + shared

    def parameter_counts(self) -> dict[str, int]:
        return {"attention": self.attention_parameters(), "total": sum(p.numel() for p in self.parameters())}  # type: ignore[attr-defined]


class LanguageModel(_CountsMixin, nn.Module):
    """Encoder (masked LM, causal=False) or decoder-only (causal LM, causal=True) with a tied head."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, *, causal: bool):
        super().__init__()
        self.cfg, self.causal = cfg, causal
        self.shared_state = nn.ModuleDict()
        self.embed = EmbeddingInput(cfg, vocab_size)
        self.stack = TransformerStack(cfg, cfg.layers, self.shared_state, causal=causal, cross=False)
        _init_weights(self.stack)
        self.head = OutputHead(cfg, vocab_size, self.embed.tokens)

    def forward(self, tokens_BT: torch.Tensor, key_padding_mask_BT: torch.Tensor | None = None,
                scored_N: torch.Tensor | None = None, memory: list[torch.Tensor] | None = None):
        """Logits [B, T, V]; with `scored_N` (int64 positions in the row-major [B * T], as `scored_positions`
        makes them) only those positions' logits, [N, V] in that order. Masked LM scores ~15% of positions, so the
        vocabulary projection and its softmax then run on those alone (as fairseq's RoBERTa head does). Positions,
        not a boolean mask: selecting by a mask reads its count back from the device (a wait in every step, and a
        graph break under torch.compile), while the positions come with the batch from the host.

        With `memory` (model.memory; `empty_memory` for a row's first segment): (logits [B, T, V], the next
        segment's memory), the segment attending to the cached states of the previous ones. Through forward,
        not a method of its own, so that a DDP wrapper sees the call.
        """
        if memory is not None:
            if key_padding_mask_BT is not None or scored_N is not None:
                raise ValueError("a segment with memory is scored whole, without padding mask or scored positions")
            h_BTD, new_memory = self.stack.forward_with_memory(self.embed(tokens_BT), memory)
            return self.head(h_BTD), new_memory
        h_BTD = self.stack(self.embed(tokens_BT), key_padding_mask_BT)
        return self.head(h_BTD if scored_N is None else h_BTD.flatten(0, 1).index_select(0, scored_N))


    def empty_memory(self, batch_size: int, device: torch.device) -> list[torch.Tensor]:
        """The memory of a row's first segment: no cached states in any layer (in the model's dtype)."""
        if self.cfg.memory is None:
            raise ValueError("this model has no memory; set model.memory: {mem_len: N}")
        dtype = self.head.bias.dtype
        return [torch.zeros(batch_size, 0, self.cfg.d_model, device=device, dtype=dtype) for _ in self.stack.layers]


class Seq2SeqTransformer(_CountsMixin, nn.Module):
    """Encoder-decoder for translation; source and target share one (joint) vocabulary and embedding."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.shared_state = nn.ModuleDict()
        self.embed = EmbeddingInput(cfg, vocab_size)
        self.encoder = TransformerStack(cfg, cfg.layers, self.shared_state, causal=False, cross=False)
        # Unset means as deep as the encoder (ModelConfig refuses 0; a plan's depth probes give each stack >= 1).
        decoder_layers = cfg.layers if cfg.decoder_layers is None else cfg.decoder_layers
        self.decoder = TransformerStack(cfg, decoder_layers, self.shared_state, causal=True, cross=True)
        _init_weights(self.encoder)
        _init_weights(self.decoder)
        self.head = OutputHead(cfg, vocab_size, self.embed.tokens)

    def encode(self, src_BS: torch.Tensor, src_padding_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(self.embed(src_BS), src_padding_mask_BS)

    def decode(self, tgt_in_BT, memory_BSD, src_padding_mask_BS=None, tgt_padding_mask_BT=None) -> torch.Tensor:
        """Logits [B, T, V] for every target prefix position."""
        h_BTD = self.decoder(self.embed(tgt_in_BT), tgt_padding_mask_BT, memory_BSD, src_padding_mask_BS)
        return self.head(h_BTD)

    def forward(self, src_BS, tgt_in_BT, src_padding_mask_BS=None, tgt_padding_mask_BT=None) -> torch.Tensor:
        memory_BSD = self.encode(src_BS, src_padding_mask_BS)
        return self.decode(tgt_in_BT, memory_BSD, src_padding_mask_BS, tgt_padding_mask_BT)

    # --- incremental decoding -----------------------------------------------------------------------------

    def incremental_decoding_unsupported_reasons(self) -> list[str]:
        """Why `start_decoding` / `decode_step` cannot be used; empty when they can."""
        reasons = ["model.reversible=true: RevNet blocks recompute whole sequences"] if self.cfg.reversible else []
        for layer in self.decoder.layers:
            reasons += layer.attn.kv_cache_unsupported_reasons() + layer.cross.kv_cache_unsupported_reasons()
        return list(dict.fromkeys(reasons))

    def start_decoding(self, memory_NSD: torch.Tensor, src_padding_mask_NS: torch.Tensor | None = None) -> DecoderCache:
        """An empty-prefix cache holding each layer's cross-attention keys/values of the encoder output."""
        reasons = self.incremental_decoding_unsupported_reasons()
        if reasons:
            raise ValueError("this model cannot decode incrementally: " + "; ".join(reasons)
                             + ". Decode by rerunning `decode` over the prefix (beam_search(..., incremental=False))")
        layers = [LayerKV(*layer.cross.keys_values(memory_NSD)) for layer in self.decoder.layers]
        return DecoderCache(layers, src_padding_mask_NS)

    def decode_step(self, tokens_N1: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """Logits [N, V] of the piece after `tokens_N1`, the prefix's newest token; extends `cache` by it.

        Equals decode(prefix)[:, -1] up to floating-point rounding, at the cost of running one position.
        """
        x_N1D = self.embed(tokens_N1, offset=cache.length)
        for layer, kv in zip(self.decoder.layers, cache.layers):
            x_N1D = layer.decode_step(x_N1D, kv, cache.memory_padding_mask_NS)
        cache.length += 1
        return self.head(self.decoder.ln_final(x_N1D))[:, 0]


def layers_to_shard(model: nn.Module) -> list[nn.Module]:
    """The transformer layers that can be FSDP groups of their own (models/fsdp.py, for training and for plan's
    count of a sharded step): those outside reversible and memory stacks whose parameters no other part of the
    model uses. Here because it is a fact of the model's structure, which training and planning both ask."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    layers = []
    for stack in (m for m in model.modules() if isinstance(m, TransformerStack)):
        if stack.reversible or stack.mem_len:  # these call the layers' parts, or forward_with_memory, not the layer
            continue
        for layer in stack.modules():
            if isinstance(layer, TransformerLayer) and all(owners[id(p)] == 1 for p in layer.parameters()):
                layers.append(layer)
    return layers
