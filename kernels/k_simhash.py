"""Triton kernel of HyperAttention's SimHash bucket rank (Han et al., 2024, arXiv 2310.05869, Definition 1): per
token the signs of its r hyperplane projections, weighted into a code with 2^j for each positive sign j (the
authors' `AngularLSH.hash`, insuhan/hyper-attn 68b91e9, models/attention/angular_lsh.py lines 24-26), then the
code's rank along the reflected Gray sequence (models/attention/hyper.py `gray_rank`: the inverse Gray map, our
documented deviation from the authors' `perm[code]`). One launch where PyTorch takes five (the matmul, the sign
test, the weights, their sum, the rank table's gather), with no [B, H, T, r] projections or bits written in
between. A co-author's fused version hashes the same way, one program per 128 tokens with the projections padded
to 16 columns (amirzandieh/HyperAttention bd1915d, src/angular_lsh_triton.py `_angular_lsh_kernel`).

One program ranks BLOCK_T tokens of one (batch, head): it loads their rows and every hyperplane once (r <= 32
columns, zero past r), multiplies them, and rounds each product sum to the rows' dtype before the sign test
(ROUND_TO_INPUT), as a bf16 or fp16 matmul rounds its output before `> 0` sees it: a sum that rounds to zero is
no positive sign, as there. The Gray rank is the prefix XOR of the code's bits in five shifts whatever r is: the
shifts past r add nothing, the code having no bits there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.k_flash_tiles import _dot
from kernels.k_lsh_hash import _round_to_input


def launch_config(interpret: bool) -> dict[str, int]:
    """128 tokens a program on a GPU (an fp32 [128, 32] product: 16 KB); the interpreter's smallest tiles, which
    it runs fastest."""
    if interpret:
        return {"BLOCK_T": 16, "num_warps": 1, "num_stages": 1}
    return {"BLOCK_T": 128, "num_warps": 4, "num_stages": 2}


@triton.jit
def _simhash_rank(
    X, P, RANK,
    stride_xb, stride_xh, stride_xt, stride_xe,
    stride_pe, stride_pr,
    stride_rb, stride_rh, stride_rt,
    n_heads, seq_len, head_dim, n_bits,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, ROUND_TO_INPUT: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    h = bh % n_heads
    b = bh // n_heads

    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    feats = tl.arange(0, BLOCK_E)
    cols = tl.arange(0, BLOCK_R)
    x_ptrs = X + b * stride_xb + h * stride_xh + rows[:, None] * stride_xt + feats[None, :] * stride_xe
    x = tl.load(x_ptrs, mask=(rows[:, None] < seq_len) & (feats[None, :] < head_dim), other=0.0)
    p_ptrs = P + feats[:, None] * stride_pe + cols[None, :] * stride_pr
    planes = tl.load(p_ptrs, mask=(feats[:, None] < head_dim) & (cols[None, :] < n_bits), other=0.0)
    xp = _dot(x, planes, DOT_PRECISION, DOT_UPCAST)
    if ROUND_TO_INPUT:
        xp = _round_to_input(xp, X.dtype.element_ty)
    weights = tl.where(cols < n_bits, 1 << cols, 0)
    code = tl.sum(tl.where(xp > 0, weights[None, :], 0), axis=1)
    rank = code ^ (code >> 1)
    rank = rank ^ (rank >> 2)
    rank = rank ^ (rank >> 4)
    rank = rank ^ (rank >> 8)
    rank = rank ^ (rank >> 16)
    r_ptrs = RANK + b * stride_rb + h * stride_rh + rows * stride_rt
    tl.store(r_ptrs, rank.to(tl.int64), mask=rows < seq_len)
