"""Golden losses: the training core's numerics on a tiny causal-LM spec, step by step, against stored values.

A refactor of the loop (accumulation, clipping, schedule, seeding, data order, dropout streams) that is not
meant to change numerics must reproduce tests/assets/golden_losses.json; one that is meant to rewrites it
(`python -m tests.test_golden_loss --write`) and says why in its commit. The stored values were first
written by the Ray worker's own loop, so this also pins the core to what `orchestrator train` computed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from orchestrator.launch.local_run import train_locally
from orchestrator.spec import validate_spec

GOLDEN = Path(__file__).parent / "assets" / "golden_losses.json"
KEYS = ("train/loss", "val/loss", "lr")
# CPU kernels may differ in the last bits between processor generations; every loop bug tried (see the
# commit of this test) moved a loss by more than 1e-3.
TOLERANCE = 1e-5


def run_golden(cache_dir: Path) -> dict[str, dict[str, float]]:
    spec = validate_spec(json.loads(GOLDEN.read_text())["spec"])
    _, hooks = train_locally(spec, cache_dir=cache_dir)
    out: dict[str, dict[str, float]] = {key: {} for key in KEYS}
    for step, metrics in hooks.history:
        for key in KEYS:
            if key in metrics:
                out[key][str(step)] = metrics[key]
    return out


def test_core_reproduces_golden_losses(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    got = run_golden(tmp_path / "cache")
    for key in KEYS:
        assert got[key].keys() == golden[key].keys(), f"{key} was logged at other steps"
        for step, expected in golden[key].items():
            assert got[key][step] == pytest.approx(expected, abs=TOLERANCE, rel=0), f"{key} at step {step}"


def main() -> None:
    parser = argparse.ArgumentParser(description="rewrite the golden losses from the current training core")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        got = run_golden(Path(tmp))
    if args.write:
        golden = json.loads(GOLDEN.read_text())
        golden.update(got)
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(json.dumps(got["train/loss"]))


if __name__ == "__main__":
    main()
