"""Triton kernel of LSH's past-only layout (models/attention/lsh.py `bucket_aligned_slots`): from the tokens in
(bucket, position) order, the row of the layout each one takes, every bucket's run starting a new chunk of C rows,
and the shifted positions of the causal test, in one launch instead of about twenty PyTorch ops.

One program lays out one (batch, head, round) row: it fills the row's slots with -1 (filler rows), then walks its
sorted tokens BLOCK at a time with two carries: where the current bucket's run began, and how many chunks the
tiles before have begun. In a tile, a token starts a run where its bucket differs from the previous sorted token's;
its rank in the run is its sorted index less the run's start (a running maximum of the starts); a chunk begins at
every rank that is a multiple of C; and its row is C * (its chunk's index) + rank mod C. That is
`bucket_aligned_slots`' row, C * (chunks of the lower buckets) + rank, written as a count of the chunks begun
before it, so no histogram over the bucket ids is needed.
"""

from __future__ import annotations

import triton
import triton.language as tl


def launch_config(interpret: bool) -> dict[str, int]:
    """Tiles of 1024 sorted tokens; the interpreter gets tiles of 16, so that the tests' short rows span several
    and the carries between tiles are exercised."""
    if interpret:
        return {"BLOCK": 16, "num_warps": 1}
    return {"BLOCK": 1024, "num_warps": 4}


@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _bucket_layout(
    BUCKET, ORDER, TOKEN, POS,
    stride_bb, stride_bh, stride_br, stride_bt,
    stride_ob, stride_oh, stride_or, stride_ot,
    stride_tb, stride_th, stride_tr, stride_tl,
    stride_pb, stride_ph, stride_pr, stride_pt,
    n_heads, n_rounds, seq_len, chunk, length,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    r = pid % n_rounds
    bh = pid // n_rounds
    h = bh % n_heads
    b = bh // n_heads
    bucket_row = BUCKET + b * stride_bb + h * stride_bh + r * stride_br
    order_row = ORDER + b * stride_ob + h * stride_oh + r * stride_or
    token_row = TOKEN + b * stride_tb + h * stride_th + r * stride_tr
    pos_row = POS + b * stride_pb + h * stride_ph + r * stride_pr

    # Every row of the layout starts as a filler (-1), then the tokens take theirs. The barrier orders the fill
    # before the tokens' stores, which other threads of this program make to the same rows (a CTA's barrier makes
    # its threads' earlier global stores visible to all of them), so no launch fills the buffer beforehand.
    for l0 in range(0, length, BLOCK):
        slot = l0 + tl.arange(0, BLOCK)
        tl.store(token_row + slot * stride_tl, tl.full([BLOCK], -1, tl.int32), mask=slot < length)
    tl.debug_barrier()

    run_start = 0  # sorted index where the run that reaches into this tile began
    chunks = 0  # chunks begun by the tiles before
    for t0 in range(0, seq_len, BLOCK):
        i = t0 + tl.arange(0, BLOCK)
        live = i < seq_len
        token = tl.load(order_row + i * stride_ot, mask=live, other=0)
        bucket = tl.load(bucket_row + token * stride_bt, mask=live, other=0)
        has_prev = live & (i > 0)
        prev_token = tl.load(order_row + (i - 1) * stride_ot, mask=has_prev, other=0)
        prev_bucket = tl.load(bucket_row + prev_token * stride_bt, mask=has_prev, other=0)
        starts = live & ((i == 0) | (bucket != prev_bucket))
        start = tl.associative_scan(tl.where(starts, i, run_start), 0, _running_max)
        rank = i - start
        begins = live & (rank % chunk == 0)
        chunk_of = chunks + tl.cumsum(begins.to(tl.int32), 0) - 1
        tl.store(token_row + (chunk_of * chunk + rank % chunk) * stride_tl, token.to(tl.int32), mask=live)
        # Shifted by -bucket * T, the causal test (key <= query) also drops the keys of a lower bucket that share
        # a query's previous chunk; inside a bucket it is the plain causal test.
        tl.store(pos_row + token * stride_pt, token - bucket * seq_len, mask=live)
        run_start = tl.max(tl.where(live, start, 0), 0)
        chunks += tl.sum(begins.to(tl.int32), 0)
