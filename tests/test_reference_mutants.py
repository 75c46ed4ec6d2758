"""kernels/reference.py, the oracle of every kernel and the CPU path of every method: checked against loops
written entry by entry in float64, its documented dtypes and autocast behaviour, dropout's expectation, and
each refusal's text. Fast (tiny shapes), so mutmut runs it against every mutant of the file
(docs/mutation_testing.md); tests/test_kernels.py checks the kernels against this reference."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import (
    SELF_LOGIT,
    check_attention_inputs,
    check_chunked_inputs,
    check_key_padding_mask,
    chunk_neighbours,
    chunked_attention_reference,
    exact_attention_reference,
    per_head,
)

B, H, D = 2, 2, 4


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def softmax_row(logits: list[float], values: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """One query's output and lse from its allowed (logit, value) pairs; none allowed: zeros and -inf."""
    if not logits:
        return torch.zeros(D, dtype=torch.float64), -math.inf
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return sum(w / total * v for w, v in zip(weights, values)), top + math.log(total)


def dense_loops(q, k, v, causal, pad, scale):
    M, N = q.shape[2], k.shape[2]
    out, lse = torch.zeros(B, H, M, D, dtype=torch.float64), torch.zeros(B, H, M, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(M):
                keys = [j for j in range(N) if (not causal or j <= i) and (pad is None or not pad[b, j])]
                logits = [float(q[b, h, i].double() @ k[b, h, j].double()) * scale for j in keys]
                out[b, h, i], lse[b, h, i] = softmax_row(logits, [v[b, h, j].double() for j in keys])
    return out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("M, N", [(5, 5), (3, 6), (6, 3)], ids=["square", "fewer-queries", "more-queries"])
def test_exact_reference_equals_the_loops(causal, M, N):
    """Top-left causal alignment also when M != N; row 0 of batch 1 has only padded keys (zeros, -inf)."""
    q, k, v = rand(B, H, M, D, seed=1), rand(B, H, N, D, seed=2), rand(B, H, N, D, seed=3)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, 0] = True
    pad[1, N - 1] = True
    for scale in (None, 0.3):
        out, lse = exact_attention_reference(q, k, v, causal=causal, key_padding_mask=pad, scale=scale)
        ref_out, ref_lse = dense_loops(q, k, v, causal, pad, D**-0.5 if scale is None else scale)
        torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)
    assert causal or torch.isfinite(lse).all()
    if causal:
        assert lse[1, :, 0].eq(-math.inf).all() and out[1, :, 0].eq(0).all()
    out, lse = exact_attention_reference(q, k, v, causal=causal)
    torch.testing.assert_close(out, dense_loops(q, k, v, causal, None, D**-0.5)[0], atol=1e-12, rtol=1e-10)


def test_a_fully_masked_row_has_finite_zero_gradients():
    q, k, v = (rand(1, 1, 3, D, seed=s).requires_grad_() for s in (4, 5, 6))
    pad = torch.tensor([[True, True, True]])
    out, lse = exact_attention_reference(q, k, v, key_padding_mask=pad)
    assert out.eq(0).all() and lse.eq(-math.inf).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() and g.eq(0).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtypes_out_like_the_inputs_lse_in_the_softmax_precision(dtype):
    q, k, v = (rand(B, H, 4, D, seed=s, dtype=dtype) for s in (7, 8, 9))
    out, lse = exact_attention_reference(q, k, v)
    assert out.dtype == dtype and lse.dtype == torch.promote_types(dtype, torch.float32)
    ref_out, ref_lse = dense_loops(q, k, v, False, None, D**-0.5)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=0)
    torch.testing.assert_close(out.double(), ref_out, atol=4 * tol, rtol=0)


