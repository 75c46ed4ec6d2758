"""Part (a) of benchmarks.gpu.suite: the Triton kernels against their PyTorch references on the suite's device.

Cases are the product of kernel x dtype (fp32, bf16, fp16) x head dim (64, 128) x length (a multiple of the
block size, and one that is not) x mask:
- `flash` (kernels.flash_attention against kernels.reference.exact_attention_reference): mask `causal` (no
  padding) or `padded` (not causal; batch row 0 has its first keys padded, row 1 all of them, so its lse is
  -inf and its output zero, row 2 its second half);
- `chunked`, the sorted-chunk kernel (kernels.chunked_attention.chunked_flash_attention against
  chunked_attention_reference) as LSH attention calls it: mask `lsh` = causal over a random permutation of
  positions per head, self-mask and padding, one chunk of look-back with wrap-around;
- `hyper`, HyperAttention's blocks + samples in one softmax (kernels.hyper_blocks.hyper_block_flash_attention
  against kernels/hyper_blocks_reference.py) as its non-causal sortLSH calls it: mask `sortlsh` = queries and keys
  in random orders per head cut into blocks of the chunk size (the last with filler rows), 2 chunks' worth of
  samples drawn with replacement (some in a query's own block, masked), the padding above.
Each case compares out and lse, the gradients dq, dk, dv of sum(out * dout) + sum(lse * dlse) (the backward with
the lse gradient folded into delta, docs/kernels.md), and dq, dk of sum(lse * dlse) alone (the backward's
dout = None path): one CSV row per quantity, `passed` when the max abs error is within
kernels.parity.PARITY_TOLERANCE of the reference (relative to max(1, max |reference|)), which tests/test_kernels.py
asserts too.

On CUDA every case runs at one fixed launch configuration (64 x 64 blocks, or 32 x 32 where those do not fit the
device's shared memory; fp32 32 x 32, which compiles several times faster: `FP32_GPU_BLOCKS`): autotuning would compile and time every candidate (~16 per kernel set) for each
compiled variant of the kernels, minutes that the suite does not have. The autotuned configurations are what
part (b) times, and it records their error against SDPA. A dry run takes the interpreter's 16 x 16 blocks,
lengths 32 and 37, one head, and a covering subset of the cases: every value of every axis at least once.

A case's time is compilation (CPU-bound), so with `ctx.parity_workers` > 1 (the suite's `--parity-workers`; on a GPU
min(8, cores) by default) the cases run in that many spawned processes at once (`parallel_cases`), each compiling
its variants into Triton's on-disk cache; rows are recorded as each case finishes and kept in the cases' order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.common import PartResult, SuiteContext, release_memory, row_status
from benchmarks.harness import Row, cases
from kernels.chunked_attention import chunked_flash_attention
from kernels.flash_attention import fixed_launch_config, flash_attention
from kernels.hyper_blocks import hyper_block_flash_attention
from kernels.hyper_blocks_reference import hyper_block_attention_reference
from kernels.parity import PARITY_TOLERANCE, parity_error
from kernels.reference import chunked_attention_reference, exact_attention_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
MASKS = {"flash": ("causal", "padded"), "chunked": ("lsh",), "hyper": ("sortlsh",)}
KERNELS = {"flash": (flash_attention, exact_attention_reference),
           "chunked": (chunked_flash_attention, chunked_attention_reference),
           "hyper": (hyper_block_flash_attention, hyper_block_attention_reference)}
"""Each kernel kind's (Triton function, PyTorch reference)."""
BATCH, HEADS, DRY_HEADS = 3, 2, 1
"""Three batch rows: the padded cases give each its own pattern (see the module docstring). Two heads on a GPU; a
dry run, whose interpreted time is per program, takes one (tests/test_kernels.py runs the kernels with several)."""
GPU_BLOCKS = ((64, 64), (32, 32))
"""Fixed launch blocks on CUDA, largest first; the first that fits the shared memory of all three kernels."""
FP32_GPU_BLOCKS = ((32, 32),)
"""fp32's: its dots are full-precision fp32 (`dot_options`: no tensor cores), whose unrolled code at 64 x 64 takes
Triton minutes to compile. For sm_90 at head dim 128, causal, uneven lengths, on a 2-core CPU (Triton's own ptxas,
the script of tests/test_kernels.py `test_kernels_compile_for_gpu` with fp32 pointers): 64 x 64 forward 23.1 s,
dK/dV 114.8 s, dQ 38.4 s; 32 x 32 4.8, 15.3 and 9.4 s. The H200's second window saw it as fp32 flash cases of
44-112 s against 2-12 s for the others (results/nvidia-h200/window2_console.txt). Parity checks values, not speed."""
GPU_LENGTHS = {True: 512, False: 500}
"""Sequence length by `block_multiple` on CUDA (500 is a multiple of neither 64 nor 32)."""
DRY_LENGTHS = {True: 32, False: 37}
"""Under the interpreter's 16 x 16 blocks: two blocks, or two and a tail."""
GPU_CHUNK, DRY_CHUNK = 64, 16
QUANTITIES = ("out", "lse", "dq", "dk", "dv", "dq_lse_only", "dk_lse_only")


