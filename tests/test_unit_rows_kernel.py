"""LSH's shared-QK keys, rows scaled to unit length, on their Triton kernels (kernels/k_unit_rows.py, under the
interpreter at small shapes): the forward rounds as `F.normalize` in the input's dtype, the backward is the
projection onto each row's tangent (g / eps where the norm was clamped), in any layout of rows.

``KERNEL_TESTS_DEVICE=cuda`` runs them on the kernels compiled for a GPU, as tests/test_kernels.py does.
"""

from __future__ import annotations

# First: on the CPU it sets TRITON_INTERPRET=1 before the @triton.jit modules are imported.
from tests.kernel_device import DEVICE, needs_triton, one_gpu_launch_config  # noqa: F401 (an autouse fixture)

import pytest
import torch
import torch.nn.functional as F

from kernels.unit_rows import unit_rows_kernel
from models.attention.projections import _UnitRows

pytestmark = needs_triton


def token_major(B: int, H: int, T: int, E: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[B, H, T, E] as a layer's projection splits its heads: a view of [B, T, H * E]."""
    return torch.randn(B, T, H * E, generator=gen).to(dtype).view(B, T, H, E).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_forward_is_f_normalize_in_the_inputs_dtype(dtype: torch.dtype) -> None:
    """Two batch rows, three heads, 37 tokens (rows across the interpreter's tiles of 16), head dim 24 (a padded
    tile of 32), token-major: the values of `F.normalize` (in bf16 bitwise: its norm is rounded to bf16 before the
    division, which a float32 norm would not reproduce), the layout kept."""
    x = token_major(2, 3, 37, 24, dtype, torch.Generator().manual_seed(1)) * 3
    y = unit_rows_kernel(x.to(DEVICE))
    want = F.normalize(x, dim=-1)
    assert y.dtype == dtype and y.stride() == x.stride()
    if dtype == torch.bfloat16:
        assert torch.equal(y.cpu(), want)
    else:
        torch.testing.assert_close(y.cpu(), want, rtol=3e-7, atol=0)


def test_the_backward_is_the_tangent_projection() -> None:
    """fp32 against float64 autograd through `F.normalize`, for a gradient in another layout than the rows (a
    contiguous [B, H, T, E]), and for rows of norm below eps, which are clamped: y = x / eps, dx = g / eps."""
    gen = torch.Generator().manual_seed(2)
    x = token_major(2, 3, 21, 16, torch.float32, gen)
    x[0, 1, 4] = 0.0  # a zero row
    x[1, 2, 7] = 1e-14  # a row whose norm is clamped
    g = torch.randn(2, 3, 21, 16, generator=gen)
    leaf = x.detach().to(DEVICE).requires_grad_()  # token-major, as x
    y = unit_rows_kernel(leaf, eps=1e-12)
    y.backward(g.to(DEVICE))
    ref = x.double().requires_grad_()
    F.normalize(ref, dim=-1, eps=1e-12).backward(g.double())
    torch.testing.assert_close(y.detach().cpu().double(), F.normalize(x.double(), dim=-1, eps=1e-12), rtol=1e-6,
                               atol=1e-7)
    torch.testing.assert_close(leaf.grad.cpu().double(), ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad[1, 2, 7].cpu(), g[1, 2, 7] / 1e-12, rtol=1e-6, atol=0)


def test_in_bf16_the_backward_matches_the_pytorch_backward() -> None:
    """bf16: the kernel's backward (fp32 inside, rounded once) against the PyTorch path's (`_UnitRows`, which rounds
    each op to bf16) and both against float64: the kernel is at least as close."""
    gen = torch.Generator().manual_seed(3)
    x = token_major(1, 2, 40, 32, torch.bfloat16, gen)
    g = torch.randn(1, 2, 40, 32, generator=gen).to(torch.bfloat16)
    leaf = x.detach().to(DEVICE).requires_grad_()
    unit_rows_kernel(leaf).backward(g.to(DEVICE))
    eager = x.clone().requires_grad_()
    _UnitRows.apply(eager, 1e-12).backward(g)
    exact = x.double().requires_grad_()
    F.normalize(exact, dim=-1).backward(g.double())
    error = lambda grad: (grad.double() - exact.grad).norm() / exact.grad.norm()  # noqa: E731
    assert error(leaf.grad.cpu()) <= error(eager.grad) + 1e-4 and error(leaf.grad.cpu()) < 5e-3
