"""Linformer sharing=none: each head projects its keys with its own E_i and values with its own F_i
(Wang et al., 2020, arXiv 2006.04768, Sec. 4, "Headwise sharing" is the alternative)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.attention_cases import D_MODEL, HEADS, make_attention

E_DIM, K, T = D_MODEL // HEADS, 4, 16


def _qkv(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HEADS, T, E_DIM, generator=g, dtype=torch.float64) for _ in range(3)]


def _per_head_reference(q_BHTE, k_BHSE, v_BHSE, compress):
    """head h: softmax(q_h (E_h k_h)^T / sqrt(d)) (F_h v_h), written one head at a time."""
    heads = []
    for h in range(HEADS):
        k_KE, v_KE = compress(h, k_BHSE[:, h], "E"), compress(h, v_BHSE[:, h], "F")
        logits_BTK = q_BHTE[:, h] @ k_KE.transpose(-1, -2) / math.sqrt(E_DIM)
        heads.append(logits_BTK.softmax(-1) @ v_KE)
    return torch.stack(heads, 1)


@pytest.mark.parametrize("projection", ["linear", "conv"])
def test_sharing_none_uses_each_heads_own_E_and_F(projection):
    lin = make_attention("linformer", k=K, max_len=T, sharing="none", projection=projection).double()
    mech = lin.mechanism
    E, F_ = mech._projections()
    assert E is not F_

    def compress(h, x_BSE, which):
        proj = E if which == "E" else F_
        if projection == "linear":
            return torch.einsum("ks,bse->bke", proj.weight[h], x_BSE)
        # head h's own (E x E x stride) kernel: channels h*E .. (h+1)*E of the grouped conv
        w = proj.conv.weight[h * E_DIM : (h + 1) * E_DIM]
        return F.conv1d(x_BSE.transpose(1, 2), w, stride=proj.stride).transpose(1, 2)

    q, k, v = _qkv()
    expected = _per_head_reference(q, k, v, compress)
    torch.testing.assert_close(mech(q, k, v), expected)
    # the heads' matrices differ, so the test would notice one head's E serving all heads
    if projection == "linear":
        assert not torch.allclose(E.weight[0], E.weight[1])
