"""A value that a `with` block sets for the attention calls made inside it, read at each call.

A plain attribute of a module-level object, not a ContextVar: torch.compile reads an object's attribute under a
guard (a change recompiles), but breaks the graph at `ContextVar.get`, which at every flash call of a compiled
HyperAttention layer was five breaks (tests/test_compile_families.py). The price is that a block's value is the
process's, not the thread's: one model runs on one thread, and a Function that needs the value in its backward
(which autograd may run on another thread, after the block has ended) reads it in its forward and keeps it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class BlockSetting(Generic[T]):
    """`value` is `default` outside every `set_to` block, and the innermost block's value inside."""

    def __init__(self, default: T):
        self.value = default

    @contextmanager
    def set_to(self, value: T) -> Iterator[None]:
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous
