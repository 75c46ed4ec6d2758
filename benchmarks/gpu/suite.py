"""One command for a GPU: every GPU measurement of the project in one run, written under the GPU's name.

    python -m benchmarks.gpu.suite --out benchmarks/results             # on one CUDA GPU
    python -m benchmarks.gpu.suite --dry-run --out /tmp/gpu-suite      # every part at toy sizes on the CPU
    python -m benchmarks.gpu.suite --parts flash_vs_sdpa train_step ... # a subset

Parts, each in its own module, each writing `<out>/<machine label>/gpu_<part>.csv`:
- `kernel_parity` (parity.py): the flash and sorted-chunk Triton kernels against the PyTorch reference:
  forward, backward and the lse gradient; causal and padded; fp32, bf16, fp16; lengths that are and are not
  block multiples; head dims 64 and 128; max errors against stated tolerances.
- `flash_vs_sdpa` (speed.py): the fused flash kernel against SDPA's flash backend in TFLOP/s, n = 1k ... 16k,
  causal and not, bf16.
- `long_attention` (speed.py): the sorted-chunk kernel and the lsh (2 and 4 hash rounds) / hyper / linformer layers against SDPA,
  forward + backward, n = 4k ... 128k; sizes that run out of memory are recorded and skipped.
- `attention_profile` (attention_profile.py): where the mha / lsh / hyper layers' time goes (host and device time,
  kernels, values read back from the device, the top kernels).
- `train_step` (training.py): an mha LM's training step at n = 1024, bf16 autocast, torch.compile: tokens/s
  and MFU against the analytic FLOPs.
- `sweep` (sweep.py): a 2-trial `orchestrator sweep` with bf16, FSDP and compile, checked in MLflow.
The summary, `gpu_suite_summary.md` in the same folder, lists every part with its status: `ok` (on a GPU),
`dry-run` (ran to the end at toy sizes), `fail: ...` (a check missed its bound), `error: ...` (it raised; the
suite goes on with the next part), `stopped`, `skipped` or `not run`; and, in its `run` column, what ran: `ran`,
`shrunk: k of n cases ...`, `skipped: needs ~s ...` or `stopped by SIGTERM during case ...`. The exit status is 0
only when every part run is ok / dry-run (a part the budget skipped does not count against it).

Nothing lost to a time limit: each part appends every finished case's rows to its CSV at once
(common.PartLog), and the summary is rewritten before the first part and after each. SIGTERM or SIGINT
(a `timeout`, a Ctrl-C) stops the running part where it is: its rows so far stay, the summary names the case it
stopped in, the parts after it are `not run`, and the exit status is 128 + the signal's number.

`--budget SECONDS`: the parts run in order of value (correctness first: kernel parity on its covering subset,
then train_step, sweep, flash_vs_sdpa, long_attention, attention_profile, then the rest of kernel parity), each
whole, shrunk or skipped, by benchmarks/gpu/budget.py's estimates (the latest GPU run's times, updated by this
run's own); when the time is out, the running part is stopped as by a signal. Without a budget
the parts run in that order too, whole. The first run on one H100 (2026-11-27) took 280 s for 6 of kernel
parity's 36 cases: the whole suite does not fit a 15-minute window, and `--budget` is how it uses one.

The dry run exists so the suite cannot rot before a GPU is lent (tests/test_gpu_suite.py runs it in the fast
tier). Its Triton kernels run under the interpreter, TRITON_INTERPRET=1, which has to be set before triton is
imported: Triton decides at each `@triton.jit` decoration whether the function is compiled or interpreted, and
triton's own helpers that the kernels call (`tl.sigmoid`, the reductions of triton/language/standard.py) are
decorated when triton is imported; an interpreted kernel calling a compiled helper fails ("Cannot call
@triton.jit'd outside of the scope of a kernel"). Nothing that `python -m benchmarks.gpu.suite` imports before
the parts' modules imports triton (kernels/k_*.py are imported on a kernel's first call), so `main` sets the
variable and then runs the parts (`part_table`: each part's module is imported when the part runs). Where this
process already imported triton compiled (a caller that imported torch._dynamo or torch.utils.flop_counter, which
import it, or ran the kernels on a GPU), setting it would be too late: the dry run then runs itself again in a
fresh Python process with the variable set. A GPU run refuses TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.gpu import budget
from benchmarks.harness import describe_error, machine_label, results_dir

PARTS = ("kernel_parity", "flash_vs_sdpa", "long_attention", "attention_profile", "train_step", "sweep")
SUMMARY = "gpu_suite_summary.md"
INTERPRET = "TRITON_INTERPRET"
ROOT = Path(__file__).resolve().parents[2]


def part_table() -> dict[str, tuple[str, Callable]]:
    """Part name -> (what it measures, its function). Each part's module is imported when the part runs, not here
    or at the top: see the module docstring for triton; and the sweep's module imports Ray, MLflow and the
    launcher (seconds of start-up) that a run of the other parts never uses."""
    return {
        "kernel_parity": (("Triton flash and sorted-chunk kernels vs the PyTorch reference: out, lse, gradients "
                           "(with and through lse alone); fp32 / bf16 / fp16, head dims 64 / 128"),
                          _part("parity", "run")),
        "flash_vs_sdpa": ("fused flash kernel vs SDPA flash backend, TFLOP/s, bf16, n = 1k-16k, causal and not",
                          _part("speed", "run_flash")),
        "long_attention": (("sorted-chunk kernel and lsh / hyper / linformer layers vs SDPA, fwd+bwd, bf16, "
                            "n = 4k-128k"), _part("speed", "run_long")),
        "attention_profile": (("where the mha / lsh / hyper layers' time goes: host vs device time, kernels, "
                               "host reads, the top kernels (torch.profiler)"), _part("attention_profile", "run")),
        "train_step": ("mha LM training step, n = 1024, bf16 autocast, torch.compile: tokens/s and MFU",
                       _part("training", "run")),
        "sweep": ("2-trial orchestrator sweep, bf16 + fsdp + compile, MLflow runs checked", _part("sweep", "run")),
    }


def _part(module: str, function: str) -> Callable:
    """benchmarks.gpu.<module>.<function>, imported at its first call (an import error is the part's error row)."""

    def run(ctx):
        return getattr(importlib.import_module(f"benchmarks.gpu.{module}"), function)(ctx)

    run.__qualname__ = f"{module}.{function}"
    return run


def positive_seconds(text: str) -> float:
    """`--budget`'s value: a number of seconds above 0 (0 or less would leave out every part)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds (e.g. --budget 420)")
    return seconds


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="results root; files go to <out>/<machine>/")
    parser.add_argument("--dry-run", action="store_true",
                        help="every part at toy sizes on the CPU, Triton kernels under the interpreter")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts")
    parser.add_argument("--budget", type=positive_seconds, default=None, metavar="SECONDS",
                        help="fit the run into this many seconds: parts by value, shrunk or skipped by estimate")
    parser.add_argument("--parity-workers", type=budget.positive_count, default=None, metavar="N",
                        help="processes that run kernel parity's cases side by side, compiling their kernels in "
                             "parallel (default: on a GPU, min(8, CPU cores); a dry run, 1)")
    parser.add_argument("--long-lengths", type=budget.positive_count, nargs="+", default=None, metavar="N",
                        help="long_attention's sequence lengths (default: 4k ... 128k, and 256k non-causal)")
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
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.suite", *argv], env=env)

    def forward(signum: int, _frame: object) -> None:  # the child records the stop in its summary
        child.send_signal(signum)

    with signal_handlers(dict.fromkeys(STOP_SIGNALS, forward)):
        return child.wait()


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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SuiteStopped(BaseException):  # noqa: N818 - not an error: a stop, which the parts' `except Exception` must not catch
    """A signal (or the budget's alarm) stopped the suite; raised in whatever the suite was running."""

    def __init__(self, why: str, exit_code: int) -> None:
        super().__init__(why)
        self.why, self.exit_code = why, exit_code


@contextlib.contextmanager
def signal_handlers(handlers: dict[int, Callable]) -> Iterator[None]:
    """Install `handlers` (signal number -> handler) for the block, the previous ones back after it."""
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def stop_on_signals(alarm: bool) -> Iterator[None]:
    """SIGTERM and SIGINT (and, with `alarm`, SIGALRM: the budget's end) raise SuiteStopped once; a second
    signal while the stop is being written down is ignored."""
    stopping = []

    def stop(signum: int, _frame: object) -> None:
        if stopping:
            return
        stopping.append(signum)
        if signum == signal.SIGALRM:
            raise SuiteStopped("stopped: the budget ran out", 1)
        raise SuiteStopped(f"stopped by {signal.Signals(signum).name}", 128 + signum)

    signals = (*STOP_SIGNALS, signal.SIGALRM) if alarm else STOP_SIGNALS
    with signal_handlers(dict.fromkeys(signals, stop)):
        try:
            yield
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)


@dataclass
class PartRecord:
    """One part's outcome over its steps (kernel parity has two: its covering subset and the rest)."""

    cases: int
    """The part's cases in this run (a dry run's smaller grid)."""
    statuses: list[str] = field(default_factory=list)
    ran: int = 0
    """Cases finished."""
    rows: int = 0
    seconds: float = 0.0
    file: str = ""
    note: str = ""
    settings: dict = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)
    """What the budget left out, and why ("the rest skipped: needs ~1104 s ..., 50 s left")."""
    shrunk: list[str] = field(default_factory=list)
    stopped: str = ""
    not_run: str = ""

    def status(self) -> str:
        if self.stopped:
            return "stopped"
        if self.not_run:
            return "not run"
        if not self.statuses:
            return "skipped" if self.left_out else "pending"
        return next((s for s in self.statuses if s.startswith("error")),
                    next((s for s in self.statuses if s.startswith("fail")), self.statuses[-1]))

    def run(self) -> str:
        """The summary's `run` cell: what ran of the part, and what was left out and why."""
        if self.not_run:
            return f"not run: {self.not_run}"
        if self.stopped:
            return f"{self.stopped} ({self.ran} of {self.cases} cases done)"
        if not self.statuses:
            return f"skipped: {'; '.join(self.left_out)}" if self.left_out else "pending"
        if self.ran < self.cases or self.left_out:
            return "; ".join([f"shrunk: {self.ran} of {self.cases} cases ran", *self.shrunk, *self.left_out])
        return "ran"


def write_summary(folder: Path, device_name: str, args: argparse.Namespace, records: dict[str, PartRecord],
                  footer: str = "") -> Path:
    table = part_table()
    mode = "dry run (toy sizes on the CPU; Triton under the interpreter)" if args.dry_run else "GPU run"
    command = "python -m benchmarks.gpu.suite" + (" --dry-run" if args.dry_run else "")
    if list(args.parts) != list(PARTS):
        command += " --parts " + " ".join(args.parts)
    if args.budget is not None:
        command += f" --budget {args.budget:g}"
    lines = [
        f"# GPU suite: {device_name}",
        "",
        f"`{command}`: {mode}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {versions()}.",
        "Written by benchmarks/gpu/suite.py; each part's rows are in its CSV. A dry run's times are not results.",
        "",
        "| part | measures | status | run | rows | time (s) | file | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in PARTS:
        what = table[name][0]
        record = records.get(name)
        if record is None:
            lines.append(f"| {name} | {cell(what)} | not run | not in --parts | | | | |")
            continue
        settings = ", ".join(f"{key} {value}" for key, value in record.settings.items())
        notes = "; ".join(part for part in (record.note, settings) if part)
        rows = record.rows if record.statuses or record.stopped else ""
        lines.append(f"| {name} | {cell(what)} | {cell(record.status())} | {cell(record.run())} | {rows} | "
                     f"{record.seconds:.1f} | {record.file} | {cell(notes)} |")
    if footer:
        lines += ["", footer]
    path = folder / SUMMARY
    tmp = path.with_name(SUMMARY + ".partial")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)  # a stop while writing leaves the previous summary whole
    return path


def case_counts(ctx, parts: Sequence[str]) -> tuple[dict[str, int], int]:
    """part -> its number of cases in this run, and kernel parity's covering subset's (parity and speed modules
    import no triton, nor does training; the sweep is one case)."""
    from benchmarks.gpu import attention_profile, parity, speed, training

    counts = {"kernel_parity": len(parity.ordered_cases(ctx)), "flash_vs_sdpa": len(speed.flash_cases(ctx)),
              "long_attention": len(speed.long_cases(ctx)), "train_step": len(training.variants(ctx)), "sweep": 1,
              "attention_profile": len(attention_profile.profile_cases(ctx))}
    cover = len(parity.covering_subset(parity.case_grid()))
    return {part: counts[part] for part in parts}, min(cover, counts["kernel_parity"])


def run_step(decision: budget.Decision, fn: Callable, ctx, log, record: PartRecord, index: int, steps: int) -> None:
    """Run the cases of one step; an exception becomes the part's status (the suite goes on), with the traceback
    on stderr. A stop (SuiteStopped) is written into `record` and raised again."""
    from benchmarks.gpu.common import PartResult

    step = decision.step
    name = step.part
    start_row, start_cases = len(log.rows), log.cases_done
    what = f" ({step.label})" if step.label else ""
    shrunk = f", shrunk to {decision.cases} of {step.cases} cases: {decision.reason}" if decision.action == "shrink" else ""
    print(f"[{index}/{steps}] {name}{what}{shrunk}", flush=True)
    start = time.perf_counter()
    part_ctx = dataclasses.replace(ctx, log=log, cases=(step.start, step.start + decision.cases))
    try:
        result = fn(part_ctx)
    except SuiteStopped as stop:
        record.seconds += time.perf_counter() - start
        record.ran += log.cases_done - start_cases
        where = f" during case '{log.current}'" if log.current else ""
        record.stopped = f"{stop.why}{where}"
        record.rows, record.file = len(log.rows), log.path.name if log.rows else ""
        print(f"[{index}/{steps}] {name}: {record.stopped} ({record.seconds:.1f} s); {len(log.rows)} rows kept in "
              f"{log.path}", flush=True)
        raise
    except Exception as err:  # noqa: BLE001 - a part that raises is a row of the summary, not the suite's end
        traceback.print_exc()
        if ctx.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        result = PartResult(log.rows[start_row:], describe_error(err))
    seconds = time.perf_counter() - start
    log.replace(start_row, result.rows)
    record.statuses.append(result.status)
    counted = log.cases_done - start_cases  # a part that names its cases (common.SuiteContext.case_finished)
    record.ran += counted or (0 if result.status.startswith("error") else decision.cases)
    record.seconds += seconds
    record.rows, record.file = len(log.rows), log.path.name if log.rows else ""
    record.note = "; ".join(n for n in (record.note, result.note) if n)
    record.settings = result.settings or record.settings
    if decision.action == "shrink":
        label = f"{step.label} " if step.label else ""
        record.shrunk.append(f"{label}cut to {decision.cases} of {step.cases} by the budget ({decision.reason})")
    print(f"[{index}/{steps}] {name}: {result.status} ({seconds:.1f} s)", flush=True)


def main(argv: Sequence[str] | None = None, clock: Callable[[], float] | None = None) -> int:
    """`clock`: seconds, for the budget; a test's simulated clock (then no real alarm ends the budget)."""
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
    from benchmarks.gpu.common import PartLog, SuiteContext

    real_clock = clock is None
    clock = clock or time.monotonic
    started = clock()
    deadline = None if args.budget is None else started + args.budget
    table = part_table()
    ctx = SuiteContext(device=device, dry_run=args.dry_run, folder=results_dir(args.out, device),
                       parity_workers=budget.parity_workers(args.parity_workers, args.dry_run),
                       long_lengths=tuple(args.long_lengths) if args.long_lengths else None)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine_label(device)
    print(f"gpu_suite: {device_name}, {'dry run' if args.dry_run else 'GPU run'}, writing to {ctx.folder}", flush=True)
    parts = [name for name in PARTS if name in args.parts]
    counts, cover = case_counts(ctx, parts)
    todo = budget.steps(counts, cover)
    estimates = budget.Estimates(budget.with_parity_workers(budget.DRY_COSTS if args.dry_run else budget.GPU_COSTS,
                                                            ctx.parity_workers))
    records = {name: PartRecord(counts[name]) for name in parts}
    logs: dict[str, PartLog] = {}
    if deadline is not None:
        planned = budget.plan(todo, estimates.seconds, args.budget)
        print(f"gpu_suite: budget {args.budget:g} s; plan: " + "; ".join(
            f"{d.step.part}{f' ({d.step.label})' if d.step.label else ''} {d.action} {d.cases}/{d.step.cases} "
            f"~{d.estimate:.0f} s" for d in planned), flush=True)
    write_summary(ctx.folder, device_name, args, records)
    stop = None
    with stop_on_signals(alarm=deadline is not None and real_clock):
        try:
            for index, step in enumerate(todo, 1):
                left = None if deadline is None else deadline - clock()
                decision = budget.decide(step, estimates.seconds, left)
                record = records[step.part]
                if decision.action == "skip":
                    what = f"{step.label} " if step.label else ""
                    record.left_out.append(f"{what}skipped: {decision.reason}" if what else decision.reason)
                    print(f"[{index}/{len(todo)}] {step.part}: {what}skipped, {decision.reason}", flush=True)
                    continue
                if deadline is not None and real_clock:
                    signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
                log = logs.setdefault(step.part, PartLog(ctx.folder / f"gpu_{step.part}.csv"))
                before = clock()
                try:
                    run_step(decision, table[step.part][1], ctx, log, record, index, len(todo))
                finally:
                    if deadline is not None and real_clock:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                    estimates.update(step.part, decision.cases, clock() - before)
                    write_summary(ctx.folder, device_name, args, records)
        except SuiteStopped as stopped:
            stop = stopped
            for record in records.values():
                if not record.statuses and not record.stopped and not record.left_out:
                    record.not_run = f"the suite was {stop.why}"
    footer = f"The run was {stop.why} after {clock() - started:.0f} s." if stop else ""
    summary = write_summary(ctx.folder, device_name, args, records, footer)
    print(f"gpu_suite: {clock() - started:.0f} s in all; wrote {summary}", flush=True)
    if stop is not None:
        return stop.exit_code
    return 0 if all(r.status() in ("ok", "dry-run", "skipped") for r in records.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
