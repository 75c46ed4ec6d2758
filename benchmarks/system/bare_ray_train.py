"""The floor under `orchestrator train`'s start-up: a bare Ray Train V2 run as Ray's own quick start writes it.

One `TorchTrainer` worker trains a tiny linear model for 10 steps and reports once; the worker writes the wall
time of that report to STAMP. Nothing of the project is imported, so the seconds from this process's start to
the stamp are what Ray itself costs on this machine (its own local instance, the Train controller and its
actors, one worker importing torch). `benchmarks/system/ray_overhead.py --startup` runs it beside `orchestrator
train` in alternating rounds.

    python benchmarks/system/bare_ray_train.py STAMP STORAGE
"""

from __future__ import annotations

import sys
import time


def train_fn(config: dict) -> None:
    import torch

    import ray.train

    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with open(config["stamp"], "w") as stamp:  # before report(): the moment the metric exists
        stamp.write(repr(time.time()))
    ray.train.report({"loss": loss.item()})


def main(stamp: str, storage: str) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(train_fn, train_loop_config={"stamp": stamp},
                           scaling_config=ScalingConfig(num_workers=1),
                           run_config=RunConfig(storage_path=storage, name=f"bare-{time.time_ns()}"))
    trainer.fit()


if __name__ == "__main__":
    main(*sys.argv[1:3])
