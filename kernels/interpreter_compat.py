"""Triton interpreter (TRITON_INTERPRET=1) of triton 3.6 under NumPy 2: loops over tensor bounds.

The kernels loop over key and query blocks with `for start_n in range(lo, hi, BLOCK_N)`, where `lo` and `hi`
are scalars computed in the kernel (`_key_split`: `tl.minimum(n_k, start_m + BLOCK_M)`). Compiled, `range` is
the JIT's loop. Interpreted, it is Python's, which calls the bound's `__index__`; the interpreter holds every
scalar as a one-element 1-D array (`np.array([value])`), and triton 3.6 defines `tensor.__index__` as
`int(self.handle.data)`. NumPy (2.4.6 here; a DeprecationWarning since 1.25) refuses to convert an array of
ndim > 0 to a Python scalar, so every interpreted kernel of this package raised
`InterpreterError: TypeError('only 0-dimensional arrays can be converted to Python scalars')` at its first loop
(seen on the first H100 machine's dry run: torch 2.11, triton 3.6.0). Later triton writes
`int(self.handle.data.squeeze())` (3.8 and 3.9 do).

`repair_index()` gives triton 3.6's interpreter the later definition: it wraps the interpreter's
`_patch_lang_tensor` (which installs `__index__` on `tl.tensor` for the duration of each interpreted launch) so
that `__index__` reads the one element with `.item()`. It touches only an interpreter whose `__index__` is the
broken one (its source says `int(self.handle.data)`), changes nothing compiled, and is called before each
interpreted launch (kernels/flash_attention.py and chunked_attention.py `_kernels`), not at import.
"""

from __future__ import annotations

import functools
import inspect
import operator

BROKEN_INDEX = "int(self.handle.data))"
"""triton 3.6's `__index__` in interpreter.py, as its source spells it (3.8+: `int(self.handle.data.squeeze()))`)."""


def scalar_index(tensor) -> int:
    """`__index__` of an interpreted scalar: its one element, whatever the array's shape."""
    return operator.index(tensor.handle.data.item())


def needs_repair(source: str) -> bool:
    """The interpreter's `_patch_lang_tensor` source defines the `__index__` that NumPy 2 breaks."""
    return BROKEN_INDEX in source


def repair_index() -> bool:
    """Install `scalar_index` as the interpreter's `__index__` where it is the broken one; True if it did (now or
    at an earlier call)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "index_repaired", False):
        return True
    if not _broken(patch):
        return False

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", scalar_index)

    patch_lang_tensor.index_repaired = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


@functools.cache
def _broken(patch) -> bool:
    """`needs_repair` of the interpreter's `_patch_lang_tensor`, read once per function (every interpreted launch
    asks)."""
    try:
        source = inspect.getsource(patch)
    except (OSError, TypeError):  # no source to read: leave triton as it is
        return False
    return needs_repair(source)
