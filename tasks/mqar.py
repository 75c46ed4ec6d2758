"""Multi-query associative recall (MQAR) examples, generated as Zoology generates them.

Zoology (Arora, Eyuboglu, Timalsina, Johnson, Poli, Zou, Rudra, Ré, 2023, "Zoology: Measuring and Improving
Recall in Efficient Language Models", arXiv 2312.04927): an example opens with num_kv_pairs key-value pairs
`k1 v1 k2 v2 ...`; later each key appears once more, at a power-law distributed distance, and the model must
answer it with its value. Gated convolutions and other sub-quadratic mixers lose exactly this ability; attention
solves it with an induction head, so it is a sharp probe of what approximate attention keeps.

Followed from HazyResearch/zoology, zoology/data/multiquery_ar.py (commit d88d6f5), `multiquery_ar` with
num_passes = 1:
- lines 88-90: input_seq_len even, vocab_size > input_seq_len (with fewer ids the random fillers repeat every
  key, each time followed by a wrong value; Zoology asserts it whatever the fillers, MQARTaskConfig only with
  random_non_queries, the one case with that reason) and 4 x num_kv_pairs <= input_seq_len (MQARTaskConfig);
- lines 98-106: keys drawn without repetition from [1, vocab/2), values from [vocab/2, vocab), per example;
- lines 109-111: the context `k1 v1 k2 v2 ...` at positions 0 .. 2P-1;
- lines 115-120: the query region holds (seq_len - 2P) // 2 slots of two tokens; the slots of the P queries
  are drawn without repetition with probability proportional to power_a * g^(power_a - 1), g = 1, 2, ...;
- lines 123-133: query i's key at position 2P + 2 * slot_i, and (after Zoology's shift of the labels by one)
  its value is the target of that same position: the next token after the key. Every other target is ignored;
- lines 136-137: with random_non_queries, every 0 of the inputs becomes a random token of the whole vocabulary.

Zoology's random draws come from numpy's legacy global state; here one `np.random.default_rng` per split, seeded
from the task's seed and the split.
"""

from __future__ import annotations

import numpy as np

IGNORE = -100
"""Target of positions without an answer (F.cross_entropy's ignore_index; tasks/lm.py uses the same)."""


def query_slot_probabilities(seq_len: int, num_kv_pairs: int, power_a: float) -> np.ndarray:
    """P(slot g) for the (seq_len - 2P) // 2 query slots: power_a * g^(power_a - 1), normalised."""
    space = (seq_len - 2 * num_kv_pairs) // 2
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def generate(seed: int | list[int], n: int, seq_len: int, num_kv_pairs: int, vocab_size: int, power_a: float,
             random_non_queries: bool) -> dict[str, np.ndarray]:
    """{"inputs" [n, seq_len], "positions" [n, P], "answers" [n, P]}: the token ids, and where each example's
    queries sit with the value each must be answered with (`targets` makes the full target array)."""
    rng = np.random.default_rng(seed)
    P, half = num_kv_pairs, vocab_size // 2
    context = 2 * P
    p = query_slot_probabilities(seq_len, P, power_a)
    inputs = np.zeros((n, seq_len), dtype=np.int32)
    positions = np.zeros((n, P), dtype=np.int32)
    answers = np.zeros((n, P), dtype=np.int32)
    for i in range(n):
        keys = rng.choice(half - 1, size=P, replace=False) + 1
        values = rng.choice(vocab_size - half, size=P, replace=False) + half
        slots = rng.choice(len(p), size=P, replace=False, p=p)
        inputs[i, 0:context:2], inputs[i, 1:context:2] = keys, values
        positions[i] = context + 2 * slots
        inputs[i, positions[i]] = keys
        answers[i] = values
    if random_non_queries:
        empty = inputs == 0
        inputs[empty] = rng.integers(vocab_size, size=int(empty.sum()))
    return {"inputs": inputs, "positions": positions, "answers": answers}


def targets(positions: np.ndarray, answers: np.ndarray, seq_len: int) -> np.ndarray:
    """[n, seq_len] targets: the answer at each query position, IGNORE elsewhere."""
    out = np.full((len(positions), seq_len), IGNORE, dtype=np.int64)
    np.put_along_axis(out, positions.astype(np.int64), answers.astype(np.int64), axis=1)
    return out
