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
   (mha, first console metric after 10 steps) against benchmarks/bare_ray_train.py (a bare Ray Train V2
   `TorchTrainer`, one worker, a tiny model, one report after 10 steps), each a fresh process with its own
   local Ray, alternated `--rounds` times: seconds to the first metric, when each phase and Ray actor began,
   and the per-round ratio (the two runs of a round ran back to back).

Metric times come from the run's MLflow store, read through orchestrator/tracking/read.py (runs found by their
key tag), so that no code outside orchestrator/ imports mlflow (STYLE.md section 5).

    python -m benchmarks.ray_overhead --out benchmarks/results            # full
    python -m benchmarks.ray_overhead --quick --out benchmarks/results    # about a minute (Ray start-up)
    python -m benchmarks.ray_overhead --compare before.csv after.csv      # plot two runs' rows side by side
    python -m benchmarks.ray_overhead --cli-only --rounds 3 --against /tmp/before   # start-up, A/B
    python -m benchmarks.ray_overhead --startup --rounds 6                          # against a bare Ray Train run
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Row, alternating, results_dir, save_figure, write_csv
from orchestrator.launch import train_locally
from orchestrator.spec import (
    ExperimentSpec,
    load_spec,
    spec_to_yaml,
    study_from_raw,
    validate_spec,
)
from orchestrator.storage import RunLayout
from orchestrator.tracking.describe import RUN_KEY_TAG
from orchestrator.tracking.read import TrackingReader

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


# --- `orchestrator train` as a user starts it ---------------------------------------------------------------

PHASES = {
    "ray_started": re.compile(r"Started a local Ray instance"),
    "workers_started": re.compile(r"Started training worker group"),
    "first_console_step": re.compile(r"\] step \d+/\d+"),
}


RAY_PROCESS = re.compile(r"^ray::(_?[A-Z][A-Za-z_]*)")
"""A Ray worker's process title names its actor class (or `IDLE`; a task's is lower case): when each of a
run's actors got its process."""


@dataclass(frozen=True)
class Checkout:
    """A source tree whose `orchestrator train` is timed: this one, or another (`--against`)."""
    label: str
    root: Path


def watched(cmd: Sequence[str], cwd: Path, env: Mapping[str, str], label: str) -> tuple[dict[str, float], float]:
    """Run `cmd` to its end: seconds from its start to each phase's first output line (`PHASES`) and to the
    first time each Ray actor's process title appears below it (`process:<Actor>`, polled every 0.1 s), and
    the wall time (epoch seconds) of its start."""
    import threading

    import psutil

    seen: dict[str, float] = {}
    started, start = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []

    def read() -> None:
        nonlocal tail
        for line in proc.stdout:
            tail = (tail + [line])[-30:]
            for phase, pattern in PHASES.items():
                if phase not in seen and pattern.search(line):
                    seen[phase] = time.perf_counter() - start

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    launcher = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            children = launcher.children(recursive=True)
        except psutil.Error:
            break
        for child in children:
            try:
                match = RAY_PROCESS.match(" ".join(child.cmdline()))
            except psutil.Error:
                continue
            if match and match.group(1) != "IDLE":
                seen.setdefault(f"process:{match.group(1)}", time.perf_counter() - start)
        time.sleep(0.1)
    reader.join()
    if proc.wait() != 0:
        raise RuntimeError(f"{label} failed:\n{''.join(tail)}")
    return seen, started


