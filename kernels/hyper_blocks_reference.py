"""The PyTorch reference of HyperAttention's blocks + samples in one softmax (kernels/k_hyper_blocks.py): the
kernels' oracle, and the checks of the layout both share. models/attention/hyper.py computes the same thing as two
parts merged through their log-sum-exp; tests/test_hyper_blocks_kernel.py checks the three against each other."""

from __future__ import annotations

import math

import torch

from kernels.reference import (
    _softmax_with_lse,
    _upcast,
    check_attention_inputs,
    check_key_padding_mask,
    fp32_softmax,
)


def check_hyper_block_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    q_slots: torch.Tensor,
    k_rows: torch.Tensor,
    group_block: torch.Tensor,
    sample_rows: torch.Tensor,
    sample_log_weight: torch.Tensor,
    block: int,
    key_padding_mask: torch.Tensor | None,
) -> None:
    """Shapes and dtypes of `hyper_block_attention_reference`'s layout (what a kernel can check without reading
    the indices back to the host)."""
    B, H = q.shape[:2]
    if block < 1:
        raise ValueError(f"block must be >= 1; got {block}")
    check_key_padding_mask(key_padding_mask, B, k.shape[2])
    G = group_block.shape[-1]
    expected = {"q_slots": (q_slots, (B, H, G * block)), "group_block": (group_block, (B, H, G)),
                "k_rows": (k_rows, (B, H, k_rows.shape[-1])),
                "sample_rows": (sample_rows, (B, H, sample_rows.shape[-1]))}
    for name, (x, shape) in expected.items():
        if x.dtype != torch.int64 or tuple(x.shape) != shape:
            raise ValueError(f"{name} must be int64 {list(shape)}; got {x.dtype} {list(x.shape)}")
    if k_rows.shape[-1] % block:
        raise ValueError(f"k_rows must hold whole key blocks of {block} rows; got {k_rows.shape[-1]}")
    if sample_log_weight.shape != (B,):
        raise ValueError(f"sample_log_weight must hold one log-weight per batch row ({B}); got "
                         f"{list(sample_log_weight.shape)}")


@fp32_softmax
def hyper_block_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_slots: torch.Tensor,
    k_rows: torch.Tensor,
    group_block: torch.Tensor,
    sample_rows: torch.Tensor,
    sample_log_weight: torch.Tensor,
    block: int,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HyperAttention's approximate step as one softmax (kernels/k_hyper_blocks.py): q [B, H, M, D], k, v [B, H,
    N, D] -> out [B, H, M, D], lse [B, H, M].

    The sorted layouts are indices, per (batch, head): ``k_rows`` [NB * b] lays the keys out in NB blocks of
    ``block`` = b rows (row r holds key token k_rows[r], or nothing for -1); ``q_slots`` [G * b] lays the queries
    out in G groups of b slots (a query token or -1); group g attends to key block ``group_block`` [G] (int64,
    non-decreasing, in [0, NB)) and to the m keys at rows ``sample_rows`` [m], except samples inside its own key
    block; a sample's logit is raised by ``sample_log_weight`` [B] (natural log; HyperAttention's n / m importance
    weight). ``key_padding_mask`` [B, N] (True = padded key) masks keys by token. Every query token must sit in
    exactly one slot, every key token in at most one row. Rows without any key give zeros and lse = -inf.
    """
    check_attention_inputs(q, k, v)
    check_hyper_block_inputs(q, k, q_slots, k_rows, group_block, sample_rows, sample_log_weight, block,
                             key_padding_mask)
    B, H, M, D = q.shape
    N, G, b, m = k.shape[2], group_block.shape[-1], block, sample_rows.shape[-1]
    top_BHM = torch.sort(q_slots, dim=-1).values[..., -M:]
    every_token_once = torch.equal(top_BHM, torch.arange(M, device=q.device).expand_as(top_BHM))
    if (q_slots >= 0).sum(-1).ne(M).any() or not every_token_once:
        raise ValueError("q_slots must hold every query token exactly once per (batch, head)")
    scale = 1.0 / math.sqrt(D) if scale is None else scale

    def pick(x_BHTD: torch.Tensor, tok_BHL: torch.Tensor) -> torch.Tensor:
        """Rows of the tokens (zeros for -1): [B, H, L, D]."""
        rows = torch.gather(x_BHTD, 2, tok_BHL.clamp(min=0)[..., None].expand(B, H, tok_BHL.shape[-1], D))
        return rows.masked_fill((tok_BHL < 0)[..., None], 0.0)

    block_rows_BHGb = group_block[..., None] * b + torch.arange(b, device=q.device)
    tok_BHGK = torch.cat([torch.gather(k_rows, 2, block_rows_BHGb.flatten(2)).view(B, H, G, b),
                          torch.gather(k_rows, 2, sample_rows)[:, :, None, :].expand(B, H, G, m)], dim=-1)
    masked_BHGK = tok_BHGK < 0
    if key_padding_mask is not None:
        padded = torch.gather(key_padding_mask[:, None, :].expand(B, H, N), 2, tok_BHGK.clamp(min=0).flatten(2))
        masked_BHGK = masked_BHGK | padded.view(B, H, G, b + m)
    own_BHGm = (sample_rows // b)[:, :, None, :] == group_block[..., None]
    masked_BHGK = masked_BHGK | torch.cat([own_BHGm.new_zeros(B, H, G, b), own_BHGm], -1)
    bias_BK = torch.cat([torch.zeros(B, b, device=q.device), sample_log_weight.float()[:, None].expand(B, m)], -1)

    q_BHGbD = _upcast(pick(q, q_slots)).view(B, H, G, b, D)
    k_BHGKD = pick(k, tok_BHGK.flatten(2)).view(B, H, G, b + m, D)
    v_BHGKD = pick(v, tok_BHGK.flatten(2)).view(B, H, G, b + m, D)
    s = torch.matmul(q_BHGbD, _upcast(k_BHGKD).transpose(-1, -2)) * scale + bias_BK[:, None, None, None, :]
    out_g, lse_g = _softmax_with_lse(s, masked_BHGK[:, :, :, None, :].expand_as(s), v_BHGKD, 0.0)
    # Back to the tokens' rows; filler slots go to a spare row M, dropped.
    slot_BHS = torch.where(q_slots >= 0, q_slots, M)
    out = torch.zeros(B, H, M + 1, D, dtype=out_g.dtype, device=q.device).scatter(
        2, slot_BHS[..., None].expand(B, H, G * b, D), out_g.reshape(B, H, G * b, D))
    lse = torch.zeros(B, H, M + 1, dtype=lse_g.dtype, device=q.device).scatter(2, slot_BHS, lse_g.reshape(B, H, -1))
    return out[:, :, :M], lse[:, :, :M]
