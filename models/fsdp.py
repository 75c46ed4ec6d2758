"""How FSDP2 shards a model of this project, for training (orchestrator/training/sharding.py, over the run's process
group) and for `plan`'s count of a sharded step (orchestrator/spec/counting.py, over a fake one): both must shard
alike, so this is the one place that says how.

As torchtitan does (torchtitan/models/llama3/infra/parallelize.py, `apply_fsdp`): `fully_shard` on each transformer
layer that can be a group of its own (`layers_to_shard`), then on the root, over a 1-D device mesh. Under bf16 the
policy computes with bf16 parameters and reduces gradients in fp32, with no autocast; the fp32 master weights and
AdamW state stay sharded.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from models.transformer import layers_to_shard


def apply_fsdp(model: nn.Module, mesh: Any, precision: str) -> nn.Module:
    """`model` sharded in place over `mesh` (a torch.distributed DeviceMesh), its mixed-precision policy from
    run.precision ("bf16", else full precision)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The root returns the logits of F.linear over [B, T, D], a view; FSDP2 warns that an in-place op on it would
    # skip its pre-backward hook. Every task reads the logits out of place (`.float()`, cross_entropy, argmax).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16"
              else MixedPrecisionPolicy())
    for layer in layers_to_shard(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
