"""The GPU training paths' arithmetic, measured on CPU: loss curves of one small spec trained in each precision and
under each distribution strategy, against the plain run of the same seed.

- `precision`: fp32, bf16 autocast and fp16 autocast (with loss scaling) through the training core in this process
  (`train_locally`, no Ray): the half-precision curves' distance from fp32's is bf16's / fp16's rounding.
- `sharding`: the same spec on 2 Ray Train CPU workers (gloo), DDP and FSDP2 (fp32, then FSDP with bf16 parameters),
  each a full `orchestrator train` run (local Ray, MLflow in a temporary SQLite file). DDP and fp32 FSDP average
  the same gradients, so their curves should agree to float rounding.

Every curve is written to one CSV (`part, run, step, train_loss, gap`, where gap = loss - the part's baseline
loss at that step) with a plot of the gaps, and a summary line per run (largest |gap|, gap at the last step).

    python -m benchmarks.studies.cpu_curves --out benchmarks/results                 # both parts, 50 steps
    python -m benchmarks.studies.cpu_curves --part precision --steps 20 --kind lsh    # one part, another kind
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Row, results_dir, save_figure, write_csv
from models.attention import ATTENTION
from orchestrator.launch import run_training, train_locally
from orchestrator.spec import validate_spec
from orchestrator.tracking.read import TrackingReader

PRECISIONS = ("fp32", "bf16", "fp16")
SHARDINGS = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"},
             "fsdp-bf16": {"strategy": "fsdp", "precision": "bf16"}}


def base_raw(kind: str, steps: int, root: Path) -> dict[str, Any]:
    """A causal LM of d_model 32 on the built-in corpus, logging every step (the test tier's curve spec, longer)."""
    return {
        "name": "cpu-curve",
        "task": {"kind": "clm", "seq_len": 16, "batch_size": 4, "vocab_size": 120, "eval_batches": 2,
                 "builtin": {"train_sentences": 400, "eval_sentences": 20}},
        "model": {"d_model": 32, "layers": 2, "ffn": 64, "max_seq_len": 16, "dropout": 0.1,
                  "attention": {"kind": kind, "heads": 4, **ATTENTION.configs[kind].tiny_knobs}},
        "optim": {"lr": 3e-3, "max_steps": steps, "warmup_steps": 1, "seed": 3},
        "run": {"log_every": 1, "eval_every": steps, "checkpoint_every": steps, "prefetch_batches": 0,
                "storage_path": str(root / "runs"), "final_eval": False},
        "tracking": {"uri": f"sqlite:///{root / 'mlflow.db'}", "retries": 1, "timeout_s": 2},
    }


def precision_curves(kind: str, steps: int, root: Path) -> dict[str, dict[int, float]]:
    curves = {}
    for precision in PRECISIONS:
        raw = base_raw(kind, steps, root)
        raw["run"] = {**raw["run"], "precision": precision}
        start = time.perf_counter()
        _, hooks = train_locally(validate_spec(raw), cache_dir=root / "cache")
        curves[precision] = {step: m["train/loss"] for step, m in hooks.history if "train/loss" in m}
        print(f"[cpu_curves] precision {precision}: {steps} steps in {time.perf_counter() - start:.0f}s", flush=True)
    return curves


def sharding_curves(kind: str, steps: int, root: Path) -> dict[str, dict[int, float]]:
    curves = {}
    for name, run in SHARDINGS.items():
        raw = base_raw(kind, steps, root)
        raw["name"] = f"cpu-curve-{name}"
        raw["run"] = {**raw["run"], "workers": 2, "cpus_per_worker": 0.5, **run}
        start = time.perf_counter()
        outcome = run_training(validate_spec(raw))
        history = TrackingReader(raw["tracking"]["uri"]).metric_history(outcome.mlflow_run_id, "train/loss")
        curves[name] = {m.step: m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))}
        print(f"[cpu_curves] sharding {name}: {steps} steps in {time.perf_counter() - start:.0f}s", flush=True)
    return curves


def rows_of(part: str, curves: dict[str, dict[int, float]], baseline: str) -> list[Row]:
    rows: list[Row] = []
    for run, curve in curves.items():
        for step, loss in sorted(curve.items()):
            rows.append({"part": part, "run": run, "step": step, "train_loss": loss,
                         "gap": loss - curves[baseline][step]})
    return rows


def summary(rows: list[Row]) -> list[str]:
    lines = []
    for part, run in dict.fromkeys((r["part"], r["run"]) for r in rows):
        gaps = [r for r in rows if r["part"] == part and r["run"] == run]
        largest = max(abs(r["gap"]) for r in gaps)
        lines.append(f"{part:9s} {run:10s} max |gap| {largest:.2e}  last gap {gaps[-1]['gap']:+.2e}  "
                     f"loss {gaps[0]['train_loss']:.3f} -> {gaps[-1]['train_loss']:.3f}")
    return lines


def plot(rows: list[Row], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = list(dict.fromkeys(r["part"] for r in rows))
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 3.6), squeeze=False)
    for ax, part in zip(axes.flat, parts):
        for run in dict.fromkeys(r["run"] for r in rows if r["part"] == part):
            points = [(r["step"], r["gap"]) for r in rows if r["part"] == part and r["run"] == run]
            ax.plot(*zip(*points), linewidth=1.1, marker="o", markersize=2, label=run)
        ax.axhline(0.0, color="grey", linewidth=0.6)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss - baseline (nats)")
        ax.set_title(part)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--part", choices=["precision", "sharding", "all"], default="all")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--kind", default="mha", help="attention kind of the model")
    parser.add_argument("--name", default="cpu_curves", help="file stem of the CSV and plot")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="cpu-curves-") as tmp:
        if args.part in ("precision", "all"):
            rows += rows_of("precision", precision_curves(args.kind, args.steps, Path(tmp) / "p"), "fp32")
        if args.part in ("sharding", "all"):
            rows += rows_of("sharding", sharding_curves(args.kind, args.steps, Path(tmp) / "s"), "ddp")
    folder = results_dir(args.out, torch.device("cpu"))
    csv = write_csv(rows, folder / f"{args.name}.csv")
    png = plot(rows, folder / f"{args.name}.png")
    print("\n".join(summary(rows)))
    print(f"[cpu_curves] wrote {csv} and {png}")
    return rows


if __name__ == "__main__":
    main()
