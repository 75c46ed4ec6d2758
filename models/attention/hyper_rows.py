"""Some rows of HyperAttention's causal recursion (Algorithm 4, models/attention/hyper.py `causal`) from those rows'
queries alone: what a cached decoding step needs (`HyperMechanism.causal_last_rows`).

Under past-only routing a row's result depends on its own query and on the keys only: its key block at each level
is found from its own hash, and a level's samples come from that level's evaluation draw and the keys' count. So
the rows can follow the halves that hold them down the recursion, one placement per level, and equal the full
pass's rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from models.attention.exact import exact_causal_rows
from models.attention.lse import merge_lse

if TYPE_CHECKING:
    from models.attention.hyper import HyperMechanism


def causal_rows(mech: HyperMechanism, q_BHTE, first: int, k_BHNE, v_BHNE, key_padding_BN, level: int = 0):
    """(out, lse) of rows first .. first+T-1 of `mech.causal` over N keys, from those rows' queries: Algorithm 4
    followed down the halves that hold them, with the same odd-length padding, halves and levels as `causal`."""
    T, N = q_BHTE.shape[2], k_BHNE.shape[2]
    if N <= mech.min_seq_len:
        return exact_causal_rows(q_BHTE, first, k_BHNE, v_BHNE, key_padding_BN)
    odd = N % 2
    if odd:  # `causal` pads one key at the end (and a query, which these rows are not)
        k_BHNE, v_BHNE = (F.pad(x, (0, 0, 0, 1)) for x in (k_BHNE, v_BHNE))
        if key_padding_BN is None:
            key_padding_BN = torch.zeros(k_BHNE.shape[0], N, dtype=torch.bool, device=k_BHNE.device)
        key_padding_BN = F.pad(key_padding_BN, (0, 1), value=True)
    h = (N + odd) // 2
    pad = lambda lo, hi: None if key_padding_BN is None else key_padding_BN[:, lo:hi]  # noqa: E731
    n_first_half = min(max(h - first, 0), T)
    parts = []
    if n_first_half:
        parts.append(causal_rows(mech, q_BHTE[:, :, :n_first_half], first, k_BHNE[:, :, :h], v_BHNE[:, :, :h],
                                 pad(0, h), level + 1))
    if n_first_half < T:
        q_second = q_BHTE[:, :, n_first_half:]
        out_d, lse_d = causal_rows(mech, q_second, first + n_first_half - h, k_BHNE[:, :, h:], v_BHNE[:, :, h:],
                                   pad(h, None), level + 1)
        out_off, lse_off = mech.placed(q_second, k_BHNE[:, :, :h], v_BHNE[:, :, :h], pad(0, h), level)
        parts.append(merge_lse(out_d, lse_d, out_off, lse_off))
    return torch.cat([out for out, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=2)
