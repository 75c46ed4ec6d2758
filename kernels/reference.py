"""Pure PyTorch attention with log-sum-exp: the test oracle and the CPU fallback of every kernel.

Both functions return ``(out, lse)`` where ``lse`` is the natural-log sum of exponentials of the *scaled*
logits of each query row, as FlashAttention-2 keeps it (Dao, 2023, "FlashAttention-2: Faster Attention with
Better Parallelism and Work Partitioning", arXiv 2307.08691). Gradients of both outputs come from autograd,
so these functions are an independent check of the hand-written Triton backward passes.

Softmax runs in fp32 for fp16/bf16/fp32 inputs (fp16 logits overflow) and in fp64 for fp64 inputs; ``out``
is cast back to the input dtype and ``lse`` stays in the softmax dtype. A query row whose keys are all
masked returns zeros and ``lse = -inf``, never NaN.

Under autocast (bf16 or fp16, on CPU as on CUDA) these functions run with autocast switched off
(``fp32_softmax``): matmul is on autocast's lower-precision list, so it would cast the upcast logits back to
half precision, and the softmax, its log-sum-exp and every merge of attention parts built on that lse
(models/attention/lse.py) would be computed in bf16. tests/test_mixed_precision.py fails if that happens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable)

# Reformer gives a token's logit to itself a large negative value rather than -inf, so that a query still
# has something to attend to when every other key is masked (Kitaev et al., 2020, arXiv 2001.04451, sec. 2.2;
# Hugging Face uses -1e5 in fp32). It is applied to the scaled logit, in fp32.
SELF_LOGIT = -1e5

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def autocast_off(device_type: str) -> torch.autocast:
    """The context the fp32 parts run in (a function of its own so a test can break it and watch a check fail)."""
    return torch.autocast(device_type, enabled=False)


def fp32_softmax(fn: Fn) -> Fn:
    """Run an attention function (q first) with autocast off on q's device: its own upcasts then hold, and the
    logits, softmax and lse stay in fp32 whatever the caller's autocast; ``out`` still returns in the inputs'
    dtype, so the rest of the layer runs in the caller's precision."""

    @functools.wraps(fn)
    def wrapper(q: torch.Tensor, *args, **kwargs):
        with autocast_off(q.device.type):
            return fn(q, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Reject layouts that would silently produce a wrong result (e.g. [B, T, H, D] passed as [B, H, T, D])."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D [batch, heads, seq, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must agree on batch, heads and head_dim; got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")


def check_key_padding_mask(mask: torch.Tensor | None, batch: int, seq_k: int) -> None:
    if mask is None:
        return
    if mask.dtype != torch.bool or mask.shape != (batch, seq_k):
        raise ValueError(
            f"key_padding_mask must be bool [batch, seq_k] = [{batch}, {seq_k}] with True = padded key; "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )


def per_head(x: torch.Tensor | None, batch: int, heads: int, seq: int, name: str) -> torch.Tensor | None:
    """Broadcast a [batch, seq] or [batch, heads, seq] tensor to [batch, heads, seq].

    Chunked attention runs on sequences sorted per head (LSH buckets differ by head), so its masks and
    positions may differ by head; a [batch, seq] tensor is shared by all heads.
    """
    if x is None:
        return None
    if x.dim() == 2 and x.shape == (batch, seq):
        return x[:, None, :].expand(batch, heads, seq)
    if x.dim() == 3 and x.shape == (batch, heads, seq):
        return x
    raise ValueError(
        f"{name} must be [batch, seq] = [{batch}, {seq}] or [batch, heads, seq] = [{batch}, {heads}, {seq}]; "
        f"got {tuple(x.shape)}"
    )


def per_round(x: torch.Tensor | None, batch: int, heads: int, rounds: int, seq: int, name: str) -> torch.Tensor | None:
    """Broadcast a [batch, seq], [batch, heads, seq] or [batch, heads, rounds, seq] tensor to the last (a view)."""
    if x is not None and x.dim() == 4:
        if x.shape != (batch, heads, rounds, seq):
            raise ValueError(f"{name} must be [batch, seq], [batch, heads, seq] or [batch, heads, rounds, seq] = "
                             f"[{batch}, {heads}, {rounds}, {seq}]; got {tuple(x.shape)}")
        return x
    x_BHT = per_head(x, batch, heads, seq, name)
    return None if x_BHT is None else x_BHT[:, :, None].expand(batch, heads, rounds, seq)


