"""The strongest attention baselines the speed parts of benchmarks.gpu.suite time beside their subject, in one run.

Each is `fn(q, k, v, causal) -> out` on [batch, heads, n, head_dim] tensors:
- `sdpa-flash`: torch SDPA restricted to its FlashAttention-2 backend (`SDPBackend.FLASH_ATTENTION`);
- `sdpa-cudnn`: torch SDPA restricted to its cuDNN backend (`SDPBackend.CUDNN_ATTENTION`; cuDNN's fused flash
  attention, which on Hopper is often SDPA's fastest);
- `flex`: FlexAttention (`torch.nn.attention.flex_attention`; Dong et al., 2024, arXiv 2412.05496), compiled on
  CUDA as it is meant to run, the causal mask as a block mask;
- `fa3`: FlashAttention-3 (Shah et al., 2024, arXiv 2407.08608) through `flash_attn_interface`, the module its
  Hopper build installs (github.com/Dao-AILab/flash-attention, `hopper/`), when it is importable.
Restricting SDPA to one backend matters: a silent fallback to the math kernel would make a comparison
meaningless, so a backend that cannot take the inputs raises, and the row says why.

A baseline that cannot run here is a row with status `unavailable: <reason>` (`unavailable`), never the part's
error: cuDNN and FA3 need CUDA (FA3 its package too); FlexAttention has no backward on the CPU, so a dry run
times its forward only and records the forward + backward as unavailable (`backward_unavailable`).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FA3_MODULE = "flash_attn_interface"
FA3_HINT = "FlashAttention 3's Hopper build: `cd hopper && python setup.py install` in Dao-AILab/flash-attention"


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@functools.cache
def _causal_block_mask(n: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(batch, head, q_idx, kv_idx):
        return q_idx >= kv_idx

    return create_block_mask(causal, None, None, n, n, device=device)


@functools.cache
def _flex_attention(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


FLEX_RECOMPILE_LIMIT = 64
"""Graphs dynamo may compile for `flex_attention` in one run. Each length, mask (causal or none) and grad mode
(the forward alone, then with its backward) is a graph of its own (`dynamic=False`); past dynamo's default of 8,
it would run the rest uncompiled, the scores materialised: the first H200 run's flex rows from n = 2048 causal
on (10-25 TFLOP/s, out of memory at 32k) measured that fallback, not FlexAttention."""


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    block_mask = _causal_block_mask(q.shape[2], str(q.device)) if causal else None
    with warnings.catch_warnings(), torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
        # On the CPU (a dry run) it runs uncompiled on purpose; torch warns about that at every first call.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex_attention(q.is_cuda)(q, k, v, block_mask=block_mask)


def fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    import flash_attn_interface

    # FA3 takes [batch, n, heads, head_dim]: a transposed view (the last dim stays contiguous), no copy.
    out = flash_attn_interface.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    out = out[0] if isinstance(out, tuple) else out  # some releases return (out, lse)
    return out.transpose(1, 2)


BASELINES: dict[str, Callable[..., torch.Tensor]] = {"sdpa-flash": sdpa_flash, "sdpa-cudnn": sdpa_cudnn, "flex": flex,
                                                     "fa3": fa3}


def unavailable(impl: str, device: torch.device) -> str | None:
    """Why baseline `impl` cannot run on `device` in this environment, or None."""
    if impl == "sdpa-cudnn":
        if device.type != "cuda":
            return "SDPA's cuDNN backend needs CUDA"
        if not torch.backends.cudnn.is_available():
            return f"no cuDNN in this torch ({torch.__version__})"
    if impl == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError as err:
            return f"no FlexAttention in torch {torch.__version__} ({err})"
    if impl == "fa3":
        if device.type != "cuda":
            return "FlashAttention 3 needs a CUDA GPU (Hopper)"
        try:
            importlib.import_module(FA3_MODULE)
        except ImportError as err:
            return f"{FA3_MODULE} not importable ({err}); {FA3_HINT}"
    return None


def backward_unavailable(impl: str, device: torch.device) -> str | None:
    """Why `impl` can run its forward but not its backward here, or None."""
    if impl == "flex" and device.type != "cuda":
        return "FlexAttention has no backward on the CPU (forward timed)"
    return None
