"""How close a kernel's result must be to its PyTorch reference (kernels/reference.py): the one bound that
tests/test_kernels.py asserts on the CPU (interpreter) or a GPU and benchmarks/gpu/parity.py records on a GPU."""

from __future__ import annotations

import math

import torch

# Max abs error relative to max(1, max |reference|), per input dtype. fp16/bf16 kernels round P and dS to the
# input dtype before the matrix products (as FlashAttention does), the references keep them in fp32.
PARITY_TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def parity_error(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> tuple[float, float, str | None]:
    """(max abs error over the reference's finite entries, the bound PARITY_TOLERANCE[dtype] gives it, and what
    else differs or None). Infinite entries (lse = -inf of a row whose keys are all masked) must match exactly."""
    actual, expected = actual.double(), expected.double()
    finite = torch.isfinite(expected)
    largest = expected[finite].abs().max().item() if finite.any() else 0.0
    bound = PARITY_TOLERANCE[dtype] * max(1.0, largest)
    if not torch.equal(finite, torch.isfinite(actual)):
        return math.inf, bound, "non-finite entries differ"
    if not torch.equal(actual[~finite], expected[~finite]):
        return math.inf, bound, "infinite entries differ"
    err = (actual[finite] - expected[finite]).abs().max().item() if finite.any() else 0.0
    return err, bound, None
