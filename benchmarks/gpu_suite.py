"""One command for a GPU: every GPU measurement of the project in one run, written under the GPU's name.

    python -m benchmarks.gpu_suite --out benchmarks/results             # on one CUDA GPU
    python -m benchmarks.gpu_suite --dry-run --out /tmp/gpu-suite      # every part at toy sizes on the CPU
    python -m benchmarks.gpu_suite --parts flash_vs_sdpa train_step ... # a subset

Parts, each in its own module, each writing `<out>/<machine label>/gpu_<part>.csv`:
- `kernel_parity` (gpu_parity.py): the flash and sorted-chunk Triton kernels against the PyTorch reference:
  forward, backward and the lse gradient; causal and padded; fp32, bf16, fp16; lengths that are and are not
  block multiples; head dims 64 and 128; max errors against stated tolerances.
- `flash_vs_sdpa` (gpu_speed.py): the fused flash kernel against SDPA's flash backend in TFLOP/s, n = 1k ... 16k,
  causal and not, bf16.
- `long_attention` (gpu_speed.py): the sorted-chunk kernel and the lsh / hyper / linformer layers against SDPA,
  forward + backward, n = 4k ... 128k; sizes that run out of memory are recorded and skipped.
- `train_step` (gpu_training.py): an mha LM's training step at n = 1024, bf16 autocast, torch.compile: tokens/s
  and MFU against the analytic FLOPs.
- `sweep` (gpu_sweep.py): a 2-trial `orchestrator sweep` with bf16, FSDP and compile, checked in MLflow.
The summary, `gpu_suite_summary.md` in the same folder, lists every part with its status: `ok` (on a GPU),
`dry-run` (ran to the end at toy sizes), `fail: ...` (a check missed its bound), `error: ...` (it raised; the
suite goes on with the next part) or `not run`. The exit status is 0 only when every part run is ok / dry-run.
The parts were sized to take about 9 minutes on one H100 in all; that is an estimate until the suite has run
on one (each part's time is in the summary).

The dry run exists so the suite cannot rot before a GPU is lent (tests/test_gpu_suite.py runs it in the fast
tier). Its Triton kernels run under the interpreter, TRITON_INTERPRET=1, which has to be set before triton is
imported: Triton decides at each `@triton.jit` decoration whether the function is compiled or interpreted, and
triton's own helpers that the kernels call (`tl.sigmoid`, the reductions of triton/language/standard.py) are
decorated when triton is imported; an interpreted kernel calling a compiled helper fails ("Cannot call
@triton.jit'd outside of the scope of a kernel"). Nothing that `python -m benchmarks.gpu_suite` imports before
the parts' modules imports triton (kernels/k_*.py are imported on a kernel's first call), so `main` sets the
variable and then runs the parts (`part_table`: each part's module is imported when the part runs). Where this
process already imported triton compiled (a caller that imported torch._dynamo or torch.utils.flop_counter, which
import it, or ran the kernels on a GPU), setting it would be too late: the dry run then runs itself again in a
fresh Python process with the variable set. A GPU run refuses TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.harness import describe_error, machine_label, results_dir, write_csv

PARTS = ("kernel_parity", "flash_vs_sdpa", "long_attention", "train_step", "sweep")
SUMMARY = "gpu_suite_summary.md"
INTERPRET = "TRITON_INTERPRET"
ROOT = Path(__file__).resolve().parents[1]


def part_table() -> dict[str, tuple[str, Callable]]:
    """Part name -> (what it measures, its function). Each part's module is imported when the part runs, not here
    or at the top: see the module docstring for triton; and the sweep's module imports Ray, MLflow and the
    launcher (seconds of start-up) that a run of the other parts never uses."""
    return {
        "kernel_parity": (("Triton flash and sorted-chunk kernels vs the PyTorch reference: out, lse, gradients "
                           "(with and through lse alone); fp32 / bf16 / fp16, head dims 64 / 128"),
                          _part("gpu_parity", "run")),
        "flash_vs_sdpa": ("fused flash kernel vs SDPA flash backend, TFLOP/s, bf16, n = 1k-16k, causal and not",
                          _part("gpu_speed", "run_flash")),
        "long_attention": (("sorted-chunk kernel and lsh / hyper / linformer layers vs SDPA, fwd+bwd, bf16, "
                            "n = 4k-128k"), _part("gpu_speed", "run_long")),
        "train_step": ("mha LM training step, n = 1024, bf16 autocast, torch.compile: tokens/s and MFU",
                       _part("gpu_training", "run")),
        "sweep": ("2-trial orchestrator sweep, bf16 + fsdp + compile, MLflow runs checked", _part("gpu_sweep", "run")),
    }


def _part(module: str, function: str) -> Callable:
    """benchmarks.<module>.<function>, imported at its first call (an import error is the part's error row)."""

    def run(ctx):
        return getattr(importlib.import_module(f"benchmarks.{module}"), function)(ctx)

    run.__qualname__ = f"{module}.{function}"
    return run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="results root; files go to <out>/<machine>/")
    parser.add_argument("--dry-run", action="store_true",
                        help="every part at toy sizes on the CPU, Triton kernels under the interpreter")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts")
    return parser.parse_args(argv)


