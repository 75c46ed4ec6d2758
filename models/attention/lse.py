"""Attention pieces that return their log-sum-exp, and the merge that joins them.

Reformer's hash rounds and HyperAttention's block-diagonal + sampled parts are each an exact softmax over a
subset of the keys. A part returns its normalised output and the row-wise natural-log sum of exponentials of
its scaled logits (as FlashAttention-2 keeps it: Dao, 2023, arXiv 2307.08691); two parts over disjoint key sets
then combine exactly, which `merge_lse` does. Everything here is differentiable, the LSE included (the official
HyperAttention code detaches it; we do not).

`exact_attention` and `chunked_attention` are the PyTorch paths with the signatures of `kernels/`
(`kernels.exact_attention`, `kernels.chunked_attention`), so the Triton kernels can replace them in one place.
Softmax runs in fp32; a query row whose keys are all masked returns zeros and lse = -inf, never NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Reformer gives a token's logit to itself a large negative value instead of -inf, so a query still has
# something to attend to when every other key is masked (Kitaev et al., 2020, arXiv 2001.04451, Sec. 2.2;
# Hugging Face uses -1e5 in fp32). It replaces the scaled logit, in fp32.
SELF_LOGIT = -1e5


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: fp32 for half types (fp16 logits overflow), fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _softmax_with_lse(
    s_BHMN: torch.Tensor, masked_BHMN: torch.Tensor | None, v_BHND: torch.Tensor, dropout_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    if masked_BHMN is not None:
        # masked_fill (not an additive -inf) so that its backward zeroes the NaN logsumexp's backward makes
        # on rows that are entirely -inf.
        s_BHMN = s_BHMN.masked_fill(masked_BHMN, float("-inf"))
    lse_BHM = torch.logsumexp(s_BHMN, dim=-1)
    lse_safe_BHM = torch.where(torch.isinf(lse_BHM), torch.zeros_like(lse_BHM), lse_BHM)
    p_BHMN = torch.exp(s_BHMN - lse_safe_BHM[..., None])  # exp(-inf - 0) = 0 on fully masked rows
    if dropout_p > 0.0:
        # Dropout on the probabilities, as SDPA does; the lse stays the undropped normaliser so parts still
        # merge with the right weights.
        p_BHMN = F.dropout(p_BHMN, dropout_p)
    out_BHMD = torch.matmul(p_BHMN, _acc(v_BHND))
    return out_BHMD.to(v_BHND.dtype), lse_BHM


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v and its lse. q [B, H, M, D], k, v [B, H, N, D] -> [B, H, M, D], [B, H, M].

    `causal` aligns top-left (query i sees keys j <= i); `key_padding_mask` [B, N] bool, True = padded key.
    """
    B, _, M, D = q.shape
    N = k.shape[2]
    if key_padding_mask is not None and key_padding_mask.shape != (B, N):
        raise ValueError(
            f"key_padding_mask must be bool [batch, seq_k] = [{B}, {N}]; got {tuple(key_padding_mask.shape)}"
        )
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s_BHMN = torch.matmul(_acc(q), _acc(k).transpose(-1, -2)) * scale
    masked = None
    if causal:
        masked = (torch.arange(N, device=q.device)[None, :] > torch.arange(M, device=q.device)[:, None])[None, None]
    if key_padding_mask is not None:
        pad_B11N = key_padding_mask[:, None, None, :]
        masked = pad_B11N if masked is None else masked | pad_B11N
    if masked is not None:
        masked = masked.expand_as(s_BHMN)
    return _softmax_with_lse(s_BHMN, masked, v)


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: int,
    lookback: int = 1,
    positions: torch.Tensor | None = None,
    causal: bool = False,
    self_mask: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    wrap: bool = True,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention within chunks of an already sorted sequence: Reformer's LSH attention after the sort.

    q, k, v [B, H, T, D]. Query chunk c (rows c*chunk ...; the last chunk may be shorter) attends to key chunks
    c - lookback .. c, cyclically when `wrap`; a chunk is never attended twice. `positions` [B, H, T] int: the
    original position of each sorted row (default: row index), used by `causal` (mask keys later than the
    query) and `self_mask` (a key at the query's own position gets SELF_LOGIT). `key_padding_mask`
    [B, H, T] bool in sorted order. Memory O(T * chunk * (lookback + 1)), never a T x T matrix.
    """
    B, H, T, D = q.shape
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    pos_BHT = torch.arange(T, device=q.device).expand(B, H, T) if positions is None else positions
    pad_BHT = torch.zeros(B, H, T, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    C = -(-T // chunk)
    tail = C * chunk - T  # the last chunk is filled up to `chunk` rows with masked keys

    def chunked(x_BHT_: torch.Tensor, fill) -> torch.Tensor:
        pad = (0, 0, 0, tail) if x_BHT_.dim() == 4 else (0, tail)
        x_full = F.pad(x_BHT_, pad, value=fill)
        return x_full.reshape(B, H, C, chunk, *x_BHT_.shape[3:])

    q_BHCQD, k_BHCQD, v_BHCQD = chunked(_acc(q), 0.0), chunked(_acc(k), 0.0), chunked(v, 0.0)
    pos_BHCQ = chunked(pos_BHT, -1)
    pad_BHCQ = chunked(pad_BHT.to(torch.uint8), 1).bool()

    n_look = min(lookback, C - 1) + 1
    nb_CL = torch.arange(C, device=q.device)[:, None] - torch.arange(n_look, device=q.device)[None, :]
    missing_CL = torch.zeros_like(nb_CL, dtype=torch.bool) if wrap else nb_CL < 0
    idx_CL = nb_CL % C

    def gather(x_BHCQ_: torch.Tensor) -> torch.Tensor:
        # [B, H, C, Q, ...] -> [B, H, C, L*Q, ...]: the keys of every query chunk's neighbours, concatenated.
        return x_BHCQ_[:, :, idx_CL].reshape(B, H, C, n_look * chunk, *x_BHCQ_.shape[4:])

    kk_BHCKD, vv_BHCKD, kpos_BHCK = gather(k_BHCQD), gather(v_BHCQD), gather(pos_BHCQ)
    missing_CK = missing_CL[:, :, None].expand(C, n_look, chunk).reshape(C, n_look * chunk)
    masked_BHCQK = (gather(pad_BHCQ) | missing_CK)[:, :, :, None, :].expand(-1, -1, -1, chunk, -1)
    qpos_BHCQ1, kpos_BHC1K = pos_BHCQ[..., None], kpos_BHCK[:, :, :, None, :]
    if causal:
        masked_BHCQK = masked_BHCQK | (kpos_BHC1K > qpos_BHCQ1)
    s_BHCQK = torch.matmul(q_BHCQD, kk_BHCKD.transpose(-1, -2)) * scale
    if self_mask:
        # Replaced (not added): no gradient flows through a token's dot product with itself.
        s_BHCQK = torch.where(kpos_BHC1K == qpos_BHCQ1, torch.full_like(s_BHCQK, SELF_LOGIT), s_BHCQK)
    out_BHCQD, lse_BHCQ = _softmax_with_lse(s_BHCQK, masked_BHCQK, vv_BHCKD, dropout_p)
    return out_BHCQD.reshape(B, H, C * chunk, D)[:, :, :T], lse_BHCQ.reshape(B, H, C * chunk)[:, :, :T]


def _safe_max(lse_a: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    m = torch.maximum(lse_a, lse_b).detach()  # a shift, so its gradient is irrelevant
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Join two attention parts over disjoint key sets: out [..., M, D], lse [..., M].

    out = (out_a e^lse_a + out_b e^lse_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b), which is exact
    attention over the union of the two key sets. A part with lse = -inf (no keys) has weight 0; when both have
    none the result is zeros and -inf, with finite gradients.
    """
    m = _safe_max(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    has_keys = total > 0
    total_safe = torch.where(has_keys, total, torch.ones_like(total))
    lse = torch.where(has_keys, m + torch.log(total_safe), torch.full_like(total, float("-inf")))
    out = _acc(out_a) * (w_a / total_safe)[..., None] + _acc(out_b) * (w_b / total_safe)[..., None]
    return out.to(out_a.dtype), lse


def merge_lse_many(out_RM: torch.Tensor, lse_R: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_lse` over a whole axis `dim` of lse (out has one more trailing feature axis): Reformer's rounds."""
    m = lse_R.detach().amax(dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_R - m)
    total = w.sum(dim, keepdim=True)
    has_keys = total > 0
    total_safe = torch.where(has_keys, total, torch.ones_like(total))
    out = (_acc(out_RM) * (w / total_safe).unsqueeze(-1)).sum(dim)
    lse = torch.where(has_keys, m + torch.log(total_safe), torch.full_like(total, float("-inf"))).squeeze(dim)
    return out.to(out_RM.dtype), lse
