"""Exact attention with the Triton FlashAttention-2 kernels (Dao, 2023, arXiv 2307.08691) as an
autograd.Function: launch grids, dtype and layout checks, the lse-aware backward, and the choice of
launch configuration (autotuned on CUDA, fixed under the interpreter or inside fixed_launch_config;
tuned_launch_configs says which one a shape got).

The kernels (kernels/k_flash_attention.py) are imported on first use, so importing this module needs
neither triton nor CUDA, and TRITON_INTERPRET=1 may be set any time before the first call.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from kernels import stand_in
from kernels.block_setting import BlockSetting
from kernels.interpreter_compat import repair_index
from kernels.reference import check_attention_inputs, check_key_padding_mask

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM = 16  # tl.dot needs tiles of at least 16 along every dimension
MAX_HEAD_DIM = 128  # register budget of the q, k, v, accumulator tiles at the chosen block sizes
LOG2E = math.log2(math.e)  # the kernels' logits are in base 2 (exp2 is one instruction)


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


def jit_module(module: ModuleType) -> ModuleType:
    """`module`, one of the package's modules of @triton.jit kernels, ready to launch: under the interpreter,
    triton 3.6's is repaired first for NumPy 2 (kernels/interpreter_compat.py). Each wrapper imports its module
    at its first launch (`import kernels` needs no triton) with a plain import statement, which torch.compile
    traces."""
    if interpreter_enabled():
        repair_index()
    return module


def _kernels() -> ModuleType:
    from kernels import k_flash_attention

    return jit_module(k_flash_attention)


def strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


class LayoutKernelFunction(torch.autograd.Function):
    """(q, k, v) -> (out, lse) of a kernel pair described by `lay`, differentiable in both outputs:
    `lay.forward(q, k, v)` launches the forward, `lay.backward(q, k, v, out, lse, dout, dlse)` the backward
    (kernels/chunked_attention.py and hyper_blocks.py, whose layouts carry the indices and constexprs). Inside
    `kernels.stand_in.kernel_region`, so that a counter tells the kernels' own buffers from the glue."""

    @staticmethod
    def forward(ctx, q, k, v, lay):  # type: ignore[override]
        ctx.kernel_log = stand_in.active()
        with stand_in.kernel_region(ctx.kernel_log):
            out, lse = lay.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.lay = lay
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        with stand_in.kernel_region(ctx.kernel_log):
            dq, dk, dv = ctx.lay.backward(q, k, v, out, lse, dout, dlse)
        return dq, dk, dv, None


# Rows per program of the delta pre-processing kernel: a memory-bound row reduction, so large blocks.
DELTA_BLOCK_M = 128


def backward_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """delta_i = sum_d dO_id O_id - dlse_i, fp32 [B, H, M]: FA2's Delta with the lse gradient folded in, so
    that dS = P * (dP - delta) (docs/kernels.md). One Triton pass over O and dO (k_flash_attention._bwd_delta)."""
    batch, heads, seq_q, head_dim = out.shape
    delta = torch.empty(batch, heads, seq_q, device=out.device, dtype=torch.float32)
    # A real pointer is needed even without dlse; the kernel never reads it then.
    dlse_c = delta if dlse is None else dlse.float().contiguous()
    block_m = 16 if interpreter_enabled() else DELTA_BLOCK_M
    stand_in.launch("bwd_delta", lambda: _kernels()._bwd_delta[(cdiv(seq_q, block_m), batch * heads)](
        out, dout, dlse_c, delta, *strides(out), *strides(dout), heads, seq_q, head_dim,
        HAS_DLSE=dlse is not None, BLOCK_M=block_m, BLOCK_D=next_power_of_two(head_dim),
    ))  # fmt: skip
    return delta