def case_grid() -> list[dict[str, Any]]:
    """Every case of the full (GPU) run, flash first."""
    return [c for kernel, masks in MASKS.items()
            for c in cases(kernel=[kernel], dtype=DTYPES, head_dim=HEAD_DIMS, block_multiple=(True, False), mask=masks)]


def covering_subset(grid: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A few cases of `grid` in which every value of every axis appears at least once (greedy: each pick covers
    the most (axis, value) pairs not yet covered), in grid order. The dry run's cases."""
    uncovered = {(axis, value) for case in grid for axis, value in case.items()}
    chosen: list[int] = []
    while uncovered:
        best = max(range(len(grid)), key=lambda i: len(uncovered & set(grid[i].items())))
        chosen.append(best)
        uncovered -= set(grid[best].items())
    return [grid[i] for i in sorted(chosen)]


def launch_blocks(dtype: torch.dtype, head_dim: int, device: torch.device) -> tuple[int, int] | None:
    """The fixed (BLOCK_M, BLOCK_N) of a CUDA case; None under the interpreter (its own 16 x 16 blocks)."""
    if device.type != "cuda":
        return None
    from kernels import (
        k_flash_attention as kf,  # imports triton: only once a CUDA run needs it
    )

    props = torch.cuda.get_device_properties(device)
    arch = props.major * 10 + props.minor
    limit = getattr(props, "shared_memory_per_block_optin", kf.SHARED_MEMORY_BY_ARCH.get(arch, 99 * 1024))
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    block_d = 1 << (head_dim - 1).bit_length()
    for block_m, block_n in FP32_GPU_BLOCKS if dtype == torch.float32 else GPU_BLOCKS:
        cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_stages": 2}
        if all(kf.shared_memory_estimate(name, cfg, block_d, elem_bytes) <= limit for name in kf.CONFIGS):
            return block_m, block_n
    return GPU_BLOCKS[-1]


def make_inputs(case: dict[str, Any], ctx: SuiteContext) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, H, n, d], dout, dlse, and the keyword arguments of both the kernel and the reference."""
    torch.manual_seed(0)
    n = (DRY_LENGTHS if ctx.dry_run else GPU_LENGTHS)[case["block_multiple"]]
    dtype, device, heads = case["dtype"], ctx.device, DRY_HEADS if ctx.dry_run else HEADS
    q, k, v, dout = (torch.randn(BATCH, heads, n, case["head_dim"], dtype=dtype, device=device) for _ in range(4))
    dlse = torch.randn(BATCH, heads, n, device=device)
    pad_BN = torch.zeros(BATCH, n, dtype=torch.bool, device=device)
    pad_BN[0, :3] = True
    pad_BN[1, :] = True
    pad_BN[2, n // 2:] = True
    if case["kernel"] == "flash":
        padded = case["mask"] == "padded"
        kwargs = {"causal": not padded, "key_padding_mask": pad_BN if padded else None}
    elif case["kernel"] == "chunked":
        positions = torch.stack([torch.randperm(n) for _ in range(BATCH * heads)]).view(BATCH, heads, n)
        kwargs = {"chunk": DRY_CHUNK if ctx.dry_run else GPU_CHUNK, "lookback": 1, "positions": positions.to(device),
                  "causal": True, "self_mask": True, "key_padding_mask": pad_BN, "wrap": True}
    else:
        kwargs = {**hyper_layout(n, heads, DRY_CHUNK if ctx.dry_run else GPU_CHUNK, pad_BN), "key_padding_mask": pad_BN}
    return q, k, v, dout, dlse, kwargs


def hyper_layout(n: int, heads: int, block: int, pad_BN: torch.Tensor) -> dict[str, Any]:
    """Non-causal sortLSH's layout for the `hyper` kernel: random query and key orders per head in whole blocks
    (fillers -1 last), group g on key block g, 2 * block samples among the rows of real tokens, weight n / m."""
    device = pad_BN.device

    def order() -> torch.Tensor:
        rows = torch.stack([torch.randperm(n) for _ in range(BATCH * heads)]).view(BATCH, heads, n)
        return torch.nn.functional.pad(rows, (0, -n % block), value=-1).to(device)

    n_blocks, m = -(-n // block), 2 * block
    real_B = (~pad_BN).sum(-1)
    return {"q_slots": order(), "k_rows": order(),
            "group_block": torch.arange(n_blocks, device=device).expand(BATCH, heads, n_blocks).contiguous(),
            "sample_rows": torch.randint(0, n, (BATCH, heads, m)).to(device), "block": block,
            "sample_log_weight": torch.log(real_B.clamp(min=1).float() / m)}


def _outputs(fn: Callable, q, k, v, dout, dlse, kwargs) -> dict[str, torch.Tensor]:
    """out, lse, the gradients with dout and dlse, and those through lse alone (a second forward, as the first
    graph is freed by its backward)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, **kwargs)
    dq, dk, dv = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    _, lse_again = fn(*leaves, **kwargs)
    dq_lse, dk_lse = torch.autograd.grad(lse_again, leaves[:2], dlse)  # lse does not depend on v
    return dict(zip(QUANTITIES, (out, lse, dq, dk, dv, dq_lse, dk_lse)))


