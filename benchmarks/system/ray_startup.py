"""Start-up of `orchestrator train` as a user runs it (measurements 4 and 5 of benchmarks/system/ray_overhead.py, whose
docstring and command line run them): a fresh process with its own local Ray, from the process start to its
first metric, where that time goes (Ray's phases, when each Ray actor got its process), against the plain
core's first window, another checkout's start-up (`--against`) or a bare Ray Train V2 run
(benchmarks/system/bare_ray_train.py)."""

from __future__ import annotations

import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from benchmarks.harness import Row, alternating
from benchmarks.system.overhead_baseline import Scale, bench_spec, plain_run
from orchestrator.spec import load_spec, spec_to_yaml, validate_spec
from orchestrator.storage import RunLayout
from orchestrator.tracking.describe import RUN_KEY_TAG
from orchestrator.tracking.read import TrackingReader


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



def finite_median(values: list[float]) -> float:
    """The median of the finite values (a round whose run logged no metric is NaN there; `statistics.median`
    over a list holding NaN returns a value that depends on where the NaN sits); NaN when none is finite."""
    finite = [value for value in values if math.isfinite(value)]
    return statistics.median(finite) if finite else math.nan

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
    """benchmarks/system/bare_ray_train.py in a fresh process with its own local Ray (`watched`), and the seconds
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
        return finite_median(values)

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

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml").read_text())
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
                     "ray": finite_median(values), "plain": finite_median(floor),
                     "windows": "ray: orchestrator train, smoke spec, mha, 10 steps; plain: a bare Ray Train run",
                     "samples": ";".join(f"{v:.2f}" for v in values),
                     "plain_samples": ";".join(f"{v:.2f}" for v in floor),
                     "rounds": rounds, "load_avg_1min": os.getloadavg()[0]})
    # Paired within each round (the two ran back to back): the ratio a shared machine's load drift moves least.
    ratios = [p["first_metric"] / b["first_metric"] for p, b in zip(ours, bare)]
    rows[0].update(round_ratios=";".join(f"{r:.3f}" for r in ratios), median_round_ratio=finite_median(ratios))
    return rows
