"""Part (f) of benchmarks.gpu.suite, `attention_profile`: where one long_attention layer's forward + backward spends
its time, the question long_attention's totals leave open (the first H200 run: the lsh and hyper layers took 3-5 ms
at 4k-16k where their kernels take well under 1 ms, and causal hyper 111 ms at 128k).

For the mha, lsh and hyper layers of long_attention (speed.long_calls: the same shapes, knobs and closure) at
`PROFILE_LENGTHS`, causal and not, after one untimed call, one row per case:
- `host_ms`: until the call returns, without a synchronisation of ours: the host's Python, dispatch and launches,
  plus the device's time up to the last point where the call itself waited for the device;
- `total_ms`: until the device has finished too (`torch.cuda.synchronize`); total well above the device's time
  means the host's side, not the device's work, sets the layer's time;
- `device_ms`, `device_kernels`: the device kernels' own time summed, and their number (torch.profiler, one call);
- `peak_mib`: the allocator's peak during the call (`torch.cuda.max_memory_allocated`, the layer's weights and
  input included), beside which benchmarks/methods/attention_glue.py's counted peaks can be read; blank on a CPU;
- `host_reads`: values the call read back from the device (`aten::_local_scalar_dense`: `.item()`, `int(t)`,
  `.tolist()`), each a wait for the device at that point. Counted on any device, so a dry run counts them too;
- `top_kernels`: the `TOP_KERNELS` kernels (or, on a CPU, ops) with the most own time, `name:ms:calls`;
- `graphs`, `graph_breaks` (the `+inductor` layers, `COMPILED_KINDS`, at the shorter length): what dynamo captured
  of the layer in its first call; the `+graphs` layers (`GRAPHED_KINDS`, same length) are replayed from CUDA graphs.
A dry run profiles the toy layers on the CPU (the Triton kernels under the interpreter): its times are not results,
its `host_reads` are the GPU run's.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu.common import PartResult, SuiteContext, release_memory, row_status, status_of_rows
from benchmarks.gpu.speed import COMPILED, DRY_LONG_LENGTHS, GRAPHED, long_calls
from benchmarks.harness import Row, synchronize

PROFILE_KINDS = ("mha", "lsh", "hyper")
PROFILE_LENGTHS = (16384, 131072)
"""One length where the host's side may set the layer's time and one where the device's work must."""
COMPILED_KINDS = tuple(kind + COMPILED for kind in PROFILE_KINDS)
"""The same layers under torch.compile (speed.COMPILED), at the shorter length only: whether inductor's fused glue
takes the host's side out of the layers' time there (each case compiles for its shape: seconds a case). A dry run
compiles causal lsh only (the layer whose eager path on a CPU reads its layout's length back; compiled, it takes the
layout's bound, with no read and no graph break) with dynamo's eager backend: the plumbing checked in the fast
tier's time."""
DRY_COMPILED_KINDS = ("lsh" + COMPILED,)
GRAPHED_KINDS = tuple(kind + GRAPHED for kind in PROFILE_KINDS)
"""The same layers replayed from CUDA graphs (speed.GRAPHED), at the shorter length on a GPU: host_ms near zero and
total_ms the device's alone if the capture holds the whole layer (a dry run has no CUDA graphs)."""
TOP_KERNELS = 8
HOST_READ = "aten::_local_scalar_dense"


def profile_cases(ctx: SuiteContext) -> list[tuple[int, bool, str]]:
    """(n, causal, kind) of every case, shortest first."""
    lengths = DRY_LONG_LENGTHS if ctx.dry_run else PROFILE_LENGTHS
    cases = [(n, causal, kind) for n in lengths for causal in (False, True)
             for kind in PROFILE_KINDS + (COMPILED_KINDS + GRAPHED_KINDS if n == lengths[0] and not ctx.dry_run else ())]
    return cases + [(lengths[0], True, kind) for kind in DRY_COMPILED_KINDS if ctx.dry_run]


