"""Exact attention with the Triton FlashAttention-2 kernels (Dao, 2023, arXiv 2307.08691) as an
autograd.Function: launch grids, dtype and layout checks, and the lse-aware backward.

The kernels (kernels/k_flash_attention.py) are imported on first use, so importing this module needs
neither triton nor CUDA, and TRITON_INTERPRET=1 may be set any time before the first call.
"""

from __future__ import annotations

import math
import os
from types import ModuleType

import torch

from kernels.reference import check_attention_inputs, check_key_padding_mask

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM = 16  # tl.dot needs tiles of at least 16 along every dimension
MAX_HEAD_DIM = 128  # register budget of the q, k, v, accumulator tiles at the chosen block sizes


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_options(dtype: torch.dtype) -> dict[str, str | bool]:
    """Constexprs of the kernels' matrix products. fp32 inputs get full-precision dots so they match the fp32
    reference (TF32 keeps 10 mantissa bits); bf16 under the interpreter is multiplied in fp32 (see _dot)."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_UPCAST": interpreter_enabled() and dtype == torch.bfloat16,
    }


def check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_attention_inputs(q, k, v)
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"the Triton kernels take {TRITON_DTYPES}; got {q.dtype}")
    if not MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take head_dim {MIN_HEAD_DIM}..{MAX_HEAD_DIM}; got {q.shape[-1]}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def _kernels() -> ModuleType:
    from kernels import k_flash_attention

    return k_flash_attention


def strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


def backward_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """delta_i = sum_d dO_id O_id - dlse_i, fp32 [B, H, M]: FA2's Delta with the lse gradient folded in, so
    that dS = P * (dP - delta) (docs/kernels.md)."""
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    return delta.contiguous()


def _mask_args(mask_BN: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The padding mask as uint8 (Triton has no bool pointer loads we rely on) plus its strides; a dummy
    pointer when there is no mask (the kernel then never reads it)."""
    if mask_BN is None:
        return like, 0, 0
    mask_u8 = mask_BN.to(torch.uint8)
    return mask_u8, mask_u8.stride(0), mask_u8.stride(1)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask_BN: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    kern = _kernels()
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    block_d = next_power_of_two(head_dim)
    cfg = kern.launch_config(block_d, q.element_size(), interpreter_enabled(), backward=False)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads, seq_q, device=q.device, dtype=torch.float32)
    kpm, stride_kpm_b, stride_kpm_n = _mask_args(mask_BN, q)
    grid = (cdiv(seq_q, cfg["BLOCK_M"]), batch * heads)
    kern._flash_fwd[grid](
        q, k, v, out, lse, kpm,
        *strides(q), *strides(k), *strides(v), *strides(out),
        stride_kpm_b, stride_kpm_n,
        heads, seq_q, seq_k, head_dim, scale * kern.LOG2E.value,
        CAUSAL=causal, HAS_KPM=mask_BN is not None, **dot_options(q.dtype),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out, lse


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    mask_BN: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kern = _kernels()
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    block_d = next_power_of_two(head_dim)
    cfg = kern.launch_config(block_d, q.element_size(), interpreter_enabled(), backward=True)
    delta = backward_delta(out, dout, dlse)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    kpm, stride_kpm_b, stride_kpm_n = _mask_args(mask_BN, q)
    common = dict(
        CAUSAL=causal, HAS_KPM=mask_BN is not None, **dot_options(q.dtype),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    qkv_strides = (*strides(q), *strides(k), *strides(v), *strides(dout))
    sizes = (heads, seq_q, seq_k, head_dim, scale * kern.LOG2E.value, scale)
    kern._flash_bwd_dkdv[(cdiv(seq_k, cfg["BLOCK_N"]), batch * heads)](
        q, k, v, dout, lse, delta, dk, dv, kpm, *qkv_strides, *strides(dk), stride_kpm_b, stride_kpm_n,
        *sizes, **common,
    )  # fmt: skip
    kern._flash_bwd_dq[(cdiv(seq_q, cfg["BLOCK_M"]), batch * heads)](
        q, k, v, dout, lse, delta, dq, kpm, *qkv_strides, *strides(dq), stride_kpm_b, stride_kpm_n,
        *sizes, **common,
    )  # fmt: skip
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """(q, k, v) -> (out, lse), differentiable in both outputs."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        mask_BN: torch.Tensor | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _forward(q, k, v, causal, mask_BN, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask_BN = mask_BN
        ctx.causal = causal
        ctx.scale = scale
        # Unused outputs arrive as None rather than as materialised zeros: no work for a dropped lse.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor | None, dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.causal, ctx.mask_BN, ctx.scale)
        return dq, dk, dv, None, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention on the Triton kernels. q [B, H, M, D], k and v [B, H, N, D] -> out [B, H, M, D]
    (q's dtype) and lse [B, H, M] (fp32, natural log of the scaled logits' sum of exponentials).

    Any M and N; ``causal`` is aligned top-left (query i sees keys j <= i); ``key_padding_mask`` [B, N] bool,
    True = padded key. A query row without any visible key gives zeros and lse = -inf. D in 16..128, fp16,
    bf16 or fp32; tensors on CUDA, or on the CPU under TRITON_INTERPRET=1.
    """
    check_triton_inputs(q, k, v)
    check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return FlashAttentionFunction.apply(q, k, v, causal, key_padding_mask, scale)
