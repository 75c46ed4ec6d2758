"""Constants a mechanism makes on the host (fixed rotations, an evaluation draw), copied to each device once.

A copy from the host's pageable memory to a GPU makes the host wait until the device has run everything queued
before it (PyTorch synchronises the stream after a blocking copy), and a CUDA graph cannot capture it. Made and
copied at every call, such a constant drains the GPU's queue once per layer in every evaluation and in every cached
decoding step. Kept here instead: one copy per device (and dtype), reused while it is large enough.

Not state: never saved (a plain attribute, not a buffer), rebuilt from the seeds on demand. A copy made on fake
tensors (the planner's memory count, torch.compile's tracing) is never kept, so no later real call gets one.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch
from torch._subclasses.fake_tensor import is_fake


class DeviceCopies:
    """Host-made tensors by (device, dtype, key), each copied to its device once."""

    def __init__(self) -> None:
        self._copies: dict[tuple[torch.device, torch.dtype, Hashable], torch.Tensor] = {}

    def get(self, device: torch.device, dtype: torch.dtype, key: Hashable,
            make: Callable[[torch.Tensor | None], torch.Tensor],
            large_enough: Callable[[torch.Tensor], bool] = lambda _copy: True) -> torch.Tensor:
        """The kept copy of `key` on `device` in `dtype` if `large_enough` accepts it, else `make(kept)` (a host
        tensor, or one already on the device; `kept` the copy it replaces, or None, so that a growing constant can
        size itself from it) copied there and kept in its place."""
        slot = (torch.device(device), dtype, key)
        kept = self._copies.get(slot)
        if kept is not None and large_enough(kept):
            return kept
        # Made outside inference mode, so that evaluation under torch.inference_mode() does not keep a tensor a
        # later call with autograd on could not save for its backward.
        with torch.inference_mode(False):
            copy = make(kept).to(device=device, dtype=dtype)
        if not is_fake(copy):
            self._copies[slot] = copy
        return copy

    def __len__(self) -> int:
        return len(self._copies)
