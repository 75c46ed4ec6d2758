"""What benchmarks/system/ray_overhead.py and benchmarks/system/ray_startup.py measure against: the benchmark's
spec at a scale (`bench_spec`, `FULL`, `QUICK`) and the same training core run in this process without Ray
(`plain_run`), with the steady-state reading of its tokens/s windows (`steady`)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.launch import train_locally
from orchestrator.spec import ExperimentSpec


TOKENS_PER_S = "train/tokens_per_s"


@dataclass(frozen=True)
class Scale:
    d_model: int
    layers: int
    heads: int
    ffn: int
    seq_len: int
    batch_size: int
    vocab_size: int
    train_sentences: int
    max_steps: int
    log_every: int
    cpus: int


FULL = Scale(d_model=256, layers=4, heads=4, ffn=1024, seq_len=128, batch_size=16, vocab_size=4000,
             train_sentences=8000, max_steps=120, log_every=10, cpus=1)
QUICK = Scale(d_model=32, layers=1, heads=2, ffn=64, seq_len=32, batch_size=8, vocab_size=200,
              train_sentences=400, max_steps=12, log_every=3, cpus=1)


def bench_spec(name: str, scale: Scale, storage: Path, uri: str) -> dict[str, Any]:
    """The raw spec: evaluation and the single checkpoint only at the last step, so windows are pure training."""
    return {
        "name": name,
        "task": {"kind": "mlm", "seq_len": scale.seq_len, "batch_size": scale.batch_size,
                 "vocab_size": scale.vocab_size, "eval_batches": 2,
                 "builtin": {"train_sentences": scale.train_sentences, "eval_sentences": 50}},
        "model": {"d_model": scale.d_model, "layers": scale.layers, "ffn": scale.ffn, "max_seq_len": scale.seq_len,
                  "dropout": 0.1, "attention": {"kind": "mha", "heads": scale.heads}},
        "optim": {"lr": 1e-3, "max_steps": scale.max_steps, "warmup_steps": 1, "seed": 0},
        "run": {"workers": 1, "cpus_per_worker": scale.cpus, "log_every": scale.log_every,
                "eval_every": scale.max_steps, "checkpoint_every": scale.max_steps, "storage_path": str(storage)},
        "tune": {"scheduler": "fifo", "max_concurrent": 1},
        "tracking": {"uri": uri, "retries": 2, "timeout_s": 5},
    }


# --- without Ray -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlainResult:
    windows: list[tuple[int, float]]
    """(step, tokens/s) of every `log_every` window, as the worker logs them."""
    first_window_s: float
    """Seconds from the start (task build included) to the end of the first window."""


def plain_run(spec: ExperimentSpec, cache_dir: Path) -> PlainResult:
    """The training core (`train_locally`) on `spec` in this process, without Ray: its train/* windows."""
    windows: list[tuple[int, float]] = []
    first_window_s = math.nan

    def on_metrics(metrics: Mapping[str, float], step: int) -> None:
        nonlocal first_window_s
        if TOKENS_PER_S not in metrics:
            return
        windows.append((step, metrics[TOKENS_PER_S]))
        if math.isnan(first_window_s):
            first_window_s = time.perf_counter() - start

    threads = torch.get_num_threads()
    start = time.perf_counter()
    torch.set_num_threads(max(1, int(spec.run.cpus_per_worker)))  # Ray gives its worker OMP threads = its CPUs
    try:
        train_locally(spec, cache_dir=cache_dir, on_metrics=on_metrics)
    finally:
        torch.set_num_threads(threads)
    return PlainResult(windows, first_window_s)


# --- the MLflow store, read-only ---------------------------------------------------------------------


def steady(windows: Sequence[tuple[int, float]], max_steps: int) -> float:
    """Median tokens/s over full windows after the first (warm-up); the last window may be partial."""
    kept = [value for step, value in windows[1:] if step != max_steps or len(windows) < 3]
    return statistics.median(kept) if kept else math.nan
