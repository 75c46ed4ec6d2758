"""Batched beam search and greedy decoding for an encoder-decoder with `encode` / `decode`.

Beam search follows the fairseq SequenceGenerator (Ott et al., 2019, arXiv 1904.01038): every step expands the
K live hypotheses of each sentence, takes the best 2K continuations (so K survive even when some end), moves a
continuation that ends in eos to the finished list only when it ranks among the top K, and stops a sentence as
soon as it has K finished hypotheses. Finished hypotheses are ranked by log p / length**length_penalty (Wu et
al., 2016 use a similar normalisation), where length counts the generated pieces including eos. At the length
limit max_len_a * source_length + max_len_b only eos is allowed, so every sentence finishes.

Greedy decoding is beam search with K = 1 (the eos rule then means "stop when eos is the argmax"); the
separate `greedy_decode` is kept as a simple reference that the tests compare against.

Each step needs the next-piece logits of every live prefix. A model with `start_decoding` / `decode_step` whose
decoder attention can cache keys/values (exact mechanism, no reversible stack) runs only the newest position
per step over a cache that beam reselection reorders (`_IncrementalDecoder`); any other model reruns `decode`
over the whole prefix (`_FullRecomputeDecoder`). `incremental=None` picks automatically and says which at debug
level; both give the same tokens and scores up to floating-point rounding (tests/test_decoding.py).

A sentence whose search is done leaves the decoding batch (its rows of the prefixes, the cache, the encoder
output and the source mask), as fairseq's generator drops finalised sentences, so a batch whose sentences end at
different steps spends no decoder work on the finished ones; `active` maps the remaining rows back to input
order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeSpecials:
    """Token ids the decoder must know: start, end, and ids that may never be generated."""

    bos: int
    eos: int
    forbidden: tuple[int, ...]


def max_lengths(src_lengths_B: torch.Tensor, max_len_a: float, max_len_b: int, cap: int) -> torch.Tensor:
    """Per-sentence limit on generated pieces (eos included), at most `cap` (the model's position table)."""
    return (src_lengths_B.float() * max_len_a + max_len_b).long().clamp(1, cap)


class _FullRecomputeDecoder:
    """Next-piece logits by running `decode` over the whole prefix: O(T^2) decoder work, any model."""

    def __init__(self, model: nn.Module, memory_NSD: torch.Tensor, src_padding_mask_NS: torch.Tensor | None):
        self.model, self.memory_NSD, self.src_padding_mask_NS = model, memory_NSD, src_padding_mask_NS

    def next_logits(self, tokens_NT: torch.Tensor) -> torch.Tensor:
        return self.model.decode(tokens_NT, self.memory_NSD, self.src_padding_mask_NS)[:, -1]

    def reorder_beams(self, origin_BK: torch.Tensor) -> None:
        """Nothing to do: the prefixes themselves are reordered by the caller."""

    def select(self, rows_N: torch.Tensor) -> None:
        """Keep the source rows of the prefixes the caller kept (finished sentences left the batch)."""
        self.memory_NSD = self.memory_NSD.index_select(0, rows_N)
        if self.src_padding_mask_NS is not None:
            self.src_padding_mask_NS = self.src_padding_mask_NS.index_select(0, rows_N)


class _IncrementalDecoder:
    """Next-piece logits from the newest token and a key/value cache of the prefix (models/kv_cache.py)."""

    def __init__(self, model: nn.Module, memory_NSD: torch.Tensor, src_padding_mask_NS: torch.Tensor | None):
        self.model = model
        self.cache = model.start_decoding(memory_NSD, src_padding_mask_NS)

    def next_logits(self, tokens_NT: torch.Tensor) -> torch.Tensor:
        assert tokens_NT.shape[1] == self.cache.length + 1, "feed every prefix position exactly once"
        return self.model.decode_step(tokens_NT[:, -1:], self.cache)

    def reorder_beams(self, origin_BK: torch.Tensor) -> None:
        self.cache.reorder_beams(origin_BK)

    def select(self, rows_N: torch.Tensor) -> None:
        self.cache.select(rows_N)


def incremental_unsupported_reasons(model: nn.Module) -> list[str]:
    """Why `model` must decode by full recomputation; empty when it can use a key/value cache."""
    if not hasattr(model, "incremental_decoding_unsupported_reasons"):
        return [f"{type(model).__name__} has no start_decoding / decode_step"]
    return model.incremental_decoding_unsupported_reasons()


def _prefix_decoder(model: nn.Module, memory_NSD: torch.Tensor, src_padding_mask_NS: torch.Tensor | None,
                    incremental: bool | None) -> _FullRecomputeDecoder | _IncrementalDecoder:
    """The incremental decoder when asked for (or, with None, when the model supports it), else full recompute."""
    reasons = incremental_unsupported_reasons(model)
    if incremental and reasons:
        raise ValueError("incremental decoding is not possible: " + "; ".join(reasons)
                         + ". Pass incremental=None (choose automatically) or False")
    if incremental is None:
        incremental = not reasons
        if incremental:
            logger.debug("decoding incrementally with a key/value cache")
        else:
            logger.debug("decoding by rerunning the decoder over the whole prefix: %s", "; ".join(reasons))
    cls = _IncrementalDecoder if incremental else _FullRecomputeDecoder
    return cls(model, memory_NSD, src_padding_mask_NS)


def _step_log_probs(logits_NV: torch.Tensor, eos: int, forbidden_F: torch.Tensor,
                    force_eos_N: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [N, V] of the next piece; forbidden ids get -inf, and only eos where force_eos. Nothing
    is read back from the device: the forbidden ids are a device tensor, and forcing is a select on every row."""
    logp_NV = torch.log_softmax(logits_NV.float(), dim=-1).index_fill_(1, forbidden_F, -torch.inf)
    # forcing keeps the model's own eos probability so finished scores stay true log-probabilities
    forced_NV = torch.full_like(logp_NV, -torch.inf)
    forced_NV[:, eos] = logp_NV[:, eos]
    return torch.where(force_eos_N[:, None], forced_NV, logp_NV)


def _forbidden_ids(specials: DecodeSpecials, device: torch.device) -> torch.Tensor:
    return torch.tensor(sorted(specials.forbidden), dtype=torch.long, device=device)


def _on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for the device: pinned, then copied asynchronously (the pinned
    block is not reused before the copy ends: PyTorch's host allocator records it)."""
    host = torch.from_numpy(array)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


@torch.no_grad()
def greedy_decode(model: nn.Module, src_BS: torch.Tensor, src_padding_mask_BS: torch.Tensor | None,
                  max_len_B: torch.Tensor, specials: DecodeSpecials, *,
                  incremental: bool | None = None) -> list[list[int]]:
    """Argmax piece by piece until eos or the length limit; returns pieces without bos/eos."""
    B = src_BS.shape[0]
    memory_BSD = model.encode(src_BS, src_padding_mask_BS)
    decoder = _prefix_decoder(model, memory_BSD, src_padding_mask_BS, incremental)
    tokens_BT = torch.full((B, 1), specials.bos, dtype=torch.long, device=src_BS.device)
    finished_B = torch.zeros(B, dtype=torch.bool, device=src_BS.device)
    forbidden_F = _forbidden_ids(specials, src_BS.device)
    for t in range(int(max_len_B.max())):
        logp_BV = _step_log_probs(decoder.next_logits(tokens_BT), specials.eos, forbidden_F, t + 1 >= max_len_B)
        next_B = logp_BV.argmax(-1).masked_fill(finished_B, specials.eos)
        tokens_BT = torch.cat([tokens_BT, next_B[:, None]], dim=1)
        finished_B |= next_B == specials.eos
        if finished_B.all():  # the step's one read from the device
            break
    out = []
    for row in tokens_BT[:, 1:].tolist():
        out.append(row[: row.index(specials.eos)] if specials.eos in row else row)
    return out


@torch.no_grad()
def beam_search(model: nn.Module, src_BS: torch.Tensor, src_padding_mask_BS: torch.Tensor | None,
                max_len_B: torch.Tensor, specials: DecodeSpecials, *, beam_size: int, length_penalty: float,
                incremental: bool | None = None, drop_finished: bool = True) -> tuple[list[list[int]], list[float]]:
    """Best hypothesis per sentence (pieces without bos/eos) and its normalised score, in the input order.

    `incremental`: True decodes with a key/value cache (an error if the model cannot), False reruns the decoder
    over the prefix, None chooses the cache whenever the model supports it.
    `drop_finished`: a sentence whose search is done leaves the decoding batch, so the decoder and output layer
    run on unfinished sentences only; False keeps every sentence to the end (same hypotheses and scores, kept
    as the reference the tests compare against).

    The device computes each step's candidates; the host keeps the book (finished hypotheses, which sentences
    are done, a copy of the prefixes) from one read of the step's small [A, 2K] candidate tables, where reading
    each decision back as it was made waited for the device about 18 times a step.
    """
    B, K, device = src_BS.shape[0], beam_size, src_BS.device
    memory_NSD = model.encode(src_BS, src_padding_mask_BS).repeat_interleave(K, dim=0)  # N = B * K
    mask_NS = None if src_padding_mask_BS is None else src_padding_mask_BS.repeat_interleave(K, dim=0)
    decoder = _prefix_decoder(model, memory_NSD, mask_NS, incremental)
    forbidden_F = _forbidden_ids(specials, device)
    # The decoding batch holds the A sentences `active` (input indices, ascending), K rows each; every per-
    # sentence array below is indexed by position in `active`, `finished` by input index.
    active = list(range(B))
    max_len_A = max_len_B
    limit_A = max_len_B.cpu().numpy()
    tokens_NT = torch.full((B * K, 1), specials.bos, dtype=torch.long, device=device)
    prefixes_NT = np.full((B * K, 1), specials.bos, dtype=np.int64)  # the host's copy of tokens_NT
    scores_AK = torch.full((B, K), -torch.inf, device=device)
    scores_AK[:, 0] = 0.0  # all beams start identical: keep one alive so the first step has K distinct picks
    first_scores_A = np.zeros(B)  # the host's copy of scores_AK[:, 0]
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done_A = np.zeros(B, dtype=bool)

    for t in range(int(limit_A.max())):
        A = len(active)
        logp_NV = _step_log_probs(decoder.next_logits(tokens_NT), specials.eos, forbidden_F,
                                  (t + 1 >= max_len_A).repeat_interleave(K))
        V = logp_NV.shape[-1]
        cand_AKV = scores_AK[:, :, None] + logp_NV.view(A, K, V)
        top_scores_A2K, top_index_A2K = cand_AKV.view(A, K * V).topk(min(2 * K, K * V), dim=-1)
        origin_A2K, piece_A2K = top_index_A2K // V, top_index_A2K % V
        # the K best continuations that do not end: candidates are sorted, so mask eos and take the top K
        keep_scores_AK, keep_AK = top_scores_A2K.masked_fill(piece_A2K == specials.eos, -torch.inf).topk(K, dim=-1)
        origin_AK, piece_AK = origin_A2K.gather(1, keep_AK), piece_A2K.gather(1, keep_AK)
        # The step's one read: float64 holds the fp32 scores and the ids exactly.
        tables = torch.cat([part.double() for part in (top_scores_A2K, origin_A2K, piece_A2K, keep_scores_AK,
                                                        origin_AK, piece_AK)], 1)
        top_scores, origins, pieces, keep_scores, keep_origins, keep_pieces = np.split(
            tables.cpu().numpy(), np.cumsum([top_scores_A2K.shape[1]] * 3 + [K] * 2), axis=1)

        ends = ((pieces == specials.eos) & (np.arange(pieces.shape[1]) < K) & np.isfinite(top_scores)
                & ~done_A[:, None])
        for a, j in zip(*np.nonzero(ends)):
            if len(finished[active[a]]) < K:
                seq = prefixes_NT[a * K + int(origins[a, j]), 1:].tolist()
                finished[active[a]].append((float(top_scores[a, j]) / float(t + 1) ** length_penalty, seq))

        done_A |= np.array([len(finished[b]) >= K for b in active])
        done_A |= t + 1 >= limit_A  # the limit forced eos on every live beam
        for a in np.flatnonzero(done_A):
            if not finished[active[a]]:  # only if every beam died at once: fall back to the best live one
                finished[active[a]].append((float(first_scores_A[a]), prefixes_NT[a * K, 1:].tolist()))
        if done_A.all():
            break
        if drop_finished and done_A.any():
            # Leaving the batch only removes rows: each remaining row's computation is unchanged.
            alive = np.flatnonzero(~done_A)
            rows = (alive[:, None] * K + np.arange(K)).reshape(-1)
            alive_A, rows_N = _on_device(alive, device), _on_device(rows, device)
            tokens_NT, prefixes_NT = tokens_NT[rows_N], prefixes_NT[rows]
            decoder.select(rows_N)
            active, limit_A, done_A = [active[a] for a in alive], limit_A[alive], done_A[alive]
            max_len_A, keep_scores_AK = max_len_A[alive_A], keep_scores_AK[alive_A]
            origin_AK, piece_AK = origin_AK[alive_A], piece_AK[alive_A]
            keep_scores, keep_origins, keep_pieces = keep_scores[alive], keep_origins[alive], keep_pieces[alive]
            A = len(alive)
        scores_AK = keep_scores_AK
        if done_A.any():  # kept in the batch (drop_finished=False): a done sentence's beams make no more candidates
            scores_AK = scores_AK.masked_fill(_on_device(done_A, device)[:, None], -torch.inf)
        first_scores_A = np.where(done_A, -np.inf, keep_scores[:, 0])
        rows_N = (torch.arange(A, device=device)[:, None] * K + origin_AK).view(-1)
        tokens_NT = torch.cat([tokens_NT[rows_N], piece_AK.view(-1, 1)], dim=1)
        rows = (np.arange(A)[:, None] * K + keep_origins.astype(np.int64)).reshape(-1)
        prefixes_NT = np.concatenate([prefixes_NT[rows], keep_pieces.astype(np.int64).reshape(-1, 1)], axis=1)
        decoder.reorder_beams(origin_AK)

    hypotheses, best_scores = [], []
    for b in range(B):
        score, seq = max(finished[b], key=lambda item: item[0])
        hypotheses.append(seq)
        best_scores.append(score)
    return hypotheses, best_scores


def sequence_log_prob(model: nn.Module, src_BS: torch.Tensor, src_padding_mask_BS: torch.Tensor | None,
                      hypothesis: list[int], row: int, specials: DecodeSpecials) -> float:
    """Log p(hypothesis + eos | source `row`) under the model: the quantity beam search maximises."""
    src_1S = src_BS[row: row + 1]
    mask_1S = None if src_padding_mask_BS is None else src_padding_mask_BS[row: row + 1]
    tgt = [specials.bos, *hypothesis, specials.eos]
    tgt_1T = torch.tensor([tgt], dtype=torch.long, device=src_BS.device)
    with torch.no_grad():
        logits_1TV = model.decode(tgt_1T[:, :-1], model.encode(src_1S, mask_1S), mask_1S).float()
        logp_1TV = torch.log_softmax(logits_1TV, dim=-1)
    return float(logp_1TV[0].gather(1, tgt_1T[0, 1:, None]).sum())