def check_chunked_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    chunk: int,
    lookback: int,
    positions: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    token_of_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validate the chunked-attention arguments; return positions ([B, H, T], or [B, H, R, T] with token_of_row)
    and the padding mask [B, H, T] (or None)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    if lookback < 0:
        raise ValueError(f"lookback must be >= 0; got {lookback}")
    batch, heads, seq, _ = q.shape
    if k.shape[2] != seq:
        raise ValueError(f"chunked attention needs q and k of the same length; got {seq} and {k.shape[2]}")
    if token_of_row is None:
        pos = per_head(positions, batch, heads, seq, "positions")
    else:
        if token_of_row.dim() != 4 or token_of_row.shape[:2] != (batch, heads):
            raise ValueError(f"token_of_row must be [batch, heads, rounds, rows] = [{batch}, {heads}, R, L]; got "
                             f"{tuple(token_of_row.shape)}")
        if token_of_row.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"token_of_row must be int32 or int64; got {token_of_row.dtype}")
        pos = per_round(positions, batch, heads, token_of_row.shape[2], seq, "positions")
    if pos is not None and pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64; got {pos.dtype}")
    pad_BHT = per_head(key_padding_mask, batch, heads, seq, "key_padding_mask")
    if pad_BHT is not None and pad_BHT.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must be bool (True = padded); got {pad_BHT.dtype}")
    return pos, pad_BHT


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 for fp16/bf16/fp32, fp64 stays fp64 (tests use it as a higher-precision oracle)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _softmax_with_lse(
    s_BHMN: torch.Tensor, masked_BHMN: torch.Tensor | None, v_BHND: torch.Tensor, dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted sum of v and the row log-sum-exp, with fully masked rows giving zeros and -inf."""
    if masked_BHMN is not None:
        # masked_fill (not an additive -inf) so that its backward zeroes the NaN that logsumexp's backward
        # produces on rows that are entirely -inf.
        s_BHMN = s_BHMN.masked_fill(masked_BHMN, float("-inf"))
    lse_BHM = torch.logsumexp(s_BHMN, dim=-1)
    lse_safe_BHM = torch.where(torch.isinf(lse_BHM), torch.zeros_like(lse_BHM), lse_BHM)
    p_BHMN = torch.exp(s_BHMN - lse_safe_BHM[..., None])  # exp(-inf - 0) = 0 on fully masked rows
    if dropout_p > 0.0:
        # Dropout on the probabilities, as SDPA does; lse stays the undropped normaliser so that parts over
        # disjoint keys (Reformer's hash rounds) still merge with the right weights.
        p_BHMN = torch.nn.functional.dropout(p_BHMN, dropout_p)
    out_BHMD = torch.matmul(p_BHMN, _upcast(v_BHND))
    return out_BHMD.to(v_BHND.dtype), lse_BHM


@fp32_softmax
def exact_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention. q [B, H, M, D], k and v [B, H, N, D] -> out [B, H, M, D], lse [B, H, M].

    ``causal`` aligns the mask top-left: query i sees keys j <= i, also when M != N.
    ``key_padding_mask`` [B, N] bool, True = padded key (contributes nothing). ``dropout_p`` drops
    attention probabilities (training only; the Triton kernels have no dropout).
    """
    check_attention_inputs(q, k, v)
    batch, _, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    check_key_padding_mask(key_padding_mask, batch, seq_k)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    s_BHMN = torch.matmul(_upcast(q), _upcast(k).transpose(-1, -2)) * scale
    masked_BHMN = None
    if causal:
        rows_M = torch.arange(seq_q, device=q.device)
        cols_N = torch.arange(seq_k, device=q.device)
        masked_BHMN = (cols_N[None, :] > rows_M[:, None])[None, None]
    if key_padding_mask is not None:
        padded_B11N = key_padding_mask[:, None, None, :]
        masked_BHMN = padded_B11N if masked_BHMN is None else masked_BHMN | padded_B11N
    if masked_BHMN is not None:
        masked_BHMN = masked_BHMN.expand_as(s_BHMN)
    return _softmax_with_lse(s_BHMN, masked_BHMN, v, dropout_p)


def chunk_neighbours(n_chunks: int, lookback: int, wrap: bool) -> torch.Tensor:
    """Key chunk indices of every query chunk: [n_chunks, n_look], -1 where there is none.

    Query chunk c attends to chunks c, c-1, ..., c-lookback. With ``wrap`` the indices are taken modulo
    n_chunks, as Reformer's look-one-back does, so chunk 0 also sees the last chunk. A chunk is never
    attended twice: the look-back stops after n_chunks - 1 steps.
    """
    n_look = min(lookback, n_chunks - 1) + 1
    c_C1 = torch.arange(n_chunks)[:, None]
    kc_CL = c_C1 - torch.arange(n_look)[None, :]
    return kc_CL % n_chunks if wrap else kc_CL.clamp(min=-1)


@fp32_softmax
def chunked_attention_reference(
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
    token_of_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention within chunks of an already sorted sequence (Reformer's LSH attention after the sort).

    q, k, v [B, H, T, D]. Query chunk c (rows c*chunk .. c*chunk+chunk-1; the last chunk may be shorter)
    attends to key chunks c-lookback..c, cyclically when ``wrap`` (see ``chunk_neighbours``).
    ``positions`` [B, T] or [B, H, T] int: the original token position of each sorted row (default: the row
    index). ``causal`` masks keys with a later position than the query; ``self_mask`` replaces the logit of
    a key at the query's own position with SELF_LOGIT, so a token attends to itself only when nothing else
    is available. ``key_padding_mask`` [B, T] or [B, H, T] bool (True = padded), in the sorted order.
    ``dropout_p`` as in exact_attention_reference.
    Costs O(T * chunk * (lookback + 1)) memory, unlike a dense T x T mask.

    ``token_of_row`` [B, H, R, L] int: the sorted sequences as an index instead of sorted copies. q, k, v are then
    in token order, and round r's sorted sequence has L rows, row l holding token token_of_row[b, h, r, l], or
    nothing for -1 (a filler row: a masked key, its query output dropped). Every token must sit in exactly one
    row of every round. ``positions`` are per token, [B, T], [B, H, T] or [B, H, R, T] (default: the token
    index), ``key_padding_mask`` per token [B, T] or [B, H, T]; out [B, H, R, T, D] and lse [B, H, R, T] hold
    each round's result at the tokens' places. The same as laying q, k, v, positions and the mask out in the
    rows' order (zeros and True in filler rows) and picking each token's row from the result, which is what this
    reference does; the Triton kernels load and store through the index instead.
    """
    check_attention_inputs(q, k, v)
    args = dict(chunk=chunk, lookback=lookback, causal=causal, self_mask=self_mask, scale=scale, wrap=wrap,
                dropout_p=dropout_p)
    if token_of_row is None:
        return _chunked_rows(q, k, v, positions=positions, key_padding_mask=key_padding_mask, **args)
    pos_BHRT, pad_BHT = check_chunked_inputs(q, k, chunk, lookback, positions, key_padding_mask, token_of_row)
    B, H, T, D = q.shape
    R, L = token_of_row.shape[2:]
    filler_BHRL = token_of_row < 0
    idx_BHRL = token_of_row.clamp(min=0).long()

    def rows(x_BHRT_: torch.Tensor, fill: float | bool) -> torch.Tensor:
        """[B, H, R, T, ...] -> [B, H * R, L, ...]: row l holds its token's entry, a filler row `fill`."""
        tail = x_BHRT_.shape[4:]
        idx = idx_BHRL.view(B, H, R, L, *(1,) * len(tail)).expand(B, H, R, L, *tail)
        picked = torch.gather(x_BHRT_.expand(B, H, R, T, *tail), 3, idx)
        return picked.masked_fill(filler_BHRL.view(B, H, R, L, *(1,) * len(tail)), fill).reshape(B, H * R, L, *tail)

    rounds = lambda x_BHT_: x_BHT_[:, :, None].expand(B, H, R, *x_BHT_.shape[2:])  # noqa: E731
    if pos_BHRT is None:
        pos_BHRT = torch.arange(T, device=q.device).expand(B, H, R, T)
    if pad_BHT is None:
        pad_BHT = torch.zeros(B, H, T, dtype=torch.bool, device=q.device)
    out_BXLD, lse_BXL = _chunked_rows(
        rows(rounds(q), 0.0), rows(rounds(k), 0.0), rows(rounds(v), 0.0), positions=rows(pos_BHRT, 0),
        key_padding_mask=rows(rounds(pad_BHT), True), **args)
    # Back to the tokens' places; filler rows all go to an extra place T, dropped.
    slot_BHRL = torch.where(filler_BHRL, T, idx_BHRL)
    out_BHRTD = out_BXLD.new_zeros(B, H, R, T + 1, D).scatter(
        3, slot_BHRL[..., None].expand(B, H, R, L, D), out_BXLD.view(B, H, R, L, D))
    lse_BHRT = lse_BXL.new_full((B, H, R, T + 1), float("-inf")).scatter(3, slot_BHRL, lse_BXL.view(B, H, R, L))
    return out_BHRTD[:, :, :, :T], lse_BHRT[..., :T]


def _chunked_rows(
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
    """`chunked_attention_reference` without token_of_row (the rows are the tokens)."""
    pos_BHT, pad_BHT = check_chunked_inputs(q, k, chunk, lookback, positions, key_padding_mask)
    batch, heads, seq, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if pos_BHT is None:
        pos_BHT = torch.arange(seq, device=q.device).expand(batch, heads, seq)
    if pad_BHT is None:
        pad_BHT = torch.zeros(batch, heads, seq, dtype=torch.bool, device=q.device)

    n_chunks = -(-seq // chunk)
    tail = n_chunks * chunk - seq  # the last chunk is padded up to `chunk` rows with masked keys

    def chunked(x_BHT_: torch.Tensor, fill: float | bool | int) -> torch.Tensor:
        pad_shape = (*x_BHT_.shape[:2], tail, *x_BHT_.shape[3:])
        filler = torch.full(pad_shape, fill, dtype=x_BHT_.dtype, device=x_BHT_.device)
        x_full = torch.cat([x_BHT_, filler], dim=2)
        return x_full.reshape(batch, heads, n_chunks, chunk, *x_BHT_.shape[3:])

    q_BHCQD = chunked(_upcast(q), 0.0)
    k_BHCQD = chunked(_upcast(k), 0.0)
    v_BHCQD = chunked(v, 0.0)
    pos_BHCQ = chunked(pos_BHT, -1)
    pad_BHCQ = chunked(pad_BHT, True)

    neighbours_CL = chunk_neighbours(n_chunks, lookback, wrap).to(q.device)
    missing_CL = neighbours_CL < 0
    idx_CL = neighbours_CL.clamp(min=0)
    n_look = idx_CL.shape[1]

    def gather(x_BHCQ_: torch.Tensor) -> torch.Tensor:
        # [B, H, C, Q, ...] -> [B, H, C, L*Q, ...]: the keys of every query chunk's neighbours, concatenated.
        g = x_BHCQ_[:, :, idx_CL]
        return g.reshape(batch, heads, n_chunks, n_look * chunk, *x_BHCQ_.shape[4:])

    kk_BHCKD = gather(k_BHCQD)
    vv_BHCKD = gather(v_BHCQD)
    kpos_BHCK = gather(pos_BHCQ)
    missing_CK = missing_CL[:, :, None].expand(n_chunks, n_look, chunk).reshape(n_chunks, n_look * chunk)
    masked_BHCQK = (gather(pad_BHCQ) | missing_CK)[:, :, :, None, :].expand(-1, -1, -1, chunk, -1)
    qpos_BHCQ1 = pos_BHCQ[..., None]
    kpos_BHC1K = kpos_BHCK[:, :, :, None, :]
    if causal:
        masked_BHCQK = masked_BHCQK | (kpos_BHC1K > qpos_BHCQ1)

    s_BHCQK = torch.matmul(q_BHCQD, kk_BHCKD.transpose(-1, -2)) * scale
    if self_mask:
        # A replaced (not added) value: no gradient flows through a token's dot product with itself.
        is_self_BHCQK = kpos_BHC1K == qpos_BHCQ1
        s_BHCQK = torch.where(is_self_BHCQK, torch.full_like(s_BHCQK, SELF_LOGIT), s_BHCQK)
    out_BHCQD, lse_BHCQ = _softmax_with_lse(s_BHCQK, masked_BHCQK, vv_BHCKD, dropout_p)
    out_BHTD = out_BHCQD.reshape(batch, heads, n_chunks * chunk, head_dim)[:, :, :seq]
    lse_BHT = lse_BHCQ.reshape(batch, heads, n_chunks * chunk)[:, :, :seq]
    return out_BHTD, lse_BHT

