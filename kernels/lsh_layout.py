"""LSH's past-only layout on the Triton kernel of k_lsh_layout.py: the index the chunked kernels load q, k, v
through (token of each row, -1 for a filler row) and the shifted positions of the causal test, as
models/attention/lsh.py `forward` builds them from `bucket_aligned_slots` in PyTorch. HyperAttention's past-only
query groups are the same layout with key blocks for buckets (models/attention/hyper_groups.py `grouped_rows`).

Neither output takes a gradient. Inside `kernels.dispatch.stand_in_kernels()` the launch is counted and the
buffers allocated as on a GPU (kernels/stand_in.py).
"""

from __future__ import annotations

import torch

from kernels import stand_in
from kernels.flash_attention import interpreter_enabled, jit_module, strides


def bucket_layout(bucket_BHRT: torch.Tensor, order_BHRT: torch.Tensor, bucket_size: int,
                  length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_of_row [B, H, R, length] (int32, -1 on filler rows) and positions [B, H, R, T] (int64: token -
    bucket * T) of the layout where each bucket's run of `order` (the tokens sorted by bucket, then position)
    starts a new chunk of `bucket_size` rows. `length` must hold the layout (`layout_length_bound` does for any
    buckets): a shorter one is not checked on the device, which would need a read back."""
    if bucket_BHRT.shape != order_BHRT.shape or bucket_BHRT.dim() != 4:
        raise ValueError(f"bucket ids and their order must both be [B, H, R, T]; got {tuple(bucket_BHRT.shape)} "
                         f"and {tuple(order_BHRT.shape)}")
    B, H, R, T = bucket_BHRT.shape
    if length < T:
        raise ValueError(f"the layout of {T} tokens needs at least {T} rows; got length={length}")
    log = stand_in.active()
    with stand_in.kernel_region(log):  # the layout and the positions are the kernel's own outputs, not glue
        token_BHRL = torch.empty(B, H, R, length, dtype=torch.int32, device=bucket_BHRT.device)  # filled there
        positions_BHRT = torch.empty(B, H, R, T, dtype=torch.int64, device=bucket_BHRT.device)
        from kernels import k_lsh_layout

        kern = jit_module(k_lsh_layout)
        cfg = kern.launch_config(interpreter_enabled())
        stand_in.launch("lsh_layout", lambda: kern._bucket_layout[(B * H * R,)](
            bucket_BHRT, order_BHRT, token_BHRL, positions_BHRT,
            *strides(bucket_BHRT), *strides(order_BHRT), *strides(token_BHRL), *strides(positions_BHRT),
            H, R, T, bucket_size, length, **cfg,
        ))  # fmt: skip
    return token_BHRL, positions_BHRT
