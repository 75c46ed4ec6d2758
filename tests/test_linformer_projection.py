"""Linformer's sequence projections E / F against a slot-by-slot oracle.

Every projection kind (linear, mean, max, conv), one E for all heads or one per head (sharing none), with key
padding, and with a length S that is not a multiple of the stride n / k, so the last pooled slot is partial and
one slot holds only padding. The oracle loops over slots and positions; it shares no reshaping with the
module, so a wrong view, a padded position counted as real, a wrong pad length or a swapped head/feature
axis all show up as a value difference.
"""

from __future__ import annotations

import pytest
import torch

from models.attention.linformer import SequenceProjection

B, H, E, N, K = 2, 3, 4, 12, 4  # stride n / k = 3
STRIDE = N // K


def projection_oracle(proj: SequenceProjection, x_BHSE: torch.Tensor, pad_BS: torch.Tensor):
    """E x slot by slot: padded positions are zeroed (linear, conv) or skipped (mean, max)."""
    _, _, S, _ = x_BHSE.shape
    valid_BS = ~pad_BS
    x = x_BHSE * valid_BS[:, None, :, None]
    if proj.kind == "linear":
        out = torch.zeros(B, H, proj.k, E, dtype=x.dtype)
        for h in range(H):
            w_KS = (proj.weight if proj.heads is None else proj.weight[h])[:, :S]
            for j in range(proj.k):
                for s in range(S):
                    out[:, h, j] += w_KS[j, s] * x[:, h, s]
        return out, None
    slots = -(-S // STRIDE)
    out = torch.zeros(B, H, slots, E, dtype=x.dtype)
    empty = torch.zeros(B, slots, dtype=torch.bool)
    for b in range(B):
        for j in range(slots):
            members = [s for s in range(j * STRIDE, min((j + 1) * STRIDE, S)) if valid_BS[b, s]]
            empty[b, j] = not members
            for h in range(H):
                if proj.kind == "mean" and members:
                    out[b, h, j] = torch.stack([x[b, h, s] for s in members]).mean(0)
                elif proj.kind == "max" and members:
                    out[b, h, j] = torch.stack([x[b, h, s] for s in members]).amax(0)
                elif proj.kind == "conv":
                    weight = proj.conv.weight  # [groups * E_out, E_in, stride]
                    w = weight if proj.heads is None else weight[h * E:(h + 1) * E]
                    for r in range(STRIDE):
                        s = j * STRIDE + r
                        if s < S:  # positions past S are the zero padding of the last slot
                            out[b, h, j] += w[:, :, r] @ x[b, h, s]
    return out, empty


# pooling has no weights, so per head and shared are the same map: only linear and conv have both
@pytest.mark.parametrize("kind, per_head", [("linear", False), ("linear", True), ("mean", False), ("max", False),
                                            ("conv", False), ("conv", True)])
@pytest.mark.parametrize("S", [12, 10], ids=["full", "partial-last-slot"])
def test_projection_equals_the_slot_by_slot_oracle(kind, per_head, S):
    torch.manual_seed(0)
    proj = SequenceProjection(kind, K, N, E, H if per_head else None).double()
    x = torch.randn(B, H, S, E, dtype=torch.float64)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, 3:6] = True  # a whole slot of padding in row 0 (slot 1)
    pad[1, S - 2] = True  # one position of a slot of row 1 (its slot keeps a real member)
    out, empty = proj(x, pad)
    ref, ref_empty = projection_oracle(proj, x, pad)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if ref_empty is None:
        assert empty is None
    else:
        assert torch.equal(empty, ref_empty)
        assert ref_empty[0, 1] and not ref_empty[1].any()
