"""What counting costs (issue 48): `orchestrator plan` of every study, and the `flops_per_token` a Ray worker counts
before it trains.

    python -m benchmarks.system.plan_cost                  # both, printed
    python -m benchmarks.system.plan_cost --part worker    # the worker's count only

- `studies`: the wall time of `python -m orchestrator plan configs/studies/<name>.yaml --gpu H100`, each in a fresh
  process as a user runs it (imports included), and the study's GPU-hours from its last line.
- `worker`: in a fresh process with the worker's imports, CPU and wall seconds of `Trainer.create` and then of the
  first and later `flops_per_token` counts of a test-sized model (the order worker.py counts in: AdamW, built by
  Trainer.create, has already imported torch._dynamo, which FakeTensorMode and FlopCounterMode need, so the first
  count does not pay for that import).
Wall times depend on what else the machine runs; the worker's CPU seconds much less.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "configs" / "studies"

WORKER_SCRIPT = """
import time
from pathlib import Path
import orchestrator.launch.worker  # noqa: F401 - what a Train worker has imported
from orchestrator.spec import validate_spec
from orchestrator.spec.counting import flops_per_token
from orchestrator.training import Trainer
from tasks import WorkerContext

def spec(kind, **knobs):
    return validate_spec({"name": "cost", "task": {"kind": "mlm", "dataset": "builtin", "seq_len": 16, "batch_size": 4,
                          "vocab_size": 120, "builtin": {"train_sentences": 300, "eval_sentences": 30}},
                          "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16,
                                    "attention": {"kind": kind, "heads": 2, **knobs}}})

def timed(label, fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    print(f"{label}: wall {time.perf_counter() - wall:.2f} s, cpu {time.process_time() - cpu:.2f} s", flush=True)
    return out

timed("Trainer.create (mha)", lambda: Trainer.create(spec("mha"), WorkerContext(seed=0, cache_dir=Path(CACHE))))
for kind, knobs in (("mha", {}), ("mhe", {"mode": "mul"}), ("lsh", {"bucket_size": 8})):
    timed(f"flops_per_token ({kind})", lambda: flops_per_token(spec(kind, **knobs)))
"""


def run_worker(cache: Path) -> None:
    code = WORKER_SCRIPT.replace("CACHE", repr(str(cache)))
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def run_studies() -> None:
    for path in sorted(STUDIES.glob("*.yaml")):
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "orchestrator", "plan", str(path.relative_to(ROOT)), "--gpu",
                                 "H100"], cwd=ROOT, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        total = re.search(r"study: ([\d,]+) trials, ([\d.e+]+) GPU-hours", result.stdout)
        summary = f"{total.group(1)} trials, {total.group(2)} GPU-hours" if total else result.stderr.strip()[-200:]
        print(f"{path.name}: {seconds:.1f} s, exit {result.returncode}, {summary}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("studies", "worker", "all"), default="all")
    parser.add_argument("--cache", default="/tmp/plan-cost-cache", help="the worker's tokenizer cache")
    args = parser.parse_args(argv)
    if args.part in ("worker", "all"):
        run_worker(Path(args.cache))
    if args.part in ("studies", "all"):
        run_studies()
    return 0


if __name__ == "__main__":
    sys.exit(main())
