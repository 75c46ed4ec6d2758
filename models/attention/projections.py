"""Projection schemes: how a layer turns its input into per-head q, k, v and heads back into d_model.

The schemes differ only in which matrices exist, which is exactly what the MHE paper compares
(Xue & Aletras, 2023, arXiv 2310.07911, Table 4). Parameter counts follow its convention: projection
weights including the output projection, no biases (our projections have none, so every weight counts).

Every scheme returns q_BHTE and k_BHSE / v_BHSE with the same head count, so mechanisms never need to
know about grouped or shared heads: grouped K/V heads are broadcast to their query heads here. That count is
H for every scheme but sha, which attends with its one head (H = 1 in the mechanism's shapes).

Keys and values come in two steps: `keys_values` gives them compact (G <= H stored heads, e.g. G = 1 for
mqa, the shared seed head for mhe), each position from its own input row only, and `expand_heads` turns them
into the H heads the mechanism sees. The compact form is what an incremental decoder caches (models/kv_cache.py):
it is appended one position at a time and is as small as the scheme allows.

The configs of the kinds that are a projection scheme (`MHAConfig` ... `MHEConfig`) sit here beside their
schemes; models/attention/registry.py pairs each with its scheme.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field, model_validator

from kernels.dispatch import fused_kernels
from kernels.unit_rows import unit_rows_kernel
from models.attention.base import _AttentionConfig
from models.attention.exact import ExactMechanismConfig


# --- configs of the kinds that are a projection scheme (mha, sha, mqa, gqa, skv, el_att, mhe) ------


class _ProjectionKindConfig(_AttentionConfig):
    """A kind that is a projection scheme; its `mechanism:` block picks how the heads mix (exact by default)."""

    mechanism: ExactMechanismConfig = Field(default_factory=ExactMechanismConfig)
    """How heads mix tokens: exact softmax attention, or e.g. {kind: linformer, k: 64} to cross schemes."""
    # Here the field takes exact only: the registry's copy of each projection kind (make_registry in
    # models/attention/registry.py) widens it to the union of every crossable mechanism the registry holds.


class MHAConfig(_ProjectionKindConfig):
    """Multi-head attention (Vaswani et al., 2017)."""

    kind: Literal["mha"] = "mha"


class SHAConfig(_ProjectionKindConfig):
    """Single-head attention: one head of dim d_model / heads, as the MHE paper's lower bound."""

    kind: Literal["sha"] = "sha"


class MQAConfig(_ProjectionKindConfig):
    """Multi-query attention (Shazeer, 2019): one K and one V head shared by every query head."""

    kind: Literal["mqa"] = "mqa"


class GQAConfig(_ProjectionKindConfig):
    """Grouped-query attention (Ainslie et al., 2023): `groups` K/V heads, each serving heads/groups queries."""

    kind: Literal["gqa"] = "gqa"
    groups: int = 2
    """Number of K/V heads; must divide heads (groups = heads is mha, groups = 1 is mqa)."""

    tiny_knobs = {"groups": 2}
    bench_knobs = {"groups": 2}

    @model_validator(mode="after")
    def _check_groups(self) -> "GQAConfig":
        if self.groups < 1 or self.heads % self.groups:
            raise ValueError(
                f"model.attention.groups={self.groups} must be >= 1 and divide model.attention.heads={self.heads}"
            )
        return self


class SKVConfig(_ProjectionKindConfig):
    """Shared key-value projection (W^K = W^V), as the MHE paper describes its SKV baseline."""

    kind: Literal["skv"] = "skv"


class ELAttConfig(_ProjectionKindConfig):
    """EL-attention (Yan et al., 2021): no K/V projections; the heads of the input act as keys and values."""

    kind: Literal["el_att"] = "el_att"


class MHEConfig(_ProjectionKindConfig):
    """Multi-head embeddings (Xue & Aletras, 2023, arXiv 2310.07911)."""

    kind: Literal["mhe"] = "mhe"
    mode: Literal["add", "mul"] = "mul"
    """add: A + e_i; mul: A * (1 + e_i)."""
    init_std: float = 0.02
    """Std of the near-zero normal init of the head embeddings (the paper leaves it open)."""

    tiny_knobs = {"mode": "mul", "init_std": 0.1}
    bench_knobs = {"mode": "mul"}

    @model_validator(mode="after")
    def _check_init(self) -> "MHEConfig":
        if self.init_std < 0:
            raise ValueError(f"model.attention.init_std must be >= 0 (got {self.init_std}): it is the standard "
                             "deviation of the head embeddings' normal init; the default is 0.02")
        return self


