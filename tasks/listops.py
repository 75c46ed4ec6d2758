"""ListOps expressions generated as the Long Range Arena generates them, tokenised for a classifier.

ListOps (Nangia & Bowman, 2018, "ListOps: A Diagnostic Dataset for Latent Tree Learning", arXiv 1804.06028):
prefix expressions over the digits 0-9 with the list operators MAX, MIN, MED (median) and SM (sum modulo 10),
nested; the label is the expression's value, so the task is 10-way classification. The Long Range Arena (Tay et
al., 2020, arXiv 2011.04006) made it a long-sequence task: lengths between 500 and 2,000 tokens, depth up to 10,
up to 10 arguments per operator.

Followed from google-research/long-range-arena, lra_benchmarks/data/listops.py (commit cd31e5c):
- lines 54-65: the operators [MIN [MAX [MED [SM and the closing `]` (FIRST and LAST are commented out there),
  the values 0-9 and VALUE_P = 0.25;
- lines 68-101, `generate_tree`: below max_depth a node is a value with probability 1 - VALUE_P (r > VALUE_P),
  else an operator with randint(2, max_args) arguments generated one depth deeper, the operator drawn after its
  arguments; at max_depth always a value. The length counts 1 per value and 2 per operator (it and its `]`);
  here the same random calls are made in the same order with a seeded `random.Random`;
- lines 138-141, `to_value`: MED is int(np.median(args)), i.e. the mean of the two middle values rounded down
  for an even count; SM is sum(args) % 10;
- lines 163-182, `main`: expressions are drawn until enough distinct ones exist, kept when
  min_length < length < max_length (strictly), and the list is cut into train, validation, test in that order.

Deliberate differences: LRA collects the expressions in a Python `set`, whose order depends on the process's
string hashing, so its splits are not reproducible; here the distinct expressions keep their drawing order. LRA
tokenises the string with tfds' default tokenizer, which drops `(`, `)` and `]`; here the parentheses (which
the length never counted) are dropped and `]` is kept, because without it an expression does not determine its
own tree. A CLS token leads every example (LRA's pooling_mode "CLS").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

VALUE_P = 0.25
"""Probability that a node above max_depth is an operator (LRA: r > VALUE_P makes a value)."""
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
PAD, CLS = 0, 1
"""Token ids of padding and the leading classification token."""
DIGIT_BASE = 2
"""Digit d is token DIGIT_BASE + d."""
OP_BASE = DIGIT_BASE + 10
"""Operator i of OPERATORS is token OP_BASE + i."""
END_ID = OP_BASE + len(OPERATORS)
VOCAB_SIZE = END_ID + 1
NUM_CLASSES = 10

Tree = int | tuple[str, list["Tree"]]


def generate_tree(rng: random.Random, depth: int, max_depth: int, max_args: int) -> tuple[Tree, int]:
    """(tree, length in tokens): LRA's generate_tree with its random calls in its order."""
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        return rng.choice(range(10)), 1
    length = 2
    args = []
    for _ in range(rng.randint(2, max_args)):
        sub, sub_length = generate_tree(rng, depth + 1, max_depth, max_args)
        args.append(sub)
        length += sub_length
    return (rng.choice(OPERATORS), args), length


def apply_operator(op: str, args: list[int]) -> int:
    """The value of one operator over its evaluated arguments (LRA's to_value)."""
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        ordered = sorted(args)
        middle = len(ordered) // 2
        # np.median averages the two middle values of an even count, and int() rounds down (all are >= 0)
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) // 2
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def tree_value(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    op, args = tree
    return apply_operator(op, [tree_value(a) for a in args])


def tree_tokens(tree: Tree) -> list[int]:
    """Token ids of the prefix form, e.g. `[MAX 2 9 ]`, without the CLS; len() equals the generator's length."""
    out: list[int] = []
    stack: list[Tree | str] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, int):
            out.append(DIGIT_BASE + node)
        elif isinstance(node, str):
            out.append(END_ID)
        else:
            op, args = node
            out.append(OP_BASE + OPERATORS.index(op))
            stack.append(END)
            stack.extend(reversed(args))
    return out


def render(tokens: np.ndarray) -> str:
    """The expression as text (`[MAX 2 9 ]`), CLS and padding left out; for reading examples and for tests."""
    names = {DIGIT_BASE + d: str(d) for d in range(10)}
    names.update({OP_BASE + i: op for i, op in enumerate(OPERATORS)})
    names[END_ID] = END
    return " ".join(names[int(t)] for t in tokens if t not in (PAD, CLS))


@dataclass(frozen=True)
class ListOpsSettings:
    """What the generated examples depend on (the task block's generator fields)."""

    seed: int
    sizes: tuple[int, int, int]
    """Examples in train, validation, test."""
    min_len: int
    max_len: int
    """Expressions have min_len < length < max_len tokens (LRA's strict bounds), CLS not counted."""
    max_depth: int
    max_args: int


def generate_splits(settings: ListOpsSettings) -> dict[str, dict[str, np.ndarray]]:
    """{split: {"flat", "offsets", "labels"}}: CLS + expression tokens of every example, concatenated, with
    offsets, and the values. Distinct expressions across all splits, in drawing order (LRA's main)."""
    rng = random.Random(settings.seed)
    wanted = sum(settings.sizes)
    seen: dict[tuple[int, ...], int] = {}  # tokens -> value, in insertion order
    while len(seen) < wanted:
        tree, length = generate_tree(rng, 1, settings.max_depth, settings.max_args)
        if settings.min_len < length < settings.max_len:
            tokens = tuple(tree_tokens(tree))
            if tokens not in seen:
                seen[tokens] = tree_value(tree)
    items = list(seen.items())
    out, start = {}, 0
    for split, n in zip(("train", "validation", "test"), settings.sizes):
        part = items[start:start + n]
        start += n
        lengths = np.array([len(tokens) + 1 for tokens, _ in part], dtype=np.int64)
        flat = np.fromiter((t for tokens, _ in part for t in (CLS, *tokens)), dtype=np.int16, count=int(lengths.sum()))
        out[split] = {"flat": flat, "offsets": np.concatenate([[0], np.cumsum(lengths)]),
                      "labels": np.array([value for _, value in part], dtype=np.int64)}
    return out
