"""`orchestrator plan`'s memory per GPU of an FSDP trial against the peak each rank of a real FSDP2 run holds.

Two processes (gloo on CPU) shard each model with the project's `shard_model` and take two training steps (the
second holds AdamW's state), as the Ray workers do; each rank's peak is the memory it held before the steps (its
parameter shards) plus what the steps allocated on top at their peak (benchmarks.harness.peak_memory_bytes: the
profiler's allocation events on a CPU). The plan's figure is `plan_spec(...).memory_bytes` of the same spec at
run.workers = 2, whatever the planner's code does at the version in the row. The models span the two regimes: a
step dominated by the weights, gradients and AdamW state (which FSDP divides by the workers) and one dominated
by activations (which it does not), each in fp32 and bf16 (FSDP's bf16 policy, no autocast).

    python -m benchmarks.system.fsdp_memory --label "plan: formula"      # rows of this code version, into the CSV

Rows stay in benchmarks/results/cpu-2core/fsdp_memory.csv (a rerun with the same label and commit replaces its
rows), each with the commit that produced it. A CPU's allocations are not a GPU's (no caching allocator, no
streams), and gloo is not NCCL: what this checks is the planner's model of what FSDP2 holds at once.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness import Row, code_version, peak_memory_bytes, read_csv, results_dir, write_csv

WORLD = 2
MODELS: dict[str, dict[str, int]] = {
    "states": {"layers": 4, "d_model": 256, "vocab": 500, "seq": 32, "batch": 2},
    "states-deep": {"layers": 8, "d_model": 256, "vocab": 500, "seq": 32, "batch": 2},
    "states-wide": {"layers": 4, "d_model": 384, "vocab": 500, "seq": 32, "batch": 2},
    "activations": {"layers": 4, "d_model": 128, "vocab": 2000, "seq": 64, "batch": 8},
    "embeddings": {"layers": 2, "d_model": 64, "vocab": 8000, "seq": 32, "batch": 2},
}
"""name -> a causal LM's size (mha, 4 heads, ffn 4 d_model): states (weights, gradients, AdamW) dominate the first
three, activations the fourth, the vocabulary's embedding and output layer (FSDP's root group) the fifth."""
PRECISIONS = ("fp32", "bf16")
REPEATS = 3
"""Runs per rank, the least peak kept. gloo's collectives run beside the Python thread, which may allocate the next
layer's buffers before the last ones are freed; by how much depends on timing (the same rank's peak moved by up to
10% between runs), and the least of a few runs is the nearest to FSDP2's own schedule of what it holds at once."""


def fsdp_spec(precision: str, layers: int, d_model: int, vocab: int, seq: int, batch: int) -> Any:
    from orchestrator.spec import validate_spec

    return validate_spec({
        "name": "fsdp-memory",
        "task": {"kind": "clm", "dataset": "builtin", "vocab_size": vocab, "seq_len": seq, "batch_size": batch},
        "model": {"d_model": d_model, "layers": layers, "ffn": 4 * d_model, "max_seq_len": seq, "dropout": 0.0,
                  "attention": {"kind": "mha", "heads": 4}},
        "run": {"strategy": "fsdp", "workers": WORLD, "precision": precision}})


def measured_peaks(precision: str, size: dict[str, int]) -> list[int]:
    """Each rank's peak bytes over two steps of the FSDP2-sharded model, from two gloo processes."""
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(_rank_main, args=(root, precision, size), nprocs=WORLD, join=True)
        return [json.loads((Path(root) / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _rank_main(rank: int, root: str, precision: str, size: dict[str, int]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=WORLD)
    try:
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(rank_peak(precision, size)))
    finally:
        dist.destroy_process_group()


def rank_peak(precision: str, size: dict[str, int], repeats: int = REPEATS) -> int:
    """This rank's peak bytes over two steps of the model of `size`, sharded over the default process group of
    WORLD ranks: the parameter shards it holds before the steps plus the steps' own peak on top; the least of
    `repeats` runs, each with a model and optimizer of its own."""
    return min(_two_steps_peak(precision, size) for _ in range(repeats))


def _two_steps_peak(precision: str, size: dict[str, int]) -> int:
    from orchestrator.spec import workload
    from orchestrator.training import shard_model

    work = workload(fsdp_spec(precision, **size))
    torch.manual_seed(0)
    model = shard_model(work.build().train(), torch.device("cpu"), precision, WORLD)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    def two_steps() -> None:
        for _ in range(2):  # the trainer's step under FSDP: no autocast (the bf16 policy computes in bf16)
            work.loss(model, work.inputs(work.batch)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return held + peak_memory_bytes(two_steps, torch.device("cpu"))


def run_case(name: str, precision: str) -> Row:
    from orchestrator.spec import gpu_kind
    from orchestrator.spec.plan import plan_spec

    size = MODELS[name]
    planned = plan_spec(fsdp_spec(precision, **size), gpu_kind("H100")).memory_bytes
    peaks = measured_peaks(precision, size)
    row: Row = {"model": name, "precision": precision, **size, "workers": WORLD, "plan_mib": planned / 2**20}
    for rank, peak in enumerate(peaks):
        row[f"rank{rank}_mib"] = peak / 2**20
        row[f"rank{rank}_error"] = (planned - peak) / peak
    return row


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="which stage of the planner this is")
    parser.add_argument("--out", default="benchmarks/results", help="results root; the CSV goes to <out>/<machine>/")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    version = code_version(Path(__file__).resolve().parents[2])
    path = results_dir(args.out, torch.device("cpu")) / "fsdp_memory.csv"
    kept = [row for row in read_csv(path) if (row["label"], row["version"]) != (args.label, version)] \
        if path.exists() else []
    rows: list[Row] = []
    for name in args.models:
        for precision in PRECISIONS:
            start = time.perf_counter()
            row = {"label": args.label, "version": version, **run_case(name, precision)}
            rows.append(row)
            print(f"{name:12s} {precision}: plan {row['plan_mib']:8.2f} MiB, ranks "
                  f"{row['rank0_mib']:8.2f} / {row['rank1_mib']:8.2f} MiB, plan error "
                  f"{row['rank0_error']:+.1%} / {row['rank1_error']:+.1%} ({time.perf_counter() - start:.1f}s)",
                  flush=True)
    write_csv([*kept, *rows], path)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