# --- projection schemes ---------------------------------------------------------------------------


def _split_heads(x_BTX: torch.Tensor, heads: int) -> torch.Tensor:
    B, T, X = x_BTX.shape
    return x_BTX.view(B, T, heads, X // heads).transpose(1, 2)  # B, heads, T, X/heads


def _broadcast_heads(x_BGSE: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat each of G K/V heads for its heads/G query heads (GQA/MQA)."""
    B, G, S, E = x_BGSE.shape
    if G == heads:
        return x_BGSE
    return x_BGSE[:, :, None].expand(B, G, heads // G, S, E).reshape(B, heads, S, E)


@dataclass
class CompressedContext:
    """The context compressed along the sequence by a mechanism, before any K/V projection.

    keys_BKD = E X and values_BKD = F X (the same tensor when E = F), with padded rows of X zeroed.
    `*_mass_BK1` is E 1 over the valid positions only: how much of an affine projection's bias each
    compressed row carries, since E (X W^T + 1 b^T) = (E X) W^T + (E 1) b^T and padded rows carry none.
    `empty_BK` marks slots made only of padding (None when every slot holds a valid position).
    """

    keys_BKD: torch.Tensor
    key_mass_BK1: torch.Tensor
    values_BKD: torch.Tensor
    value_mass_BK1: torch.Tensor
    empty_BK: torch.Tensor | None


def _project_compressed(linear: nn.Linear, rows_BKD: torch.Tensor, mass_BK1: torch.Tensor) -> torch.Tensor:
    """(E X) W^T + (E 1) b^T, which equals E applied to linear(X) row by row."""
    y_BKX = F.linear(rows_BKD, linear.weight)
    return y_BKX if linear.bias is None else y_BKX + mass_BK1 * linear.bias


class ProjectionScheme(nn.Module):
    """Base: Q from x, K/V from the context (x itself for self-attention), W^O back to d_model."""

    projects_compressed_context = False
    """True when K and V are affine maps of each context position alone, so a mechanism that compresses
    the sequence linearly may compress the context before them (`qkv_compressed`)."""

    supports_kv_cache = True
    """Keys/values of a position depend on that position alone, so a decoder may cache them."""

    def __init__(self, cfg: _AttentionConfig):
        super().__init__()
        assert cfg.d_model is not None
        self.d_model, self.heads, self.head_dim = cfg.d_model, cfg.heads, cfg.head_dim
        self.out = nn.Linear(self.d_model, self.d_model, bias=False)

    @property
    def attended_heads(self) -> int:
        """Heads the mechanism receives: H, or 1 for sha."""
        return self.heads

    def queries(self, x_BTD: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def keys_values(self, ctx_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact keys and values k_BGSE, v_BGSE (G stored heads)."""
        raise NotImplementedError

    def expand_heads(self, k_BGSE: torch.Tensor, v_BGSE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compact keys and values to the H heads of the queries (identity when G = H)."""
        return k_BGSE, v_BGSE

    def qkv(self, x_BTD: torch.Tensor, ctx_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.queries(x_BTD), *self.expand_heads(*self.keys_values(ctx_BSD)))

    def qkv_compressed(
        self, x_BTD: torch.Tensor, ctx: CompressedContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q from x; k, v of the compressed slots projected from `ctx` (needs projects_compressed_context)."""
        raise NotImplementedError(f"{type(self).__name__} cannot project a compressed context")

    def output(self, o_BHTE: torch.Tensor) -> torch.Tensor:
        B, H, T, E = o_BHTE.shape
        return self.out(o_BHTE.transpose(1, 2).reshape(B, T, H * E))

    def attention_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class MultiHeadProjection(ProjectionScheme):
    """mha (kv_heads = heads), gqa (kv_heads = groups) and mqa (kv_heads = 1)."""

    projects_compressed_context = True

    def __init__(self, cfg: _AttentionConfig, kv_heads: int):
        super().__init__(cfg)
        self.kv_heads = kv_heads
        self.q = nn.Linear(self.d_model, self.d_model, bias=False)
        self.k = nn.Linear(self.d_model, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(self.d_model, kv_heads * self.head_dim, bias=False)

    def qkv_compressed(self, x_BTD, ctx):
        # W^K and W^V run over the k compressed rows instead of the n positions: n / k times fewer FLOPs.
        k_BGKE = _split_heads(_project_compressed(self.k, ctx.keys_BKD, ctx.key_mass_BK1), self.kv_heads)
        v_BGKE = _split_heads(_project_compressed(self.v, ctx.values_BKD, ctx.value_mass_BK1), self.kv_heads)
        return (self.queries(x_BTD), *self.expand_heads(k_BGKE, v_BGKE))

    def queries(self, x_BTD):
        return _split_heads(self.q(x_BTD), self.heads)

    def keys_values(self, ctx_BSD):
        return _split_heads(self.k(ctx_BSD), self.kv_heads), _split_heads(self.v(ctx_BSD), self.kv_heads)

    def expand_heads(self, k_BGSE, v_BGSE):
        return _broadcast_heads(k_BGSE, self.heads), _broadcast_heads(v_BGSE, self.heads)


class SharedKVProjection(ProjectionScheme):
    """skv: one d_model x d_model matrix produces both keys and values (W^K = W^V)."""

    def __init__(self, cfg: SKVConfig):
        super().__init__(cfg)
        self.q = nn.Linear(self.d_model, self.d_model, bias=False)
        self.kv = nn.Linear(self.d_model, self.d_model, bias=False)

    def queries(self, x_BTD):
        return _split_heads(self.q(x_BTD), self.heads)

    def keys_values(self, ctx_BSD):
        kv_BHSE = _split_heads(self.kv(ctx_BSD), self.heads)
        return kv_BHSE, kv_BHSE


class ELAttProjection(ProjectionScheme):
    """el_att: keys and values are the heads of the context itself; only W^Q and W^O exist."""

    def __init__(self, cfg: ELAttConfig):
        super().__init__(cfg)
        self.q = nn.Linear(self.d_model, self.d_model, bias=False)

    def queries(self, x_BTD):
        return _split_heads(self.q(x_BTD), self.heads)

    def keys_values(self, ctx_BSD):
        ctx_BHSE = _split_heads(ctx_BSD, self.heads)
        return ctx_BHSE, ctx_BHSE


class HeadEmbeddingProjection(ProjectionScheme):
    """mhe, and sha as its special case without head embeddings.

    One shared d_model x d_head "seed" projection for each of Q, K, V (MHE eq. 4); under mhe head i sees
    psi(A, e_i): A + e_i (add) or A * (1 + e_i) (mul), MHE eq. 5 and Sec. 3.2, so its H heads differ.

    sha (no embeddings) attends with ONE head of dim d_head: the mechanism receives q, k, v with 1 head.
    W^O is still stored as d_model x d_model, the slots of H heads, which gives the paper's SHA count
    3 d_m d_h + d_m^2 exactly (its SHA is MHE without embeddings). H identical heads concatenated then W^O
    equal the one head times the sum of W^O's H column blocks: [o, ..., o] W^O^T = o (sum_h W^O_h)^T, so
    `output` maps d_head -> d_model with that sum and the attention core costs one head, not H.
    """

    def __init__(self, cfg: MHEConfig | SHAConfig):
        super().__init__(cfg)
        self.q = nn.Linear(self.d_model, self.head_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.head_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.head_dim, bias=False)
        self.mode = cfg.mode if isinstance(cfg, MHEConfig) else None
        if self.mode is not None:
            # Near zero (MHE footnote 2): every head starts as the shared head; W^O's head blocks and
            # the embeddings' gradients break the symmetry.
            self.e_q = nn.Parameter(torch.randn(self.heads, self.head_dim) * cfg.init_std)
            self.e_k = nn.Parameter(torch.randn(self.heads, self.head_dim) * cfg.init_std)
            self.e_v = nn.Parameter(torch.randn(self.heads, self.head_dim) * cfg.init_std)

    @property
    def attended_heads(self) -> int:
        return self.heads if self.mode is not None else 1

    def _per_head(self, a_B1TE: torch.Tensor, e_HE: torch.Tensor | None) -> torch.Tensor:
        if e_HE is None:  # sha: the one head as it is
            return a_B1TE
        e_1H1E = e_HE[None, :, None, :]
        return a_B1TE + e_1H1E if self.mode == "add" else a_B1TE * (1 + e_1H1E)

    def queries(self, x_BTD):
        return self._per_head(self.q(x_BTD)[:, None], self.e_q if self.mode else None)

    def keys_values(self, ctx_BSD):
        # the stored "head" is the shared seed (G = 1): the head embeddings are applied in expand_heads
        return self.k(ctx_BSD)[:, None], self.v(ctx_BSD)[:, None]

    def expand_heads(self, k_B1SE, v_B1SE):
        e_k, e_v = (self.e_k, self.e_v) if self.mode else (None, None)
        return self._per_head(k_B1SE, e_k), self._per_head(v_B1SE, e_v)

    def output(self, o_BHTE: torch.Tensor) -> torch.Tensor:
        if self.mode is not None:
            return super().output(o_BHTE)
        # sha: o_B1TE (one head) through W^O's column blocks summed, d_head -> d_model
        if o_BHTE.shape[1] != 1:
            raise ValueError(f"sha attends with one head, but its mechanism returned {o_BHTE.shape[1]} heads")
        w_DHE = self.out.weight.view(self.d_model, self.heads, self.head_dim)
        return F.linear(o_BHTE[:, 0], w_DHE.sum(1))  # B, T, D


class _UnitRows(torch.autograd.Function):
    """y = x / max(|x|, eps) along the last dim: `F.normalize`'s value from the same three ops, with the closed-form
    backward dx = (g - y (y . g)) / max(|x|, eps), the projection onto the row's tangent, where |x| > eps, and
    g / eps where the norm is clamped (the norm then passes no gradient). Six launches where autograd's chain
    through the norm, the clamp and the division takes fourteen; y is the keys the attention saves anyway."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        d = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(eps)
        y = x / d
        ctx.save_for_backward(y, d)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        y, d = ctx.saved_tensors
        along = (g * y).sum(-1, keepdim=True).masked_fill_(d == ctx.eps, 0.0)  # a clamped norm has no gradient
        return torch.addcmul(g, y, along, value=-1.0).div_(d), None


def unit_rows(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """`F.normalize(x, dim=-1, eps=eps)`, bitwise in value, with a backward of six launches (`_UnitRows`); on the
    kernels one launch each way (kernels/unit_rows.py), the same roundings."""
    if x.dim() == 4 and fused_kernels(x):  # [B, H, T, E], the keys' shape
        return unit_rows_kernel(x, eps)
    return _UnitRows.apply(x, eps)


class SharedQKProjection(ProjectionScheme):
    """lsh: one W for queries and keys (Reformer, Kitaev et al., 2020, arXiv 2001.04451, Sec. 2.2).

    Keys are the queries unit-normalised per head (k_j = q_j / |q_j|, Sec. 2.2): hashing is angular, so a
    query lands in its own key's bucket, and with unit keys a logit depends only on the query's norm and the
    angle, the quantity angular LSH groups by. The paper reports shared QK costs no accuracy.
    """

    supports_kv_cache = False  # only ever paired with LSH, which hashes the whole sequence at once

    def __init__(self, cfg: _AttentionConfig):
        super().__init__(cfg)
        self.qk = nn.Linear(self.d_model, self.d_model, bias=False)
        self.v = nn.Linear(self.d_model, self.d_model, bias=False)

    def qkv(self, x_BTD, ctx_BSD):
        if ctx_BSD is not x_BTD:
            raise ValueError(
                "model.attention.kind=lsh shares one projection for queries and keys, so it only does "
                "self-attention; cross-attention is built with cross=True, which uses mha projections"
            )
        q_BHTE = _split_heads(self.qk(x_BTD), self.heads)
        k_BHTE = unit_rows(q_BHTE)
        return q_BHTE, k_BHTE, _split_heads(self.v(x_BTD), self.heads)


def mha_projection(cfg: _AttentionConfig) -> MultiHeadProjection:
    """mha: one K/V head per query head (also linformer's and hyper's scheme, and lsh's in cross-attention)."""
    return MultiHeadProjection(cfg, kv_heads=cfg.heads)


def gqa_projection(cfg: GQAConfig) -> MultiHeadProjection:
    """gqa: `groups` K/V heads."""
    return MultiHeadProjection(cfg, kv_heads=cfg.groups)


def mqa_projection(cfg: MQAConfig) -> MultiHeadProjection:
    """mqa: one K/V head for every query head."""
    return MultiHeadProjection(cfg, kv_heads=1)