def triton_imported_compiled() -> bool:
    """Triton's own @triton.jit helpers, or our kernels, were defined in this process without the interpreter:
    too late to switch it on here (see the module docstring)."""
    if "triton" not in sys.modules:
        return False
    import triton.language.standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    jitted = [triton.language.standard.sigmoid]
    jitted += [value for name, module in list(sys.modules.items()) if name.startswith("kernels.k_")
               for value in vars(module).values() if isinstance(value, JITFunction)]
    return not all(isinstance(fn, InterpretedFunction) for fn in jitted)


def rerun_with_interpreter(argv: Sequence[str]) -> int:
    print(f"gpu_suite: triton was already imported without its interpreter in this process; running the dry run in "
          f"a fresh process with {INTERPRET}=1", flush=True)
    # This working directory (a relative --out means the same folder), with the checkout importable from it.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, INTERPRET: "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", *argv], env=env, check=False).returncode


def versions() -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return f"torch {torch.__version__}, triton {triton_version}, Python {platform.python_version()}"


def cell(text: object) -> str:
    """A markdown table cell: one line, no pipe."""
    return " ".join(str(text).split()).replace("|", "/")


def write_summary(folder: Path, device_name: str, args: argparse.Namespace, results: dict[str, dict]) -> Path:
    table = part_table()
    mode = "dry run (toy sizes on the CPU; Triton under the interpreter)" if args.dry_run else "GPU run"
    command = "python -m benchmarks.gpu_suite" + (" --dry-run" if args.dry_run else "")
    if list(args.parts) != list(PARTS):
        command += " --parts " + " ".join(args.parts)
    lines = [
        f"# GPU suite: {device_name}",
        "",
        f"`{command}`: {mode}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {versions()}.",
        "Written by benchmarks/gpu_suite.py; each part's rows are in its CSV. A dry run's times are not results.",
        "",
        "| part | measures | status | rows | time (s) | file | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in PARTS:
        what = table[name][0]
        result = results.get(name)
        if result is None:
            lines.append(f"| {name} | {cell(what)} | not run | | | | not in --parts |")
            continue
        settings = ", ".join(f"{key} {value}" for key, value in result["settings"].items())
        notes = "; ".join(part for part in (result["note"], settings) if part)
        lines.append(f"| {name} | {cell(what)} | {cell(result['status'])} | {result['rows']} | "
                     f"{result['seconds']:.1f} | {result['file']} | {cell(notes)} |")
    path = folder / SUMMARY
    path.write_text("\n".join(lines) + "\n")
    return path


def run_part(name: str, fn: Callable, ctx, index: int) -> dict:
    """Run one part; an exception becomes its status (the suite goes on), with the traceback on stderr."""
    print(f"[{index}/{len(PARTS)}] {name}", flush=True)
    start = time.perf_counter()
    try:
        result = fn(ctx)
    except Exception as err:  # noqa: BLE001 - a part that raises is a row of the summary, not the suite's end
        traceback.print_exc()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        seconds = time.perf_counter() - start
        print(f"[{index}/{len(PARTS)}] {name}: {describe_error(err)} ({seconds:.1f} s)", flush=True)
        return {"status": describe_error(err), "rows": 0, "seconds": seconds, "file": "", "note": "", "settings": {}}
    seconds = time.perf_counter() - start
    csv_path = write_csv(result.rows, ctx.folder / f"gpu_{name}.csv") if result.rows else None
    print(f"[{index}/{len(PARTS)}] {name}: {result.status} ({seconds:.1f} s)", flush=True)
    return {"status": result.status, "rows": len(result.rows), "seconds": seconds,
            "file": csv_path.name if csv_path else "", "note": result.note, "settings": result.settings}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        if triton_imported_compiled():
            return rerun_with_interpreter(argv)
        os.environ[INTERPRET] = "1"  # before the parts' modules are imported: see the module docstring
        device = torch.device("cpu")
    else:
        if os.environ.get(INTERPRET) == "1":
            print(f"gpu_suite: {INTERPRET}=1 would run the Triton kernels in the interpreter; unset it for a GPU run")
            return 2
        if not torch.cuda.is_available():
            print("gpu_suite: no CUDA GPU here. `--dry-run` runs every part at toy sizes on the CPU.")
            return 2
        device = torch.device("cuda")
    from benchmarks.gpu_common import SuiteContext

    table = part_table()
    ctx = SuiteContext(device=device, dry_run=args.dry_run, folder=results_dir(args.out, device))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine_label(device)
    print(f"gpu_suite: {device_name}, {'dry run' if args.dry_run else 'GPU run'}, writing to {ctx.folder}", flush=True)
    start = time.perf_counter()
    results = {name: run_part(name, table[name][1], ctx, index)
               for index, name in enumerate(PARTS, 1) if name in args.parts}
    summary = write_summary(ctx.folder, device_name, args, results)
    print(f"gpu_suite: {time.perf_counter() - start:.0f} s in all; wrote {summary}", flush=True)
    return 0 if all(r["status"] in ("ok", "dry-run") for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
