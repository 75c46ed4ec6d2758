"""Rows scaled to unit length on the Triton kernels of k_unit_rows.py: `unit_rows_kernel(x, eps)` is
`F.normalize(x, dim=-1, eps=eps)` for x [B, H, T, E] (LSH's shared-QK keys), differentiable, one launch forward and
one backward. Inside `kernels.dispatch.stand_in_kernels()` the launches are counted and the buffers allocated as on
a GPU (kernels/stand_in.py).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from kernels import stand_in
from kernels.flash_attention import cdiv, interpreter_enabled, jit_module, next_power_of_two
from kernels.merge_rounds import _slice_strides


def _launch(name: str, kernel_name: str, rows: int, args: tuple, n_feat: int) -> None:
    from kernels import k_unit_rows

    kern = jit_module(k_unit_rows)
    cfg = kern.launch_config(interpreter_enabled())
    stand_in.launch(name, lambda: getattr(kern, kernel_name)[(cdiv(rows, cfg["BLOCK_M"]),)](
        *args, BLOCK_E=max(16, next_power_of_two(n_feat)), **cfg))


def _row_strides(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """x [B, H, T, E] with its features contiguous (else a contiguous copy), and its (b, h, t) strides: the merge's
    `_slice_strides` without its inner count."""
    x, (_inner, *bht_strides) = _slice_strides(x)
    return x, tuple(bht_strides)


class _UnitRowsKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        x, x_strides = _row_strides(x)
        B, H, T, E = x.shape
        log = stand_in.active()
        with stand_in.kernel_region(log):
            y = torch.empty_like(x)  # x's layout: a token-major projection's keys stay token-major
            d = torch.empty(B, H, T, device=x.device, dtype=torch.float32)
            _, y_strides = _row_strides(y)
            _launch("unit_rows_fwd", "_unit_rows_fwd", B * H * T, (x, y, d, *x_strides, *y_strides, B * H * T, H, T,
                                                                   E, eps), E)
        ctx.save_for_backward(y, d)
        ctx.eps = eps
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        y, d = ctx.saved_tensors
        g, g_strides = _row_strides(g)
        B, H, T, E = y.shape
        log = stand_in.active()
        with stand_in.kernel_region(log):
            dx = torch.empty_like(y)
            _launch("unit_rows_bwd", "_unit_rows_bwd", B * H * T,
                    (g, y, d, dx, *g_strides, *_row_strides(y)[1], *_row_strides(dx)[1], B * H * T, H, T, E, ctx.eps),
                    E)
        return dx, None


def unit_rows_kernel(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """x [B, H, T, E] / max(|x|, eps) along the last dim, as `F.normalize(x, dim=-1, eps=eps)` rounds in x's dtype
    (k_unit_rows.py), with its backward on the kernel too."""
    if x.dim() != 4:
        raise ValueError(f"unit_rows_kernel takes x [B, H, T, E]; got {tuple(x.shape)}")
    return _UnitRowsKernel.apply(x, eps)