def print_round(round_: int, label: str, phases: dict[str, float]) -> dict[str, float]:
    """One timed process's phases as a progress line; returns them."""
    print(f"round {round_} {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    return phases


def cli_run(path: Path, name: str, uri: str, workdir: Path, checkout: Checkout,
            address: str | None = None) -> dict[str, float]:
    """`python -m orchestrator train PATH name=NAME` from `checkout` in a fresh process (`watched`), and the
    seconds from its start to its first metric in the MLflow store."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout.root), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)  # its own local Ray, as a user's first command starts, unless told to join one
    if address:
        env["RAY_ADDRESS"] = address
    seen, started = watched([sys.executable, "-u", "-m", "orchestrator", "train", str(path), f"name={name}",
                             "--verbose"], workdir, env, f"orchestrator train ({checkout.label})")
    spec = load_spec(path, [f"name={name}"])  # found by its key: its storage folder
    reader = TrackingReader(uri)
    run_id = reader.run_of(spec.tracking.experiment, RUN_KEY_TAG, RunLayout(spec.run.storage_path, name).folder)
    first_ms = reader.first_metric_ms([run_id])
    seen["first_metric"] = math.nan if first_ms is None else first_ms / 1000 - started
    return seen


def bare_run(workdir: Path, round_: int) -> dict[str, float]:
    """benchmarks/bare_ray_train.py in a fresh process with its own local Ray (`watched`), and the seconds
    from its start to its worker's report."""
    stamp, env = workdir / f"bare-{round_}.stamp", {**os.environ}
    env.pop("RAY_ADDRESS", None)
    seen, started = watched([sys.executable, "-u", str(Path(__file__).with_name("bare_ray_train.py")), str(stamp),
                             str(workdir / "bare-runs")], workdir, env, "the bare Ray Train run")
    seen["first_metric"] = float(stamp.read_text()) - started
    return seen


def measure_cli(scale: Scale, workdir: Path, *, rounds: int = 1, against: Path | None = None,
                address: str | None = None) -> list[Row]:
    """Measurement 4: warm the tokenizer cache (and the OS's file cache) with a plain run, then time fresh
    `orchestrator train` processes against a second, warm plain run; all stop after their first window.
    With `against` (another checkout), its `orchestrator train` alternates with this one's, `rounds` times
    each, order swapped every round (a shared machine's load then hits both alike): medians per checkout.
    With `address`, every run joins that running Ray instead of starting its own."""
    storage, uri = workdir / "runs", f"sqlite:///{workdir / 'mlflow.db'}"
    short = Scale(**{**scale.__dict__, "max_steps": scale.log_every})
    warm_cache = workdir / "runs" / ".cache"
    raw = bench_spec("ray-overhead-cli", short, storage, uri)
    raw["run"]["final_eval"] = False
    spec = validate_spec(raw)
    path = workdir / f"{spec.name}.yaml"
    path.write_text(spec_to_yaml(spec))
    plain_run(spec, warm_cache)  # fills the cache the launcher's runs share (run.storage_path/.cache)
    plain = plain_run(spec, warm_cache)
    checkouts = [Checkout("this", Path.cwd())] + ([Checkout("against", against.resolve())] if against else [])

    def timed(round_: int, checkout: Checkout) -> dict[str, float]:
        return print_round(round_, checkout.label,
                           cli_run(path, f"cli-{checkout.label}-{round_}", uri, workdir, checkout, address))

    samples = alternating({c.label: partial(timed, checkout=c) for c in checkouts}, rounds)
    common = {"d_model": scale.d_model, "layers": scale.layers, "seq_len": scale.seq_len,
              "batch_size": scale.batch_size, "max_steps": short.max_steps, "log_every": scale.log_every,
              "threads": scale.cpus, "rounds": rounds, "ray_instance": f"joined {address}" if address else "local, per run"}
    keys = ["first_metric", *PHASES]
    keys += sorted({k for runs in samples.values() for phases in runs for k in phases if k not in keys},
                   key=lambda k: statistics.median(p.get(k, math.inf) for p in samples["this"]))

    def median(label: str, key: str) -> float:
        values = [p[key] for p in samples[label] if key in p]
        return statistics.median(values) if values else math.nan

    rows: list[Row] = []
    for key in keys:
        row: Row = {"measurement": f"cli_warm_seconds_to_{key}", "ray": median("this", key),
                    "plain": plain.first_window_s if key == "first_metric" else math.nan,
                    "windows": "warm cache; fresh process" if key == "first_metric" else "phase of the run above",
                    "samples": ";".join(f"{p.get(key, math.nan):.2f}" for p in samples["this"]), **common}
        if against is not None:
            row["against"] = median("against", key)
            row["against_samples"] = ";".join(f"{p.get(key, math.nan):.2f}" for p in samples["against"])
        rows.append(row)
    return rows


def smoke_startup_spec(workdir: Path) -> Path:
    """configs/smoke.yaml's model and task as `orchestrator train` runs them, mha, its first console metric
    after 10 steps (the bare run's report comes after 10 steps too), no evaluation or checkpoint before it."""
    import yaml

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml").read_text())
    raw["name"] = "startup"
    raw["model"]["attention"] = {"kind": "mha", "heads": 4}
    raw["optim"].update(max_steps=10, warmup_steps=2)
    raw["run"].update(log_every=10, eval_every=10, checkpoint_every=10, final_eval=False,
                      storage_path=str(workdir / "runs"))
    raw["tracking"] = {"uri": f"sqlite:///{workdir / 'mlflow.db'}"}
    raw.pop("tune", None)
    path = workdir / "startup.yaml"
    path.write_text(spec_to_yaml(validate_spec(raw)))
    return path


def measure_startup(workdir: Path, *, rounds: int) -> list[Row]:
    """Measurement 5: the bare Ray Train V2 run (bare_ray_train.py) and `orchestrator train` on the smoke
    spec, each a fresh process with its own local Ray, alternated `rounds` times (order swapped every round,
    so a shared machine's load drift hits both alike) after one untimed run of each (OS file cache, tokenizer
    cache). The ratio of the medians is what the project adds above Ray's own floor."""
    path, uri = smoke_startup_spec(workdir), f"sqlite:///{workdir / 'mlflow.db'}"
    here = Checkout("this", Path.cwd())
    bare_run(workdir, -1)
    cli_run(path, "warm-up", uri, workdir, here)

    samples = alternating({
        "bare": lambda round_: print_round(round_, "bare", bare_run(workdir, round_)),
        "orchestrator": lambda round_: print_round(round_, "orchestrator", cli_run(
            path, f"startup-{round_}", uri, workdir, here)),
    }, rounds)
    ours, bare = samples["orchestrator"], samples["bare"]
    keys = ["first_metric", *PHASES]
    keys += sorted({k for phases in ours + bare for k in phases if k not in keys},
                   key=lambda k: statistics.median(p.get(k, math.inf) for p in ours + bare))
    rows: list[Row] = []
    for key in keys:
        values, floor = [p[key] for p in ours if key in p], [p[key] for p in bare if key in p]
        rows.append({"measurement": f"startup_seconds_to_{key}",
                     "ray": statistics.median(values) if values else math.nan,
                     "plain": statistics.median(floor) if floor else math.nan,
                     "windows": "ray: orchestrator train, smoke spec, mha, 10 steps; plain: a bare Ray Train run",
                     "samples": ";".join(f"{v:.2f}" for v in values),
                     "plain_samples": ";".join(f"{v:.2f}" for v in floor),
                     "rounds": rounds, "load_avg_1min": os.getloadavg()[0]})
    # Paired within each round (the two ran back to back): the ratio a shared machine's load drift moves least.
    ratios = [p["first_metric"] / b["first_metric"] for p, b in zip(ours, bare)]
    rows[0].update(round_ratios=";".join(f"{r:.3f}" for r in ratios), median_round_ratio=statistics.median(ratios))
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
                        "smoke spec against a bare Ray Train V2 run (benchmarks/bare_ray_train.py), --rounds times")
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