def test_autocast_does_not_lower_the_softmax_precision():
    """Under CPU autocast (bf16) the logits and lse stay fp32 (autocast is switched off inside); out keeps the
    inputs' dtype. Left under autocast, matmul would round the logits to bf16 (errors ~1e-2)."""
    q, k, v = (rand(B, H, 8, 16, seed=s, dtype=torch.float32) * 3 for s in (10, 11, 12))
    ref_out, ref_lse = exact_attention_reference(q, k, v, causal=True)
    ref_c_out, ref_c_lse = chunked_attention_reference(q, k, v, chunk=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = exact_attention_reference(q, k, v, causal=True)
        c_out, c_lse = chunked_attention_reference(q, k, v, chunk=4)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(c_lse, ref_c_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(c_out, ref_c_out, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunked", [False, True], ids=["exact", "chunked"])
def test_dropout_keeps_the_lse_and_is_unbiased(chunked):
    """Dropout on the probabilities at the given rate (p = 0.3, survivors scaled by 1 / 0.7): the lse stays the
    undropped normaliser, the mean output over draws is the undropped one, and a query's 4 weights are all
    dropped (output zero) with probability p^4."""
    q, k, v = (rand(1, 1, 4, D, seed=s) for s in (13, 14, 15))
    rows = 20000  # independent draws side by side: the batch rows are copies of one input
    run = (
        (lambda p, x: chunked_attention_reference(*x, chunk=2, dropout_p=p))
        if chunked
        else (lambda p, x: exact_attention_reference(*x, dropout_p=p))
    )
    ref_out, ref_lse = run(0.0, (q, k, v))
    torch.manual_seed(0)
    out, lse = run(0.3, tuple(x.expand(rows, 1, 4, D) for x in (q, k, v)))
    torch.testing.assert_close(lse, ref_lse.expand(rows, 1, 4), atol=1e-12, rtol=1e-12)
    assert not torch.allclose(out[0], ref_out[0])
    torch.testing.assert_close(out.mean(0), ref_out[0], atol=0.03, rtol=0)
    all_dropped = (out == 0).all(-1).double().mean().item()  # every query sees 4 keys here
    assert abs(all_dropped - 0.3**4) < 0.004


@pytest.mark.parametrize(
    "n_chunks, lookback, wrap, expected",
    [
        (4, 1, True, [[0, 3], [1, 0], [2, 1], [3, 2]]),
        (4, 1, False, [[0, -1], [1, 0], [2, 1], [3, 2]]),
        (3, 5, True, [[0, 2, 1], [1, 0, 2], [2, 1, 0]]),
        (3, 5, False, [[0, -1, -1], [1, 0, -1], [2, 1, 0]]),
        (3, 0, True, [[0], [1], [2]]),
        (1, 1, True, [[0]]),
    ],
)
def test_chunk_neighbours(n_chunks, lookback, wrap, expected):
    assert chunk_neighbours(n_chunks, lookback, wrap).tolist() == expected


def chunked_loops(q, k, v, chunk, lookback, positions, causal, self_mask, pad, wrap, scale):
    """Query row t of chunk c = t // chunk sees the rows of chunks c, c-1, ..., c-lookback (modulo the chunk
    count when wrapping, never one chunk twice), except padded keys and, under causal, keys of a later
    position; with self_mask the logit of a key at the query's own position is SELF_LOGIT."""
    T = q.shape[2]
    n_chunks = -(-T // chunk)
    out, lse = torch.zeros(B, H, T, D, dtype=torch.float64), torch.zeros(B, H, T, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            pos = list(range(T)) if positions is None else positions[b, h].tolist()
            for t in range(T):
                c, seen = t // chunk, []
                for step in range(min(lookback, n_chunks - 1) + 1):
                    if wrap or c - step >= 0:
                        seen.append((c - step) % n_chunks)
                keys = [
                    j
                    for j in range(T)
                    if j // chunk in seen
                    and not (pad is not None and pad[b, h, j])
                    and not (causal and pos[j] > pos[t])
                ]
                logits = [
                    SELF_LOGIT
                    if self_mask and pos[j] == pos[t]
                    else float(q[b, h, t].double() @ k[b, h, j].double()) * scale
                    for j in keys
                ]
                out[b, h, t], lse[b, h, t] = softmax_row(logits, [v[b, h, j].double() for j in keys])
    return out, lse


@pytest.mark.parametrize(
    "T, chunk, lookback",
    [(10, 3, 1), (12, 4, 2), (7, 7, 1), (9, 2, 0)],
    ids=["tail-1", "lookback-2", "one-chunk", "no-lookback"],
)
@pytest.mark.parametrize("wrap", [True, False], ids=["wrap", "no-wrap"])
def test_chunked_reference_equals_the_loops(T, chunk, lookback, wrap):
    q, k, v = rand(B, H, T, D, seed=16), rand(B, H, T, D, seed=17), rand(B, H, T, D, seed=18)
    gen = torch.Generator().manual_seed(19)
    positions = torch.stack([torch.randperm(T, generator=gen) for _ in range(B * H)]).view(B, H, T)
    pad = torch.zeros(B, H, T, dtype=torch.bool)
    pad[1, :, -2:] = True
    pad[0, 1, 0] = True
    for causal, self_mask, scale in [(False, False, None), (True, False, 0.7), (True, True, None), (False, True, 0.5)]:
        out, lse = chunked_attention_reference(
            q,
            k,
            v,
            chunk,
            lookback,
            positions=positions,
            causal=causal,
            self_mask=self_mask,
            key_padding_mask=pad,
            scale=scale,
            wrap=wrap,
        )
        ref_out, ref_lse = chunked_loops(
            q, k, v, chunk, lookback, positions, causal, self_mask, pad, wrap, D**-0.5 if scale is None else scale
        )
        torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)
    # Defaults: positions are the row indices, nothing padded, look one chunk back, cyclically.
    out, lse = chunked_attention_reference(q, k, v, chunk, causal=True, self_mask=True)
    ref_out, ref_lse = chunked_loops(q, k, v, chunk, 1, None, True, True, None, True, D**-0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)


def test_chunked_masks_shared_by_heads_broadcast_from_batch_by_seq():
    T = 8
    q, k, v = rand(B, H, T, D, seed=20), rand(B, H, T, D, seed=21), rand(B, H, T, D, seed=22)
    positions = torch.arange(T - 1, -1, -1).expand(B, T).contiguous()
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 3] = True
    out, lse = chunked_attention_reference(q, k, v, 4, positions=positions, key_padding_mask=pad, causal=True)
    ref = chunked_attention_reference(
        q,
        k,
        v,
        4,
        positions=positions[:, None].expand(B, H, T),
        key_padding_mask=pad[:, None].expand(B, H, T),
        causal=True,
    )
    torch.testing.assert_close(out, ref[0], atol=0, rtol=0)
    torch.testing.assert_close(lse, ref[1], atol=0, rtol=0)
    assert per_head(pad, B, H, T, "m").shape == (B, H, T) and per_head(None, B, H, T, "m") is None
    x = torch.zeros(B, H, T)
    assert per_head(x, B, H, T, "m") is x


def test_input_refusals_name_the_problem():
    q = torch.zeros(B, H, 5, D)
    with pytest.raises(
        ValueError,
        match=r"q, k, v must be 4-D \[batch, heads, seq, head_dim\]; got \(2, 5, 4\), "
        r"\(2, 2, 5, 4\), \(2, 2, 5, 4\)",
    ):
        check_attention_inputs(q[0], q, q)
    for bad in [(q, q[0], q), (q, q, q[0])]:
        with pytest.raises(ValueError, match="must be 4-D"):
            check_attention_inputs(*bad)
    with pytest.raises(ValueError, match=r"k and v must have the same shape; got \(2, 2, 5, 4\) and \(2, 2, 6, 4\)"):
        check_attention_inputs(q, q, torch.zeros(B, H, 6, D))
    for k in (torch.zeros(B + 1, H, 5, D), torch.zeros(B, H + 1, 5, D), torch.zeros(B, H, 5, D + 1)):
        with pytest.raises(
            ValueError,
            match=r"q and k must agree on batch, heads and head_dim; got q \(2, 2, 5, 4\)"
            r" and k \(" + ", ".join(map(str, k.shape)) + r"\)",
        ):
            check_attention_inputs(q, k, k)
    check_attention_inputs(q, torch.zeros(B, H, 7, D), torch.zeros(B, H, 7, D))  # other key lengths are fine
    for args in [(q.double(), q, q), (q, q.double(), q.double()), (q, q, q.double())]:
        with pytest.raises(ValueError, match="q, k, v must share a dtype; got torch.float"):
            check_attention_inputs(*args)
    i = q.int()
    with pytest.raises(ValueError, match=r"dtype torch.int32 is not supported; use one of \(torch.float16"):
        check_attention_inputs(i, i, i)
    check_key_padding_mask(None, B, 5)
    check_key_padding_mask(torch.zeros(B, 5, dtype=torch.bool), B, 5)
    for mask in (torch.zeros(B, 5), torch.zeros(B, 4, dtype=torch.bool)):
        with pytest.raises(
            ValueError,
            match=r"key_padding_mask must be bool \[batch, seq_k\] = \[2, 5\] with True "
            rf"= padded key; got {mask.dtype} \({B}, {mask.shape[1]}\)",
        ):
            check_key_padding_mask(mask, B, 5)


def test_chunked_refusals_name_the_problem():
    q = torch.zeros(B, H, 6, D)
    with pytest.raises(ValueError, match="chunk must be >= 1; got 0"):
        check_chunked_inputs(q, q, 0, 1, None, None)
    check_chunked_inputs(q, q, 1, 0, None, None)
    with pytest.raises(ValueError, match="lookback must be >= 0; got -1"):
        check_chunked_inputs(q, q, 2, -1, None, None)
    with pytest.raises(ValueError, match="chunked attention needs q and k of the same length; got 6 and 5"):
        check_chunked_inputs(q, q[:, :, :5], 2, 1, None, None)
    with pytest.raises(ValueError, match="positions must be int32 or int64; got torch.float32"):
        check_chunked_inputs(q, q, 2, 1, torch.zeros(B, 6), None)
    for dtype in (torch.int32, torch.int64):
        pos, pad = check_chunked_inputs(q, q, 2, 1, torch.zeros(B, 6, dtype=dtype), None)
        assert pos.shape == (B, H, 6) and pad is None
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(True = padded\); got torch.int64"):
        check_chunked_inputs(q, q, 2, 1, None, torch.zeros(B, 6, dtype=torch.long))
    with pytest.raises(
        ValueError,
        match=r"positions must be \[batch, seq\] = \[2, 6\] or \[batch, heads, seq\] = "
        r"\[2, 2, 6\]; got \(2, 5\)",
    ):
        check_chunked_inputs(q, q, 2, 1, torch.zeros(B, 5, dtype=torch.long), None)
    for bad in (
        torch.zeros(B, H + 1, 6, dtype=torch.bool),
        torch.zeros(B, 6, 1, dtype=torch.bool),
        torch.zeros(B, H, 6, 1, dtype=torch.bool),
    ):
        with pytest.raises(ValueError, match="key_padding_mask must be"):
            check_chunked_inputs(q, q, 2, 1, None, bad)
