"""Segment-level recurrence for a causal LM (model.memory): ordered segments and the memory they carry.

Transformer-XL (Dai et al., ACL 2019, arXiv 1901.02860) trains on a stream cut into B contiguous rows, read
segment after segment (kimiyoung/transformer-xl `pytorch/data_utils.py` LMOrderedIterator): batch i holds
segment i of every row, so the states cached by one batch are the left context of the next batch's row. Here
a row's segments overlap by one token, like the causal blocks of tasks/lm.py, so every token of a row is a
target once. With w workers the stream is cut into B x w rows and rank r reads rows [rB, (r+1)B).

`SegmentMemory` holds the cached states between steps together with the segment they follow, so a memory is
only ever given to the segment right after it: a row's first segment starts empty, and any other mismatch
(a checkpoint without the memory, batches out of order) is an error rather than a silent change of context.
Its `state` goes into the checkpoint next to the data position, which makes a resume exact.

Evaluation cuts the split into batch_size rows as well, but keeps every token: the rows are contiguous
spans of the targets, the last one padded, so the per-token loss covers exactly the targets the block
evaluation of tasks/lm.py scores, each with all of its row's earlier context up to mem_len states per layer.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn

from tasks.tokenizer import PAD_ID


class StreamRows:
    """[rows, n] contiguous rows of a token stream, read from it on demand (the stream may be a memory map of
    gigabytes: the rows are never copied out whole). Indexing: rows[a:b] (a view of some rows), rows[:, i:j]
    (every row's columns i..j as an int64 array), rows[r, i:j], and np.asarray(rows)."""

    def __init__(self, stream: Any, n_rows: int, n: int, first: int = 0):
        self.stream, self.n_rows, self.n, self.first = stream, n_rows, n, first

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.n

    def __len__(self) -> int:
        return self.n_rows

    def _row(self, row: int, cols: slice) -> np.ndarray:
        start, stop, _ = cols.indices(self.n)
        base = (self.first + row) * self.n
        return np.asarray(self.stream[base + start: base + max(start, stop)], dtype=np.int64)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.n_rows)
            if step != 1:
                raise IndexError("rows of a stream are sliced contiguously")
            return StreamRows(self.stream, max(0, stop - start), self.n, self.first + start)
        rows, cols = key
        if isinstance(rows, slice):
            return np.stack([self._row(r, cols) for r in range(*rows.indices(self.n_rows))])
        return self._row(int(rows), cols)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[:, :]
        return out if dtype is None else out.astype(dtype)


def ordered_rows(stream: Any, rows: int) -> StreamRows:
    """The stream as [rows, n] contiguous rows; the last len(stream) % rows tokens are dropped (as the
    reference's LMOrderedIterator)."""
    n = len(stream) // rows
    if n < 2:
        raise ValueError(f"a stream of {len(stream)} tokens cannot fill {rows} rows of 2 tokens; lower "
                         "task.batch_size (or the number of workers)")
    return StreamRows(stream, rows, n)


def covering_rows(stream: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """[rows, span + 1] rows whose targets (tokens 1..) partition the stream's targets, padded with PAD_ID,
    and each row's length; no token is dropped."""
    n_targets = len(stream) - 1
    span = max(1, math.ceil(n_targets / rows))
    out = np.full((rows, span + 1), PAD_ID, dtype=np.int64)
    lengths = np.zeros(rows, dtype=np.int64)
    for row in range(rows):
        piece = stream[row * span: min((row + 1) * span, n_targets) + 1]
        if len(piece) > 1:
            out[row, : len(piece)] = piece
            lengths[row] = len(piece)
    return out, lengths


def num_segments(row_len: int, seq_len: int) -> int:
    """Segments of seq_len targets (seq_len + 1 tokens, overlapping by one) that cover a row."""
    return max(0, math.ceil((row_len - 1) / seq_len))


def segment(rows_BN: np.ndarray | StreamRows, lengths_B: np.ndarray, index: int,
            seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment `index` of every row as [B, seq_len + 1] (padded with PAD_ID) and each row's length in it."""
    start = index * seq_len
    piece_BL = rows_BN[:, start: start + seq_len + 1]
    out = np.full((len(rows_BN), seq_len + 1), PAD_ID, dtype=np.int64)
    out[:, : piece_BL.shape[1]] = piece_BL
    return out, np.clip(lengths_B - start, 0, seq_len + 1)


def ordered_positions(n_segments: int, position: dict[str, Any] | None) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(epoch, segment index, position after it), endlessly, from `position` {"epoch", "step"} on."""
    epoch = int(position["epoch"]) if position else 0
    step = int(position["step"]) if position else 0
    while True:
        for i in range(step, n_segments):
            yield epoch, i, {"epoch": epoch, "step": i + 1}
        epoch, step = epoch + 1, 0


class SegmentMemory:
    """The cached states of the training rows between steps, and which segment they follow."""

    def __init__(self) -> None:
        self.after: tuple[int, int] | None = None
        """(epoch, segment index) of the segment that produced `states`."""
        self.states: list[torch.Tensor] | None = None

    def for_segment(self, model: nn.Module, epoch: int, index: int, batch_size: int,
                    device: torch.device) -> list[torch.Tensor]:
        """The memory segment (epoch, index) reads: empty for a row's first segment, else the states the
        segment before it left."""
        if index == 0:
            return getattr(model, "module", model).empty_memory(batch_size, device)
        if self.after != (epoch, index - 1) or self.states is None:
            raise RuntimeError(
                f"segment {index} of epoch {epoch} needs the memory of segment {index - 1}, but the memory "
                f"held follows {self.after}; the checkpoint did not hold it or batches came out of order"
            )
        return [states.to(device) for states in self.states]

    def keep(self, epoch: int, index: int, states: list[torch.Tensor]) -> None:
        self.after, self.states = (epoch, index), [s.detach() for s in states]

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint stores (on the CPU), or None before the first step."""
        if self.states is None:
            return None
        return {"after": list(self.after), "states": [s.cpu() for s in self.states]}

    def load(self, state: dict[str, Any] | None) -> None:
        if state is None:
            self.after, self.states = None, None
        else:
            self.after, self.states = tuple(state["after"]), list(state["states"])