def _mask_args(mask_BN: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The padding mask as uint8 (Triton has no bool pointer loads we rely on) plus its strides; a dummy
    pointer when there is no mask (the kernel then never reads it)."""
    if mask_BN is None:
        return like, 0, 0
    mask_u8 = mask_BN.to(torch.uint8)
    return mask_u8, mask_u8.stride(0), mask_u8.stride(1)


# ---- launch configuration: fixed (interpreter, or forced), else autotuned ------------------------------

KERNEL_NAMES = ("fwd", "bwd_dkdv", "bwd_dq")
_FIXED_CONFIG: BlockSetting[dict[str, int] | None] = BlockSetting(None)
"""The enclosing `fixed_launch_config` block's configuration; each call reads it once in its forward and keeps it
for its backward (`ctx.cfg`)."""


@contextmanager
def fixed_launch_config(block_m: int, block_n: int, num_warps: int = 4, num_stages: int = 2) -> Iterator[None]:
    """Run the flash_attention calls made inside the block, and their backward, with one configuration for
    all three kernels instead of autotuning (CUDA) or the interpreter's 16 x 16 blocks. For tests of block
    shapes (BLOCK_M != BLOCK_N moves the causal band's boundaries) and for timing one configuration.
    Under the interpreter num_warps and num_stages do nothing.

        with fixed_launch_config(32, 16):
            out, lse = flash_attention(q, k, v, causal=True)
    """
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile); got {block}")
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}
    with _FIXED_CONFIG.set_to(cfg):
        yield


def autotune_enabled() -> bool:
    """Autotune compiled launches only: the interpreter would run every candidate as Python, slowly."""
    return not interpreter_enabled()


def _current_fixed_config() -> dict[str, int] | None:
    """The configuration this call runs with, or None for the autotuner's choice. Read once in the forward
    and kept for the backward, which autograd may run on another thread and after the block has ended."""
    forced = _FIXED_CONFIG.value
    if forced is not None:
        return forced
    if autotune_enabled():
        return None
    return dict(_kernels().INTERPRETER_CONFIG)


def _launch(
    name: str,
    grid: Callable[[int, int], tuple[int, int]],
    args: tuple,
    constexprs: dict,
    cfg: dict[str, int] | None,
) -> None:
    """Launch kernel `name` with a fixed configuration, or through its autotuner (the grid then depends on
    the block sizes the tuner tries); counted instead where kernels/stand_in.py stands in."""

    def run() -> None:
        kern = _kernels()
        if cfg is None:
            tuned = getattr(kern, f"_flash_{name}_tuned")
            tuned[lambda meta: grid(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **constexprs)
        else:
            plain = getattr(kern, f"_flash_{name}")
            plain[grid(cfg["BLOCK_M"], cfg["BLOCK_N"])](*args, **constexprs, **cfg)

    stand_in.launch(f"flash_{name}", run)


def _tuning_sizes(seq_q: int, seq_k: int) -> tuple[int, int]:
    """The autotune key's sequence lengths (kernel arguments n_q_key, n_k_key): rounded up to a power of two."""
    return next_power_of_two(seq_q), next_power_of_two(seq_k)


def tuned_launch_configs(
    q: torch.Tensor, k: torch.Tensor, causal: bool = False, key_padding_mask: torch.Tensor | None = None
) -> dict[str, dict[str, int] | None]:
    """The configuration each kernel ("fwd", "bwd_dkdv", "bwd_dq") runs with for inputs like these:
    BLOCK_M, BLOCK_N, num_warps, num_stages. On CUDA, the autotuner's choice, or None for a kernel not yet
    tuned at this key (the backward is tuned at the first backward). Under the interpreter, or inside
    fixed_launch_config, the fixed configuration."""
    fixed = _current_fixed_config()
    if fixed is not None:
        return {name: dict(fixed) for name in KERNEL_NAMES}
    kern = _kernels()
    n_q_key, n_k_key = _tuning_sizes(q.shape[2], k.shape[2])
    configs: dict[str, dict[str, int] | None] = {}
    for name in KERNEL_NAMES:
        tuned = getattr(kern, f"_flash_{name}_tuned")
        # The tuner's key (triton.runtime.autotuner.Autotuner.run): the AUTOTUNE_KEY values, then the dtype of
        # every tensor argument in order. The kernels take their tensors first, up to the first stride.
        dtypes = []
        for arg in itertools.takewhile(lambda arg: not arg.startswith("stride_"), tuned.arg_names):
            if arg in ("Lse", "Delta"):
                dtypes.append(torch.float32)
            elif arg == "Kpm":
                dtypes.append(torch.uint8 if key_padding_mask is not None else q.dtype)
            else:
                dtypes.append(q.dtype)
        key = (n_q_key, n_k_key, q.shape[-1], causal, *map(str, dtypes))
        best = tuned.cache.get(key)
        if best is None:
            configs[name] = None
        else:
            configs[name] = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
    return configs


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask_BN: torch.Tensor | None,
    scale: float,
    cfg: dict[str, int] | None,
    out: torch.Tensor | None = None,
    stat_pieces: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); `out` (q's shape, any strides) is written in place of a new contiguous buffer when given. With
    `stat_pieces` P > 1 the batch rows are P consecutive pieces of B / P sequences and lse is the sequences' own,
    [B / P, H, P * seq_q] (k_flash_tiles `_stat_row`)."""
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    if batch % stat_pieces:
        raise ValueError(f"{batch} batch rows are not whole sequences of stat_pieces={stat_pieces} pieces")
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty(batch // stat_pieces, heads, stat_pieces * seq_q, device=q.device, dtype=torch.float32)
    kpm, stride_kpm_b, stride_kpm_n = _mask_args(mask_BN, q)
    args = (
        q, k, v, out, lse, kpm,
        *strides(q), *strides(k), *strides(v), *strides(out),
        stride_kpm_b, stride_kpm_n,
        heads, seq_q, seq_k, head_dim, scale * LOG2E, *_tuning_sizes(seq_q, seq_k), stat_pieces,
    )  # fmt: skip
    constexprs = dict(
        CAUSAL=causal, HAS_KPM=mask_BN is not None, **dot_options(q.dtype), BLOCK_D=next_power_of_two(head_dim)
    )
    _launch("fwd", lambda block_m, block_n: (cdiv(seq_q, block_m), batch * heads), args, constexprs, cfg)
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
    cfg: dict[str, int] | None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    delta: torch.Tensor | None = None,
    stat_pieces: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv); `grads` (buffers of q's, k's and v's shapes, any strides) are written when given, and `delta`
    (`backward_delta`'s, contiguous) is taken instead of computed from out, dout and dlse. With `stat_pieces` P > 1,
    lse and delta are the whole sequences' [B / P, H, P * seq_q] (as `_forward` gives them), delta required."""
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    if stat_pieces > 1 and delta is None:
        raise ValueError("stat_pieces > 1 needs the sequences' delta: a delta from the pieces' out would be laid "
                         "out by piece")
    delta = backward_delta(out, dout, dlse) if delta is None else delta
    if grads is None:
        grads = tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    dq, dk, dv = grads
    kpm, stride_kpm_b, stride_kpm_n = _mask_args(mask_BN, q)
    constexprs = dict(
        CAUSAL=causal, HAS_KPM=mask_BN is not None, **dot_options(q.dtype), BLOCK_D=next_power_of_two(head_dim)
    )
    qkv_strides = (*strides(q), *strides(k), *strides(v), *strides(dout))
    sizes = (heads, seq_q, seq_k, head_dim, scale * LOG2E, scale, *_tuning_sizes(seq_q, seq_k), stat_pieces)
    dkdv_args = (q, k, v, dout, lse, delta, dk, dv, kpm, *qkv_strides, *strides(dk), stride_kpm_b, stride_kpm_n, *sizes)
    _launch("bwd_dkdv", lambda block_m, block_n: (cdiv(seq_k, block_n), batch * heads), dkdv_args, constexprs, cfg)
    dq_args = (q, k, v, dout, lse, delta, dq, kpm, *qkv_strides, *strides(dq), stride_kpm_b, stride_kpm_n, *sizes)
    _launch("bwd_dq", lambda block_m, block_n: (cdiv(seq_q, block_m), batch * heads), dq_args, constexprs, cfg)
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
        cfg = _current_fixed_config()
        ctx.kernel_log = stand_in.active()
        with stand_in.kernel_region(ctx.kernel_log):
            out, lse = _forward(q, k, v, causal, mask_BN, scale, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
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
        with stand_in.kernel_region(ctx.kernel_log):
            dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.causal, ctx.mask_BN, ctx.scale, ctx.cfg)
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
