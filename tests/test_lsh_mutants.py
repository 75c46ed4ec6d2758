"""Reformer LSH attention (Kitaev, Kaiser, Levskaya, 2020, arXiv 2001.04451) behaviour that surviving mutants
showed untested.

The device-only mutants (a `device=` dropped, `.to(device)` made `.to(None)`) change nothing on a CPU-only machine;
tests/other_device.py simulates a second device on the CPU so that a tensor made on the wrong one raises, as on a
GPU. The `meta` device cannot do it here: bucketing needs values (`int(half_B.max())`, the layout's length).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.attention.lsh import LSHMechanism, LSHMechanismConfig
from tests.other_device import OTHER, OtherDevice, on_other, to_other

B, H, T, E = 2, 2, 13, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, E, generator=g)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 10:] = True
    return q, F.normalize(q, dim=-1), torch.randn(B, H, T, E, generator=g), pad


# default buckets (counted on the host, moved to the device) and fixed ones (made there); fixed rotations
# (evaluation, moved to the device) and redrawn ones (training, drawn there); the past-only layout (causal);
# with a padding mask and without one (the all-false mask made in forward).
@pytest.mark.parametrize("causal, n_buckets, training, padded", [(False, None, False, True), (False, 4, True, False),
                                                                 (True, 4, False, True), (True, None, True, False)])
def test_every_tensor_is_made_on_the_inputs_device(causal, n_buckets, training, padded):
    """Rotations, bucket ids, positions, the layout and its masks are made on the input's device: run on a
    simulated second device, nothing mixes with a plain CPU tensor, the output stays there and equals the
    plain CPU run (fixed rotations in evaluation, the same global RNG state in training)."""
    cfg = LSHMechanismConfig(bucket_size=4, n_hashes=2, n_buckets=n_buckets)
    mech = LSHMechanism(cfg, E, 0).train(training)
    q, k, v, pad = _inputs()
    pad = pad if padded else None
    torch.manual_seed(1)
    expected = mech(q, k, v, key_padding_mask_BS=pad, causal=causal)
    torch.manual_seed(1)
    with OtherDevice():
        out = mech(*(to_other(x.clone()) for x in (q, k, v)), causal=causal,
                   key_padding_mask_BS=None if pad is None else to_other(pad.clone()))
        assert on_other(out) and out.device == OTHER
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