def run_case(case: dict[str, Any], ctx: SuiteContext) -> list[Row]:
    q, k, v, dout, dlse, kwargs = make_inputs(case, ctx)
    kernel, reference = KERNELS[case["kernel"]]
    blocks = launch_blocks(case["dtype"], case["head_dim"], ctx.device) if case["kernel"] == "flash" else None
    dtype_name = str(case["dtype"]).removeprefix("torch.")
    base: Row = {"kernel": case["kernel"], "dtype": dtype_name, "head_dim": case["head_dim"], "seq": q.shape[2],
                 "block_multiple": case["block_multiple"], "mask": case["mask"],
                 "chunk": kwargs.get("chunk", kwargs.get("block", "")),
                 "blocks": "interpreter" if ctx.dry_run else f"{blocks[0]}x{blocks[1]}" if blocks else "the kernel's own",
                 "tolerance": PARITY_TOLERANCE[case["dtype"]]}
    try:
        if blocks is not None:
            with fixed_launch_config(*blocks):
                got = _outputs(kernel, q, k, v, dout, dlse, kwargs)
        else:
            got = _outputs(kernel, q, k, v, dout, dlse, kwargs)
        expected = _outputs(reference, q, k, v, dout, dlse, kwargs)
    except Exception as err:  # noqa: BLE001 - a case that raises is a row of the CSV, and the part's error
        return [{**base, "quantity": "all", "status": row_status(err), "passed": False}]
    finally:
        release_memory(ctx.device)
    rows = []
    for quantity in QUANTITIES:
        err, bound, problem = parity_error(got[quantity], expected[quantity], case["dtype"])
        rows.append({**base, "quantity": quantity, "max_abs_err": err, "bound": bound,
                     "status": problem or "ok", "passed": problem is None and err <= bound})
    return rows


