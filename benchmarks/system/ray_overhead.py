"""What Ray costs: steady-state training throughput with and without Ray Train, and sweep start-up time.

Three measurements on one small masked-LM spec (built-in offline corpus, CPU):

1. Steady-state tokens/s of a one-worker Ray Train run (`orchestrator.launch.run.run_training`), read from the
   `train/tokens_per_s` windows the worker logs every `log_every` steps, against the same training core run
   in this process without Ray (`plain_run`: `orchestrator.launch.local_run.train_locally` on the same spec, so the
   same `Trainer`, seeds, steps and window accounting as the worker; torch threads = the Ray worker's CPUs).
   So this measures Ray against the same core without Ray, not against a different loop. The first window
   (warm-up) is dropped on both sides.
2. Start-up of that run: seconds from the launch call to its first logged metric, against the plain run's
   seconds from its start (task build included) to its first window. Both pay the tokenizer training (fresh cache).
3. Start-up of a sweep (`orchestrator.launch.sweep.run_sweep`, two grid trials, one at a time) to its first
   reported metric, with the tokenizer cache already warm.
4. Start-up of `orchestrator train` as a user runs it, on a warm machine: a fresh `python -m orchestrator
   train spec.yaml --verbose` process (its own local Ray) with the tokenizer cache warm, from the process
   start to its first metric in the MLflow store, and where that time goes: seconds until Ray's "Started a
   local Ray instance" line, until the Train controller's "Started training worker group" line, and until
   the worker's first console step line (each output line is stamped as it arrives), and when each Ray
   actor of the run got its process (`process:TrainController`, `process:RayTrainWorker`, ...: the process
   titles below the launcher, polled every 0.1 s). Against the plain core's first window with a warm cache.
   `--cli-only` measures just this, `--rounds N` times; `--against CHECKOUT` alternates it with another
   checkout's (before/after a change, on the same machine and load).
5. Start-up against Ray's own floor (`--startup`): `orchestrator train` on configs/smoke.yaml's model and task
   (mha, first console metric after 10 steps) against benchmarks/system/bare_ray_train.py (a bare Ray Train V2
   `TorchTrainer`, one worker, a tiny model, one report after 10 steps), each a fresh process with its own
   local Ray, alternated `--rounds` times: seconds to the first metric, when each phase and Ray actor began,
   and the per-round ratio (the two runs of a round ran back to back).

Measurements 1-3 are here; 4 and 5 in benchmarks/system/ray_startup.py; the spec and the plain core they are all
measured against in benchmarks/system/overhead_baseline.py. This module's command line runs them all.

Metric times come from the run's MLflow store, read through orchestrator/tracking/read.py (runs found by their
key tag), so that no code outside orchestrator/ imports mlflow (STYLE.md section 5).

    python -m benchmarks.system.ray_overhead --out benchmarks/results            # full
    python -m benchmarks.system.ray_overhead --quick --out benchmarks/results    # about a minute (Ray start-up)
    python -m benchmarks.system.ray_overhead --compare before.csv after.csv      # plot two runs' rows side by side
    python -m benchmarks.system.ray_overhead --cli-only --rounds 3 --against /tmp/before   # start-up, A/B
    python -m benchmarks.system.ray_overhead --startup --rounds 6                  # against a bare Ray Train run
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.harness import Row, alternating, results_dir, save_figure, write_csv
from benchmarks.system.overhead_baseline import FULL, QUICK, TOKENS_PER_S, Scale, bench_spec, plain_run, steady
from benchmarks.system.ray_startup import measure_cli, measure_startup
from orchestrator.spec import ExperimentSpec, study_from_raw, validate_spec
from orchestrator.tracking.read import TrackingReader


# --- with Ray ------------------------------------------------------------------------------------------


def ray_run(spec: ExperimentSpec, uri: str) -> tuple[list[tuple[int, float]], float]:
    """A one-worker Ray Train run of `spec`: its tokens/s windows and seconds from launch to its first metric."""
    from orchestrator.launch import run_training

    launched_ms = time.time() * 1000
    outcome = run_training(spec)
    assert outcome.mlflow_run_id is not None, "the benchmark needs the MLflow store to read the run's metrics"
    reader = TrackingReader(uri)
    windows = [(point.step, point.value) for point in reader.metric_history(outcome.mlflow_run_id, TOKENS_PER_S)]
    first_ms = reader.first_metric_ms([outcome.mlflow_run_id])
    return windows, math.nan if first_ms is None else (first_ms - launched_ms) / 1000


def measure(scale: Scale, workdir: Path, *, rounds: int = 1, sweep: bool = True) -> list[Row]:
    """Measurements 1-3. With `rounds` > 1 the steady state is measured in that many (plain, Ray) pairs, the
    order swapped every round, so that load from other processes on a shared machine hits both sides alike;
    the rounds after the first train half as many steps (their caches are warm)."""
    from orchestrator.launch import run_sweep

    storage, uri = workdir / "runs", f"sqlite:///{workdir / 'mlflow.db'}"
    run_spec = validate_spec(bench_spec("ray-overhead-run", scale, storage, uri))

    plain = plain_run(run_spec, workdir / "plain-cache")  # its own, cold cache: same start-up work as the run
    ray_windows, run_startup = ray_run(run_spec, uri)
    ray_steadies, plain_steadies = [steady(ray_windows, scale.max_steps)], [steady(plain.windows, scale.max_steps)]
    later = Scale(**{**scale.__dict__, "max_steps": max(scale.max_steps // 2, 4 * scale.log_every)})

    def later_spec(index: int) -> ExperimentSpec:  # one run name per round, the same on both sides
        return validate_spec(bench_spec(f"ray-overhead-run-{index + 1}", later, storage, uri))

    later_rounds = alternating({
        "ray": lambda i: steady(ray_run(later_spec(i), uri)[0], later.max_steps),
        "plain": lambda i: steady(plain_run(later_spec(i), workdir / "plain-cache").windows, later.max_steps),
    }, rounds - 1)
    ray_steadies += later_rounds["ray"]
    plain_steadies += later_rounds["plain"]

    common = {"d_model": scale.d_model, "layers": scale.layers, "seq_len": scale.seq_len,
              "batch_size": scale.batch_size, "max_steps": scale.max_steps, "log_every": scale.log_every,
              "threads": scale.cpus}
    ratios = [r / p for r, p in zip(ray_steadies, plain_steadies)]
    rows = [
        {"measurement": "steady_tokens_per_s", "ray": statistics.median(ray_steadies),
         "plain": statistics.median(plain_steadies), "windows": f"{len(ray_windows)}/{len(plain.windows)}",
         "rounds": rounds, "round_ratios": " ".join(f"{r:.3f}" for r in ratios),
         "median_round_ratio": statistics.median(ratios), **common},
        {"measurement": "run_seconds_to_first_metric", "ray": run_startup, "plain": plain.first_window_s,
         "windows": "cold tokenizer cache", **common},
    ]
    if sweep:
        sweep_raw = bench_spec("ray-overhead-sweep", scale, storage, uri)
        sweep_raw["optim"]["seed"] = {"grid": [0, 1]}
        sweep_started_ms = time.time() * 1000
        outcome = run_sweep(study_from_raw(sweep_raw))
        child_ids = [t["mlflow_run_id"] for t in outcome.trials if t.get("mlflow_run_id")]
        sweep_first_ms = TrackingReader(uri).first_metric_ms(child_ids)
        sweep_startup = math.nan if sweep_first_ms is None else (sweep_first_ms - sweep_started_ms) / 1000
        rows.append({"measurement": "sweep_seconds_to_first_metric", "ray": sweep_startup, "plain": plain.first_window_s,
                     "windows": f"warm cache; {len(outcome.trials)} trials; errors {outcome.errors}", **common})
    return rows


def plot_comparison(before: Path, after: Path, path: Path) -> Path:
    """Two CSVs of this benchmark (e.g. before and after a change, same machine) side by side: the Ray / plain
    throughput ratio, and the seconds to the first metric of each start-up measurement."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    from benchmarks.harness import read_csv

    runs = {"before": {r["measurement"]: r for r in read_csv(before)},
            "after": {r["measurement"]: r for r in read_csv(after)}}
    startups = [m for m in runs["after"] if m.endswith("seconds_to_first_metric") and m in runs["before"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1, 3]})
    for offset, (label, rows) in zip((-0.2, 0.2), runs.items()):
        ratio = float(rows["steady_tokens_per_s"]["ray_over_plain"])
        left.bar([offset], [ratio], width=0.4, label=label)
        left.annotate(f"{ratio:.2f}", (offset, ratio), ha="center", va="bottom", fontsize=8)
        seconds = [float(rows[m]["ray"]) for m in startups]
        xs = [i + offset for i in range(len(startups))]
        right.bar(xs, seconds, width=0.4, label=label)
        for x, value in zip(xs, seconds):
            right.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom", fontsize=8)
    left.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    left.set_xticks([])
    left.set_title("steady tokens/s, Ray / plain", fontsize=9)
    right.set_xticks(range(len(startups)), [m.replace("_seconds_to_first_metric", "") for m in startups])
    right.set_title("seconds from launch to the first metric (with Ray)", fontsize=9)
    right.legend(fontsize=8)
    return save_figure(fig, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="results root; files go to <out>/<machine>/")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 12 steps (Ray start-up dominates)")
    parser.add_argument("--max-steps", type=int, default=None, help="override the scale's steps")
    parser.add_argument("--workdir", default=None, help="runs + MLflow store (default: a fresh temporary folder)")
    parser.add_argument("--name", default="ray_overhead", help="file stem of the CSV")
    parser.add_argument("--cli-only", action="store_true", help="only measurement 4 (warm `orchestrator train`)")
    parser.add_argument("--rounds", type=int, default=1, help="(plain, Ray) pairs for the steady state, order "
                        "swapped each round (a shared machine's load then hits both sides alike); with --cli-only, "
                        "`orchestrator train` start-ups per checkout")
    parser.add_argument("--startup", action="store_true", help="only measurement 5: `orchestrator train` on the "
                        "smoke spec against a bare Ray Train V2 run (benchmarks/system/bare_ray_train.py), "
                        "--rounds times")
    parser.add_argument("--no-sweep", action="store_true", help="skip measurement 3 (the two-trial sweep)")
    parser.add_argument("--against", default=None, metavar="CHECKOUT",
                        help="with --cli-only: another checkout of this project (e.g. `git worktree add /tmp/before "
                        "HEAD~1`), whose `orchestrator train` alternates with this one's --rounds times")
    parser.add_argument("--address", default=None, help="with --cli-only: join this running Ray (e.g. `ray start "
                        "--head --num-cpus 2 --port 6390`) instead of starting one per run")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE_CSV", "AFTER_CSV"),
                        help="no measurement: plot two CSVs of this benchmark side by side (next to AFTER_CSV)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.compare:
        before, after = map(Path, args.compare)
        print(f"wrote {plot_comparison(before, after, after.with_name(after.stem + '_vs_before.png'))}")
        return []
    scale = QUICK if args.quick else FULL
    if args.max_steps:
        scale = Scale(**{**scale.__dict__, "max_steps": args.max_steps})
    with tempfile.TemporaryDirectory(prefix="ray-overhead-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        if (workdir / "runs").exists():
            raise SystemExit(f"--workdir {workdir} already holds runs/; give an empty folder (runs are not reused)")
        if args.startup:
            rows = measure_startup(workdir, rounds=args.rounds)
        elif args.cli_only:
            rows = []
        else:
            rows = measure(scale, workdir, rounds=args.rounds, sweep=not args.no_sweep)
        rows += [] if args.startup else measure_cli(scale, workdir, rounds=args.rounds if args.cli_only else 1,
                            against=Path(args.against) if args.against else None, address=args.address)
        for row in rows:
            plain = row["plain"]
            row["ray_over_plain"] = row["ray"] / plain if plain and math.isfinite(plain) else math.nan
            row["ray_minus_plain"] = row["ray"] - plain
    for row in rows:
        against = f"  against {row['against']:10.2f}" if "against" in row else ""
        print(f"{row['measurement']:48s} ray {row['ray']:10.2f}  plain {row['plain']:10.2f}  "
              f"ratio {row['ray_over_plain']:.3f}{against}", flush=True)
        if "round_ratios" in row and "median_round_ratio" in row and row["measurement"].startswith("startup"):
            print(f"{'':48s} per round: {row['round_ratios']} (median {row['median_round_ratio']:.3f})", flush=True)
    print(f"wrote {write_csv(rows, results_dir(args.out, torch.device('cpu')) / f'{args.name}.csv')}")
    return rows


if __name__ == "__main__":
    main()
