"""Tiny training loops the tests share: fit a model for a few steps and return its losses."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def fit(loss_at_step: Callable[[int], torch.Tensor], optimizer: torch.optim.Optimizer, steps: int,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> list[float]:
    """`steps` optimizer steps on loss_at_step(step); the loss of every step."""
    losses = []
    for step in range(steps):
        loss = loss_at_step(step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def next_token_loss(model: nn.Module, tokens_BT: torch.Tensor) -> torch.Tensor:
    """Causal-LM cross entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
    logits = model(tokens_BT[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens_BT[:, 1:].flatten())


def fit_task(task, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
             scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> list[float]:
    """`steps` optimizer steps of task.loss over the task's own training batches, in order."""
    batches = iter(task.train_batches())
    return fit(lambda _: task.loss(model, next(batches)[0]), optimizer, steps, scheduler)
