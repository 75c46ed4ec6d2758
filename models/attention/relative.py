"""Transformer-XL relative attention: the exact mechanism with relative position terms.

Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context (Dai, Yang, Yang, Carbonell, Le,
Salakhutdinov, ACL 2019, arXiv 1901.02860), Sec. 3.3. The logit of query i and key j is

    A_ij = (q_i + u)^T k_j  +  (q_i + v)^T W_R R_{i-j}
           (a) content + (c) global content bias   (b) position + (d) global position bias

with R the sinusoid of the distance i - j (not of absolute positions), W_R a learned projection per layer,
and u, v one pair of per-head vectors for the whole model. Nothing depends on where the segment sits in the
stream, which is what lets a layer attend to cached states of the previous segment (models/transformer.py).

Conventions follow the authors' PyTorch code, kimiyoung/transformer-xl `pytorch/mem_transformer.py`
(docs/long_attention.md lists each with its line). The position term is computed for the S distances
S-1 .. 0 and moved into place with the rel-shift trick (`rel_shift`) instead of a [T, S, E] gather. Queries
are the last T of the S keys (the keys of a cached memory come first), so the causal mask is aligned
bottom-right: query i sees keys j <= i + (S - T).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.attention.base import _AttentionConfig

RELATIVE_BIASES = "relative_biases"
"""Key of the model-owned u, v in `shared_state`."""


class RelativeBiases(nn.Module):
    """u and v of Sec. 3.3, [heads, head_dim] each, shared by every layer (mem_transformer.py keeps one
    r_w_bias, r_r_bias pair on the model). Normal(0, 0.02) as the reference's `init_weight`."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.u_HE = nn.Parameter(torch.randn(heads, head_dim) * 0.02)
        self.v_HE = nn.Parameter(torch.randn(heads, head_dim) * 0.02)


def relative_sinusoids(distances_S: torch.Tensor, d_model: int) -> torch.Tensor:
    """R of the given distances, [S, d_model]: [sin | cos] halves, as the reference's PositionalEmbedding
    (not interleaved like Vaswani et al.'s absolute table)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, dtype=distances_S.dtype,
                                             device=distances_S.device) / d_model))
    angles_SF = distances_S[:, None] * inv_freq[None, :]
    return torch.cat([angles_SF.sin(), angles_SF.cos()], dim=-1)


def rel_shift(x_BHTS: torch.Tensor) -> torch.Tensor:
    """Column c of row i holds distance S-1-c on input; on output column j of row i holds distance
    (S - T) + i - j, i.e. out[i, j] = x[i, j + T - 1 - i], for every j <= i + (S - T).

    The reference's `_rel_shift`: prepend a zero column, read the [T, S+1] buffer as [S+1, T], drop its first
    row, read the rest as [T, S]. Row i then starts T - 1 - i columns later. Entries right of the causal
    boundary are other rows' values and must be masked by the caller.
    """
    B, H, T, S = x_BHTS.shape
    padded_BHTS1 = F.pad(x_BHTS, (1, 0))  # zero column in front: B, H, T, S + 1
    return padded_BHTS1.view(B, H, S + 1, T)[:, :, 1:].reshape(B, H, T, S)


class RelativeMechanism(nn.Module):
    """Exact softmax attention with Transformer-XL's relative position and global bias terms.

    The (a) + (c) term goes through torch SDPA as (q + u) k^T; (b) + (d) enter as its additive mask, together
    with the causal mask. Causal only: the rel-shift reads distances >= 0, which is what a causal LM needs.
    """

    supports_causal = True
    supports_kv_cache = False  # incremental decoding would need the distances of every cached key

    def __init__(self, d_model: int, heads: int, head_dim: int, biases: RelativeBiases, dropout: float = 0.0):
        super().__init__()
        self.d_model, self.heads, self.head_dim, self.dropout = d_model, heads, head_dim, dropout
        self.w_r = nn.Linear(d_model, heads * head_dim, bias=False)  # W_{k,R} of eq. (3), per layer
        object.__setattr__(self, "_biases", biases)  # owned (saved, counted) by the model's shared_state

    @classmethod
    def build(cls, attention: _AttentionConfig, heads: int, shared_state: nn.ModuleDict) -> RelativeMechanism:
        """The mechanism of one layer; the first layer creates the model's u, v."""
        if RELATIVE_BIASES not in shared_state:
            shared_state[RELATIVE_BIASES] = RelativeBiases(heads, attention.head_dim)
        assert attention.d_model is not None
        return cls(attention.d_model, heads, attention.head_dim, shared_state[RELATIVE_BIASES], attention.dropout)

    def position_logits(self, q_BHTE: torch.Tensor, S: int) -> torch.Tensor:
        """(b) + (d) of every (query, key) pair, unscaled, [B, H, T, S]; only j <= i + S - T is meaningful."""
        distances_S = torch.arange(S - 1, -1, -1, device=q_BHTE.device, dtype=q_BHTE.dtype)
        r_SD = relative_sinusoids(distances_S, self.d_model)
        r_HSE = self.w_r(r_SD).view(S, self.heads, self.head_dim).transpose(0, 1)
        v_1H1E = self._biases.v_HE[None, :, None, :]
        by_distance_BHTS = torch.einsum("bhte,hse->bhts", q_BHTE + v_1H1E, r_HSE)
        return rel_shift(by_distance_BHTS)

    def forward(self, q_BHTE, k_BHSE, v_BHSE, *, key_padding_mask_BS=None, causal=False):
        if not causal:
            raise ValueError("model.positional: relative is implemented for causal self-attention only "
                             "(task.kind: clm); use learned or sinusoidal positions otherwise")
        T, S = q_BHTE.shape[-2], k_BHSE.shape[-2]
        scale = self.head_dim**-0.5
        i_T1 = torch.arange(T, device=q_BHTE.device)[:, None]
        j_1S = torch.arange(S, device=q_BHTE.device)[None, :]
        allowed_BTS = (j_1S <= i_T1 + (S - T))[None]  # bottom-right: the last T keys are the queries' own
        if key_padding_mask_BS is not None:
            allowed_BTS = allowed_BTS & ~key_padding_mask_BS[:, None, :]
        bias_BHTS = (self.position_logits(q_BHTE, S) * scale).masked_fill(
            ~allowed_BTS[:, None], torch.finfo(q_BHTE.dtype).min
        )
        u_1H1E = self._biases.u_HE[None, :, None, :]
        dropout_p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q_BHTE + u_1H1E, k_BHSE, v_BHSE, attn_mask=bias_BHTS,
                                              dropout_p=dropout_p, scale=scale)

    def attention_parameters(self) -> int:
        """W_R; u and v are counted once, with the model's shared state."""
        return self.w_r.weight.numel()
