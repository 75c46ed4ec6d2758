"""Token and position embeddings.

`build_token_embedding` is the table from `model.embedding.kind` to a module with
forward(tokens [B, T]) -> [B, T, d_model] and `output_weight()` ([V, d_model] to tie, or None).
Kinds: standard (a d_model table), define (DeFINE, Mehta et al., ICLR 2020, arXiv 1911.12385) and adaptive
(adaptive input, Baevski & Auli, ICLR 2019, arXiv 1809.10853). Both factorised kinds tie to the output layer
through the product of their factors, so tying keeps their parameter savings.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from models.config import AdaptiveInputConfig, DeFINEConfig, ModelConfig, StandardEmbeddingConfig


class StandardEmbedding(nn.Module):
    """Lookup table at d_model, scaled by sqrt(d_model) as in Vaswani et al. (2017) so that it keeps
    its weight against the position embedding when tied to the output layer (init std d^-1/2)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.table = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.table.weight, std=d_model**-0.5)
        self.scale = math.sqrt(d_model)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        return self.table(tokens_BT) * self.scale

    def output_weight(self) -> torch.Tensor | None:
        return self.table.weight


class GroupLinear(nn.Module):
    """F_G of DeFINE (Appendix A.1): split the input into g groups, one (in/g x out/g) matrix per group.

    Per-group weights, as the paper's count n k / g requires (a single shared matrix would count n k / g^2).
    """

    def __init__(self, in_features: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        bound = (in_features // groups) ** -0.5
        weight = torch.empty(groups, in_features // groups, out_features // groups)
        self.weight = nn.Parameter(weight.uniform_(-bound, bound))

    def forward(self, x_NI: torch.Tensor) -> torch.Tensor:
        x_NGI = x_NI.unflatten(-1, (self.groups, -1))
        return torch.einsum("...gi,gio->...go", x_NGI, self.weight).flatten(-2)


def split_mix(e_NI: torch.Tensor, h_NH: torch.Tensor, groups: int) -> torch.Tensor:
    """DeFINE's split-and-mix link (Sec. 3.3): group j of the next layer sees chunk j of e_i and of h."""
    return torch.cat([e_NI.unflatten(-1, (groups, -1)), h_NH.unflatten(-1, (groups, -1))], dim=-1).flatten(-2)


class DeFINEEmbedding(nn.Module):
    """Map-Expand-Reduce: lookup at n, hierarchical group transformation to k, reduce to d_model.

    Each expansion layer is a bias-free group linear followed by GELU (the paper names no nonlinearity; a
    purely linear stack would collapse to one factorised matrix). A LayerNorm on the output gives the token
    vectors unit scale next to the position embeddings. Tied output: logits = (h P) E^T with P a d_model -> n
    projection, the paper's classifier at dimension n (Fig. 1a); no P when n == d_model.
    """

    def __init__(self, cfg: DeFINEConfig, vocab_size: int, d_model: int, tie_output: bool):
        super().__init__()
        self.cfg = cfg
        self.table = nn.Embedding(vocab_size, cfg.input_dim)
        nn.init.normal_(self.table.weight, std=cfg.input_dim**-0.5)
        self.expand = nn.ModuleList(
            GroupLinear(n_l, k_l, g_l) for n_l, k_l, g_l in zip(cfg.layer_inputs(), cfg.widths(), cfg.groups())
        )
        self.act = nn.GELU()
        self.reduce = nn.Linear(cfg.width, d_model, bias=False) if cfg.reduce else None
        self.norm = nn.LayerNorm(d_model)
        self.output_projection = None
        if tie_output and cfg.input_dim != d_model:
            self.output_projection = nn.Linear(d_model, cfg.input_dim, bias=False)
            nn.init.normal_(self.output_projection.weight, std=d_model**-0.5)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        e_BTN = self.table(tokens_BT)
        h_BTK = e_BTN
        for layer_index, (layer, groups) in enumerate(zip(self.expand, self.cfg.groups())):
            if layer_index == 0 or self.cfg.skip in ("none", "residual"):
                x = h_BTK
            elif self.cfg.skip == "concat":
                x = torch.cat([e_BTN, h_BTK], dim=-1)
            else:
                x = split_mix(e_BTN, h_BTK, groups)
            out = self.act(layer(x))
            h_BTK = h_BTK + out if self.cfg.skip == "residual" and layer_index > 0 else out
        if self.reduce is not None:
            h_BTK = self.reduce(h_BTK)
        return self.norm(h_BTK)

    def output_weight(self) -> torch.Tensor | None:
        if self.output_projection is None:
            return self.table.weight if self.table.weight.shape[1] == self.norm.normalized_shape[0] else None
        return self.table.weight @ self.output_projection.weight  # [V, n] @ [n, d_model]

    def parameter_counts(self) -> dict[str, int]:
        """map (lookup), transform (the expansion layers: the paper's sum of n_l k_l / g_l), reduce, other."""
        count = lambda module: 0 if module is None else sum(p.numel() for p in module.parameters())  # noqa: E731
        counts = {"map": count(self.table), "transform": count(self.expand), "reduce": count(self.reduce)}
        counts["other"] = count(self) - sum(counts.values())
        return counts


class AdaptiveInput(nn.Module):
    """Adaptive input representations (Baevski & Auli, 2019, Sec. 3): band i of the frequency-sorted vocabulary
    has a table of width d_model / factor^i and a projection to d_model, so rare tokens cost fewer parameters.

    Tied output: the [V, d_model] matrix of every token's embedding, band tables times their projections,
    i.e. the input representation itself serves as the output embedding (no adaptive softmax).
    """

    def __init__(self, cfg: AdaptiveInputConfig, vocab_size: int, d_model: int):
        super().__init__()
        cfg.check_vocab(vocab_size)
        self.bounds = [0, *cfg.cutoffs, vocab_size]
        self.d_model, self.scale = d_model, math.sqrt(d_model)
        dims = cfg.band_dims(d_model)
        self.tables = nn.ModuleList(nn.Embedding(hi - lo, d) for lo, hi, d in zip(self.bounds, self.bounds[1:], dims))
        self.projections = nn.ModuleList(nn.Linear(d, d_model, bias=False) for d in dims)
        for table, proj, d in zip(self.tables, self.projections, dims):
            # Unit-norm rows, then a projection that keeps each output coordinate at std d_model^-1/2, the
            # scale of StandardEmbedding's table, so the sqrt(d_model) factor means the same for both.
            nn.init.normal_(table.weight, std=d**-0.5)
            nn.init.normal_(proj.weight, std=d_model**-0.5)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        dtype = self.projections[0].weight.dtype
        out_BTD = torch.zeros(*tokens_BT.shape, self.d_model, device=tokens_BT.device, dtype=dtype)
        for lo, hi, table, proj in zip(self.bounds, self.bounds[1:], self.tables, self.projections):
            # Every token through every band, kept where it belongs: gathering a band's own tokens reads their
            # count back from the device (three waits a band at every step on a GPU, a graph break under
            # torch.compile). The cost is each band's projection over the whole batch: d_model x (1 + 1/factor +
            # ...) multiply-adds a token where it was d_model x its band's width, small beside one layer.
            in_band_BT1 = ((tokens_BT >= lo) & (tokens_BT < hi)).unsqueeze(-1)
            band_BTD = proj(table((tokens_BT - lo).clamp(0, hi - lo - 1)))
            # Under autocast (bf16 / fp16) the projection returns the low precision; the sum stays in the weights'.
            out_BTD = out_BTD + torch.where(in_band_BT1, band_BTD.to(dtype), 0.0)
        return out_BTD * self.scale

    def output_weight(self) -> torch.Tensor:
        # Unscaled, like StandardEmbedding's tied table: rows have norm ~1 while the input is scaled by sqrt(d).
        return torch.cat([table.weight @ proj.weight.T for table, proj in zip(self.tables, self.projections)])


def build_token_embedding(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    if isinstance(cfg.embedding, StandardEmbeddingConfig):
        return StandardEmbedding(vocab_size, cfg.d_model)
    if isinstance(cfg.embedding, DeFINEConfig):
        return DeFINEEmbedding(cfg.embedding, vocab_size, cfg.d_model, cfg.tie_output)
    if isinstance(cfg.embedding, AdaptiveInputConfig):
        return AdaptiveInput(cfg.embedding, vocab_size, cfg.d_model)
    raise ValueError(f"model.embedding.kind={cfg.embedding.kind!r} is not known")


class SinusoidalPositions(nn.Module):
    """Fixed sin/cos position encodings (Vaswani et al., 2017, Sec. 3.5)."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_len, d_model)
        table[:, 0::2] = torch.sin(pos * inv_freq)
        table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
        self.register_buffer("table", table, persistent=False)

    def forward(self, T: int) -> torch.Tensor:
        return self.table[:T]


class LearnedPositions(nn.Module):
    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def forward(self, T: int) -> torch.Tensor:
        return self.table[:T]


def build_positions(cfg: ModelConfig) -> nn.Module | None:
    """The absolute position table, or None under relative positions (they live in the attention)."""
    if cfg.positional == "relative":
        return None
    cls = LearnedPositions if cfg.positional == "learned" else SinusoidalPositions
    return cls(cfg.max_seq_len, cfg.d_model)
