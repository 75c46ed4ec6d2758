"""What `run.compile` buys per attention kind: training-step time of the eager model against the same model
under torch.compile (inductor: C++ kernels from the machine's compiler on CPU), on one small masked-LM spec.

Each kind trains through the training core's own `train_step` (task loss, AdamW, clipping) twice, eager and
compiled, from the same initial weights and batches. The compiled side's first steps pay the compilation
(`compile_s`: their time above the eager steps'); then both sides are timed in alternation
(`harness.interleaved_medians`, so load from other processes hits both alike). A kind that cannot compile
keeps its error in `status`; `graph_breaks` counts where dynamo fell back to eager Python (data-dependent
shapes, `.item()`-style host reads: none in any kind since the masked LM's scored positions come with the
batch). Each kind runs with the knobs its config declares for the small benchmarks (`bench_knobs`, e.g.
linformer k 32, lsh buckets of 16).

    python -m benchmarks.system.compile_speed --out benchmarks/results
    python -m benchmarks.system.compile_speed --kinds mha linformer --steps 5    # a subset
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (
    Row,
    describe_error,
    interleaved_medians,
    results_dir,
    save_figure,
    write_csv,
)
from models.attention import ATTENTION, ATTENTION_KINDS
from orchestrator.spec import validate_spec
from orchestrator.training import train_step, Trainer
from tasks import WorkerContext

def bench_raw(kind: str, *, d_model: int, layers: int, seq_len: int, batch_size: int) -> dict[str, Any]:
    return {
        "name": f"compile-{kind}",
        "task": {"kind": "mlm", "seq_len": seq_len, "batch_size": batch_size, "vocab_size": 1000,
                 "builtin": {"train_sentences": 2000, "eval_sentences": 20}},
        "model": {"d_model": d_model, "layers": layers, "ffn": 4 * d_model, "max_seq_len": seq_len, "dropout": 0.0,
                  "attention": {"kind": kind, "heads": 4, **ATTENTION.configs[kind].bench_knobs}},
        "optim": {"lr": 1e-3, "max_steps": 1000, "warmup_steps": 1, "seed": 0},
    }


def _stepper(trainer: Trainer):
    batches = (batch for batch, _ in trainer.task.train_batches(None))
    trainer.model.train()
    return lambda: train_step(trainer.model, batches, trainer.task.loss, trainer.opt, trainer.device)


def measure_kind(kind: str, args: argparse.Namespace, cache: Path) -> Row:
    raw = bench_raw(kind, d_model=args.d_model, layers=args.layers, seq_len=args.seq_len, batch_size=args.batch_size)
    ctx = WorkerContext(seed=0, cache_dir=cache)
    row: Row = {"kind": kind, "d_model": args.d_model, "layers": args.layers, "seq_len": args.seq_len,
                "batch_size": args.batch_size, "backend": args.backend, "threads": torch.get_num_threads()}
    eager = _stepper(Trainer.create(validate_spec(raw), ctx))
    start = time.perf_counter()
    for _ in range(args.warmup):
        eager()
    eager_warm_s = time.perf_counter() - start
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        compiled_spec = validate_spec({**raw, "run": {"compile": True, "compile_backend": args.backend}})
        compiled = _stepper(Trainer.create(compiled_spec, ctx))
        start = time.perf_counter()
        for _ in range(args.warmup):
            compiled()
        compiled_warm_s = time.perf_counter() - start
        times = interleaved_medians({"eager": eager, "compiled": compiled}, torch.device("cpu"), warmup=0,
                                    repeats=args.steps)
    except Exception as err:  # noqa: BLE001 - a kind that does not compile is a result, not a crash
        return {**row, "status": describe_error(err)}
    eager_s, compiled_s = statistics.median(times["eager"]), statistics.median(times["compiled"])
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    reasons = sorted(torch._dynamo.utils.counters["graph_break"], key=len)[:2]
    return {**row, "status": "ok", "eager_step_s": eager_s, "compiled_step_s": compiled_s,
            "speedup": eager_s / compiled_s, "compile_s": max(0.0, compiled_warm_s - eager_warm_s),
            "graph_breaks": breaks, "break_reasons": "; ".join(" ".join(r.split())[:90] for r in reasons).replace(",", ";"),
            "repeats": args.steps}


def plot(rows: Sequence[Row], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    kinds = [r["kind"] for r in rows]
    speedups = [r.get("speedup", math.nan) if r.get("status") == "ok" else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bars = ax.bar(kinds, speedups, color=["tab:blue" if r.get("status") == "ok" else "tab:red" for r in rows])
    ax.axhline(1.0, color="gray", linewidth=1, linestyle="--")
    for bar, row in zip(bars, rows):
        label = f"{row['speedup']:.2f}x" if row.get("status") == "ok" else "failed"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("eager step time / compiled")
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="results root; files go to <out>/<machine>/")
    parser.add_argument("--kinds", nargs="*", default=list(ATTENTION_KINDS), help="attention kinds (default: all)")
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a Ray worker with 1 CPU has 1)")
    parser.add_argument("--name", default="compile_speed", help="file stem of the CSV and plot")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile-speed-") as tmp:
        for kind in args.kinds:
            row = measure_kind(kind, args, Path(tmp))
            rows.append(row)
            print(f"{kind:10s} {row['status'][:60]:60s} speed-up {row.get('speedup', math.nan):.2f} "
                  f"compile {row.get('compile_s', math.nan):.1f}s breaks {row.get('graph_breaks', '-')}", flush=True)
    folder = results_dir(args.out, torch.device("cpu"))
    print(f"wrote {write_csv(rows, folder / f'{args.name}.csv')}")
    title = (f"torch.compile ({args.backend}) training step, masked LM d={args.d_model} L={args.layers} "
             f"T={args.seq_len} B={args.batch_size}, {args.threads} thread(s)")
    print(f"wrote {plot(rows, folder / f'{args.name}.png', title)}")
    return rows


if __name__ == "__main__":
    main()
