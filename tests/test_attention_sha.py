"""sha attends with one head (MHE paper's single-head lower bound), not H identical copies of it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tests.attention_cases import D_MODEL, HEADS, make_attention

E = D_MODEL // HEADS


def _inputs(T: int = 12, B: int = 2):
    torch.manual_seed(3)
    x_BTD = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    mask_BT = torch.zeros(B, T, dtype=torch.bool)
    mask_BT[1, T - 3 :] = True
    return x_BTD, mask_BT


def _sha(**knobs) -> nn.Module:
    return make_attention("sha", **knobs).double()


class _Recorder(nn.Module):
    """Wraps a mechanism and records the shape of every q it receives."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.q_shapes = inner, []

    def forward(self, q_BHTE, k_BHSE, v_BHSE, **kw):
        self.q_shapes.append((tuple(q_BHTE.shape), tuple(k_BHSE.shape), tuple(v_BHSE.shape)))
        return self.inner(q_BHTE, k_BHSE, v_BHSE, **kw)

    def attention_parameters(self) -> int:
        return self.inner.attention_parameters()


def test_sha_mechanism_receives_one_head():
    sha = _sha()
    sha.mechanism = _Recorder(sha.mechanism)
    x, mask = _inputs()
    sha(x, key_padding_mask_BS=mask, causal=True)
    k, v = sha.keys_values(x)
    sha.attend(x[:, -1:], k, v)  # the decoder's path: cached compact keys/values
    B, T = x.shape[:2]
    assert sha.mechanism.q_shapes == [((B, 1, T, E),) * 3, ((B, 1, 1, E), (B, 1, T, E), (B, 1, T, E))]


def _single_head_reference(sha, x_BTD, mask_BT, causal):
    """softmax(q k^T / sqrt(d) + masks) v with one head of dim d, then W^O as a d -> d_model map."""
    p = sha.projection
    q_BTE, k_BTE, v_BTE = x_BTD @ p.q.weight.T, x_BTD @ p.k.weight.T, x_BTD @ p.v.weight.T
    logits_BTS = q_BTE @ k_BTE.transpose(1, 2) / math.sqrt(E)
    T = x_BTD.shape[1]
    allowed_BTS = ~mask_BT[:, None, :].expand(-1, T, -1)
    if causal:
        allowed_BTS = allowed_BTS & torch.ones(T, T, dtype=torch.bool).tril()
    o_BTE = logits_BTS.masked_fill(~allowed_BTS, -math.inf).softmax(-1) @ v_BTE
    w_o_DE = sum(p.out.weight[:, h * E : (h + 1) * E] for h in range(HEADS))  # sum of W^O's head blocks
    return o_BTE @ w_o_DE.T


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_sha_equals_a_hand_written_single_head(causal):
    sha = _sha()
    x, mask = _inputs()
    torch.testing.assert_close(sha(x, key_padding_mask_BS=mask, causal=causal), _single_head_reference(sha, x, mask, causal))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_one_head_equals_h_identical_heads_concatenated(causal):
    """[o, ..., o] W^O^T = o (sum_h W^O_h)^T: the one-head sha computes what H copies of its head computed."""
    sha = _sha()
    x, mask = _inputs()
    p = sha.projection
    q_B1TE, k_B1SE, v_B1SE = p.q(x)[:, None], p.k(x)[:, None], p.v(x)[:, None]
    copies = lambda a: a.expand(-1, HEADS, -1, -1)
    o_BHTE = sha.mechanism(copies(q_B1TE), copies(k_B1SE), copies(v_B1SE), key_padding_mask_BS=mask, causal=causal)
    B, T = x.shape[:2]
    replicated = p.out(o_BHTE.transpose(1, 2).reshape(B, T, D_MODEL))
    torch.testing.assert_close(sha(x, key_padding_mask_BS=mask, causal=causal), replicated)


def test_sha_keeps_the_papers_parameter_count_with_one_head():
    """3 d_m d_h + d_m^2 (MHE paper's SHA): W^O keeps its d_model x d_model slots."""
    assert _sha().attention_parameters() == 3 * D_MODEL * E + D_MODEL**2


def test_sha_refuses_per_head_linformer_projections():
    with pytest.raises(ValueError, match="sharing=headwise"):
        make_attention("sha", mechanism={"kind": "linformer", "k": 8, "sharing": "none"})
