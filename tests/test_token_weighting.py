"""A step's gradient is that of the mean loss over every target token of the step, on every rank
(orchestrator/training/optimizer_step.py `token_weights`), however the tokens fall into micro-batches and ranks:
masked LM's masked counts and translation's max_tokens batches differ from one micro-batch to the next, and a
weight of 1 / grad_accum per micro-batch (the former rule) made a token of a short micro-batch count for more."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from orchestrator.spec import OptimConfig
from orchestrator.training.optimizer_step import Optimization, token_weights, train_step
from tasks import Batch

CPU = torch.device("cpu")
ROWS = 6
# Scored rows of each micro-batch: rank 0's step holds 3 + 1 tokens, rank 1's 2 + 6 (one micro-batch of every row).
COUNTS = {0: (3, 1), 1: (2, 6)}


def masked_batch(seed: int, scored: int) -> Batch:
    """ROWS rows of which the first `scored` count in the loss, as masked LM scores its masked positions."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(ROWS) < scored
    return Batch({"x": torch.randn(ROWS, 4, generator=gen), "y": torch.randn(ROWS, 1, generator=gen),
                  "mask": mask}, n_tokens=scored)


def masked_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean squared error over the batch's scored rows (the tasks' contract: the mean over n_tokens targets)."""
    err = (model(batch.tensors["x"]) - batch.tensors["y"]).squeeze(-1) ** 2
    return (err * batch.tensors["mask"]).sum() / max(batch.n_tokens, 1)


def rank_batches(rank: int) -> list[Batch]:
    return [masked_batch(10 * rank + i, scored) for i, scored in enumerate(COUNTS[rank])]


def per_token_gradient(model: nn.Module, batches: list[Batch]) -> torch.Tensor:
    """The gradient of the mean over every scored row of `batches`, computed as one sum, without the trainer."""
    total = sum(batch.n_tokens for batch in batches)
    mean = sum(masked_loss(model, batch) * batch.n_tokens for batch in batches) / total
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(mean, list(model.parameters()))])


def step_gradient(model: nn.Module, batches: list[Batch]) -> torch.Tensor:
    """The gradient train_step hands to AdamW for `batches` as one step's micro-batches."""
    opt = Optimization.build(model, OptimConfig(lr=1e-3, max_steps=4, grad_accum=len(batches), grad_clip=None),
                             CPU, fused=False)
    seen: list[torch.Tensor] = []
    opt.optimizer.step = lambda *args, **kwargs: seen.append(
        torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
    train_step(model, iter(batches), masked_loss, opt, CPU)
    return seen[0]


def test_micro_batches_of_different_token_counts_give_the_one_batch_per_token_gradient():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    batches = rank_batches(0)
    expected = per_token_gradient(model, batches)
    # 1 / grad_accum per micro-batch weighs the 1-token micro-batch's token 3x each of the other's: not this.
    assert torch.allclose(step_gradient(model, batches), expected, atol=1e-6)


def test_equal_counts_weigh_each_micro_batch_one_over_grad_accum():
    # Causal LM blocks hold the same count: their steps are what they were under the former rule.
    assert token_weights([64, 64, 64, 64], CPU) == [0.25] * 4
    assert token_weights([0, 0], CPU) == [0.0, 0.0]  # no target token in the step: nothing to learn, no NaN


def _two_ranks(rank: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
        gradient = step_gradient(model, rank_batches(rank))
        torch.save(gradient, Path(root) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_of_different_token_counts_give_the_per_token_gradient_of_both(tmp_path):
    """DDP averages the ranks' gradients: each rank's weights carry the ranks' count over the tokens of both
    (one all-reduce), so that the averaged gradient is the mean over all 12 tokens, not the mean of the ranks'
    means (rank 0 holds 4 tokens, rank 1 8)."""
    mp.spawn(_two_ranks, args=(str(tmp_path),), nprocs=2, join=True)
    torch.manual_seed(0)
    expected = per_token_gradient(nn.Linear(4, 1), rank_batches(0) + rank_batches(1))
    for rank in range(2):
        assert torch.allclose(torch.load(tmp_path / f"rank{rank}.pt"), expected, atol=1e-6), rank