def compile_counts() -> dict[str, int]:
    """Dynamo's running counts: graphs captured and graph breaks (a compiled case's row takes their growth)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": sum(counters["graph_break"].values())}


def own_time_us(event, on_device: bool) -> float:
    """An averaged profiler event's own (self) time in microseconds, on the device or the host."""
    if on_device:
        return float(getattr(event, "self_device_time_total", 0.0) or 0.0)
    return float(event.self_cpu_time_total)


def profiled_row(step, ctx: SuiteContext) -> Row:
    """host_ms, total_ms, device_ms, device_kernels, host_reads and top_kernels of one call of `step`."""
    on_gpu = ctx.device.type == "cuda"
    synchronize(ctx.device)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    start = time.perf_counter()
    step()
    host_s = time.perf_counter() - start
    synchronize(ctx.device)
    total_s = time.perf_counter() - start
    peak_mib = torch.cuda.max_memory_allocated(ctx.device) / 2**20 if on_gpu else ""
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    with profile(activities=activities) as prof:
        step()
        synchronize(ctx.device)
    events = prof.key_averages()
    host_reads = sum(e.count for e in events if e.key == HOST_READ)
    if on_gpu:
        kernels = [e for e in events
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and own_time_us(e, True) > 0]
    else:  # no device: the ops' own host time stands in (not a result)
        kernels = [e for e in events if e.key.startswith("aten::")]
    kernels.sort(key=lambda e: own_time_us(e, on_gpu), reverse=True)
    device_ms = sum(own_time_us(e, on_gpu) for e in kernels) / 1e3
    top = "; ".join(f"{e.key[:60]}:{own_time_us(e, on_gpu) / 1e3:.3g}:{e.count}" for e in kernels[:TOP_KERNELS])
    return {"host_ms": 1e3 * host_s, "total_ms": 1e3 * total_s, "peak_mib": peak_mib,
            "device_ms": device_ms if on_gpu else "",
            "device_kernels": sum(e.count for e in kernels) if on_gpu else "", "host_reads": host_reads,
            "top_kernels": top, "status": "ok"}


def run(ctx: SuiteContext) -> PartResult:
    rows: list[Row] = []
    chosen = ctx.select(profile_cases(ctx))
    for n, causal, kind in chosen:
        ctx.case_started(f"n={n} causal={causal}, {kind}")
        row: Row = {"case": f"n={n} causal={causal}", "impl": kind, "n": n, "causal": causal}
        step = None
        try:
            step = long_calls(kind, n, causal, ctx)
            before = compile_counts()
            step()  # autotuning, compiles, the allocator's first blocks: not profiled
            if kind.endswith(COMPILED):  # how much of the layer dynamo captured, and where it broke off
                row.update({key: after - before[key] for key, after in compile_counts().items()})
            row.update(profiled_row(step, ctx))
        except Exception as err:  # noqa: BLE001 - recorded in the row; the part's status names it
            row["status"] = row_status(err)
        finally:
            del step
            release_memory(ctx.device)
        rows.append(row)
        ctx.record([row])
        ctx.case_finished()
        if row["status"] == "ok":
            device = (f", device {row['device_ms']:.3g} ms in {row['device_kernels']} kernels, peak "
                      f"{row['peak_mib']:.0f} MiB" if row["device_ms"] != "" else "")
            print(f"  profile n={n:6d} causal={causal!s:5} {kind:6}: host {row['host_ms']:.3g} ms, total "
                  f"{row['total_ms']:.3g} ms{device}, {row['host_reads']} host reads", flush=True)
            # On the console too: a window's call can end before the CSV is copied out (2026-11-28's second did).
            if "graphs" in row:
                print(f"    compiled: {row['graphs']} graphs, {row['graph_breaks']} graph breaks", flush=True)
            print(f"    top (name:ms:count): {row['top_kernels']}", flush=True)
        else:
            print(f"  profile n={n:6d} causal={causal!s:5} {kind:6}: {row['status'][:80]}", flush=True)
    lengths = tuple(dict.fromkeys(n for n, _, _ in chosen))
    return PartResult(rows, status_of_rows(rows, ctx), settings={"n": lengths, "kinds": PROFILE_KINDS,
                                                                 "top": TOP_KERNELS})