def ordered_cases(ctx: SuiteContext) -> list[dict[str, Any]]:
    """The part's cases in the order it runs them: the covering subset first (every axis value once: what a budget
    keeps when it shrinks the part, benchmarks/gpu/budget.py), then the rest of the grid; a dry run only the subset."""
    grid = case_grid()
    cover = covering_subset(grid)
    return cover if ctx.dry_run else cover + [case for case in grid if case not in cover]


def case_label(case: dict[str, Any]) -> str:
    return (f"{case['kernel']} {str(case['dtype']).removeprefix('torch.')} d={case['head_dim']} "
            f"{'block multiple' if case['block_multiple'] else 'tail'} {case['mask']}")


def _case_in_worker(job: tuple[int, dict[str, Any], str, bool]) -> tuple[int, list[Row], float]:
    """One case in a parity process (`parallel_cases`): its index, rows and seconds."""
    index, case, device, dry_run = job
    start = time.perf_counter()
    rows = run_case(case, SuiteContext(device=torch.device(device), dry_run=dry_run, folder=Path(".")))
    return index, rows, time.perf_counter() - start


def _worker_loop(work: Callable[[Any], Any], jobs: Any, results: Any) -> None:
    """A parity process: jobs until the None that ends them. Ctrl-C is the suite's to handle (it ends the processes);
    SIGTERM keeps its default, so that a `timeout` that signals the whole group ends them too."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for job in iter(jobs.get, None):
        results.put(work(job))


def parallel_cases(chosen: Sequence[dict[str, Any]], ctx: SuiteContext,
                   work: Callable[[Any], tuple[int, list[Row], float]] = _case_in_worker,
                   ) -> Iterator[tuple[int, list[Row], float]]:
    """(index into `chosen`, rows, seconds) of every case as it finishes, in `ctx.parity_workers` processes.

    A case's time is almost all Triton compiling its kernel variants (the H100's first run: 12-77 s a case, 6 of 36
    cases in 280 s), and compiling is CPU-bound, one core per process: the processes compile different cases'
    variants at once, into Triton's one on-disk cache. The processes are spawned (CUDA cannot be forked) and
    inherit the environment, the interpreter's switch of a dry run included. A stop (a signal, the budget's alarm)
    raises in this process while it waits; every process is then killed, and the cases that finished have already
    been recorded. Plain processes and queues rather than multiprocessing.Pool: a `timeout` signals the whole
    process group, and a Pool whose idle worker died holding its task queue's lock waits in `terminate` for ever
    (the H200 window of 2026-11-28 lost its kernel tests to that). A process that dies without its result (out
    of memory, a crash in the compiler) is an error naming its exit code, not a wait."""
    import multiprocessing
    import queue

    spawn = multiprocessing.get_context("spawn")
    # The jobs go through a SimpleQueue, written by this thread: a Queue's feeder thread would be the last holder of
    # its semaphore, and a daemon thread cut short at exit leaves it unlinked but still registered (the resource
    # tracker's "leaked semaphore" warning after the stop, 1 exit in 15 on 2 cores). The jobs are written once the
    # processes run, so a grid larger than a pipe's buffer waits for them instead of for ever (48 cases: 6 KiB).
    jobs, results = spawn.SimpleQueue(), spawn.Queue()
    count = min(ctx.parity_workers, len(chosen))
    processes = [spawn.Process(target=_worker_loop, args=(work, jobs, results), daemon=True) for _ in range(count)]
    try:
        for process in processes:
            process.start()
        for index, case in enumerate(chosen):
            jobs.put((index, case, ctx.device.type, ctx.dry_run))
        for _ in range(count):
            jobs.put(None)
        in_flight = f"{len(chosen)} cases in {count} processes"
        ctx.case_started(in_flight)
        for done in range(1, len(chosen) + 1):
            while True:
                try:
                    result = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"a kernel parity process died (exit code {dead[0]}) before its case "
                                           f"finished; {len(chosen) - done + 1} of {len(chosen)} cases unfinished")
            yield result
            ctx.case_started(f"{len(chosen) - done} of {in_flight}")
    finally:
        for process in processes:
            if process.pid is not None:
                process.kill()
                process.join()
        jobs.close()
        results.close()  # this process only reads it: no feeder thread here to wait for


def sequential_cases(chosen: Sequence[dict[str, Any]], ctx: SuiteContext) -> Iterator[tuple[int, list[Row], float]]:
    """(index, rows, seconds) of every case, one after the other in this process."""
    for index, case in enumerate(chosen):
        start = time.perf_counter()
        ctx.case_started(case_label(case))
        yield index, run_case(case, ctx), time.perf_counter() - start


def run(ctx: SuiteContext) -> PartResult:
    grid = case_grid()
    every = ordered_cases(ctx)
    chosen = ctx.select(every)
    runner = parallel_cases if ctx.parity_workers > 1 and len(chosen) > 1 else sequential_cases
    by_case: dict[int, list[Row]] = {}
    for done, (index, case_rows, seconds) in enumerate(runner(chosen, ctx), 1):
        case = chosen[index]
        by_case[index] = case_rows
        ctx.record(case_rows)
        ctx.case_finished()
        worst = max((r["max_abs_err"] / r["bound"] for r in case_rows if "bound" in r), default=float("nan"))
        verdict = "pass" if all(r["passed"] for r in case_rows) else "FAIL"
        if case_rows[0]["quantity"] == "all":  # the case raised
            verdict = case_rows[0]["status"]
        print(f"  parity {done}/{len(chosen)} {case['kernel']:7s} {case_rows[0]['dtype']:8s} d={case['head_dim']:3d} "
              f"n={case_rows[0]['seq']:4d} {case['mask']:6s}: {verdict} (worst error / bound {worst:.2f}) "
              f"{seconds:.1f}s", flush=True)
    rows = [row for index in sorted(by_case) for row in by_case[index]]  # the cases' order, however they finished
    failed = [r for r in rows if not r["passed"]]
    raised = [r for r in failed if r["status"] != "ok"]
    lengths = DRY_LENGTHS if ctx.dry_run else GPU_LENGTHS
    settings = {"lengths": "/".join(str(n) for n in lengths.values()), "blocks": sorted({r["blocks"] for r in rows}),
                "processes": min(ctx.parity_workers, len(chosen)) if runner is parallel_cases else 1}
    if raised:
        return PartResult(rows, f"error: {len(raised)} comparisons could not be made; first: "
                                f"{raised[0]['kernel']} {raised[0]['dtype']} d={raised[0]['head_dim']}: {raised[0]['status']}",
                          settings=settings)
    if failed:
        first = failed[0]
        return PartResult(rows, f"fail: {len(failed)} of {len(rows)} comparisons over tolerance; first: "
                                f"{first['kernel']} {first['dtype']} d={first['head_dim']} n={first['seq']} "
                                f"{first['mask']} {first['quantity']} {first['max_abs_err']:.3g} > {first['bound']:.3g}",
                          settings=settings)
    cover = len(covering_subset(grid))
    first = ctx.cases[0] if ctx.cases else 0
    which = ("the covering subset: every axis value once" if (first, len(chosen)) == (0, cover)
             else "after the covering subset" if first >= cover else "covering subset first")
    note = f"{len(chosen)} of {len(grid)} cases ({which})" if len(chosen) < len(grid) else f"{len(grid)} cases"
    return PartResult(rows, ctx.passed, f"{note}, {len(rows)} comparisons within tolerance", settings)
