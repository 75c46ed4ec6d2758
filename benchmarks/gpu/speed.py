"""Parts (b) and (c) of benchmarks.gpu.suite: attention speed against torch SDPA's flash backend.

(b) `flash_vs_sdpa`: the fused Triton FlashAttention-2 kernel (kernels.flash_attention; Dao, 2023, arXiv
2307.08691) against `F.scaled_dot_product_attention` under `sdpa_kernel(SDPBackend.FLASH_ATTENTION)`, in bf16,
n = 1k ... 16k, causal and not, head dim 128 with the shapes of benchmarks/methods/kernels.py (hidden 2048, 16k tokens
per batch); TFLOP/s of the forward and of forward + backward counted as that benchmark counts them
(`attention_flops`). Head dim 64 and n up to 64k are `python -m benchmarks.methods.kernels`'s sweep; the suite keeps to
one head dim to stay within its time. Each case's first call autotunes the Triton kernels before timing, and
the configuration each kernel settled on and the max |impl - sdpa| of the output go into the row. Beside SDPA's
flash backend, the same run times the strongest baselines (benchmarks/gpu/baselines.py): SDPA's cuDNN backend,
FlexAttention and FlashAttention 3 where importable; one that cannot run here is a row `unavailable: <reason>`.

(c) `long_attention`: forward + backward at n = 4k ... 128k (2^12 ... 2^17), batch 1, d_model 1024, 16 heads of
64, bf16, causal and not, of: bare SDPA (flash backend) on q, k, v, and beside it the same bare baselines as (b)
(`sdpa-cudnn`, `flex`, `fa3`; unavailable ones recorded); the bare sorted-chunk kernel
(kernels.chunked_attention, chunk 64, one chunk of look-back), as Reformer's LSH attention calls it after its
sort; and whole attention layers (projections included) of `mha` (SDPA inside), `lsh` (Reformer; buckets of 64,
2 hash rounds; `lsh-r4` the same with 4, `lsh-r4f` with 4 and factorized hashing), `hyper` (HyperAttention, Han et al., 2023, arXiv 2310.05869, at its defaults: blocks and samples
of 256, exact below 4096 tokens) and `linformer` (Wang et al., 2020, arXiv 2006.04768, k = 256 shared per head;
no causal form, so non-causal only). `speedup_vs_sdpa` divides bare SDPA's time by each row's, `speedup_vs_mha`
the mha layer's: HyperAttention's paper reports 5.4x (causal) and 54x (non-causal) over FlashAttention-2 at
131k for its attention alone. A size that runs out of memory is recorded as `oom` and the larger sizes of that
row's implementation as skipped.

Both time with `triton.testing.do_bench` on CUDA (common.time_ms). A dry run takes toy sizes on the CPU,
the Triton kernels under the interpreter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.methods.attention_scaling import Settings, Variant, build_layer
from benchmarks.gpu.baselines import BASELINES, backward_unavailable, sdpa_flash, unavailable
from benchmarks.gpu.common import (
    PartResult,
    SuiteContext,
    release_memory,
    row_status,
    status_of_rows,
    time_ms,
)
from benchmarks.harness import Row, add_ratios
from benchmarks.methods.kernels import attention_flops, format_config, shapes
from kernels.chunked_attention import chunked_flash_attention
from kernels.flash_attention import KERNEL_NAMES, flash_attention, tuned_launch_configs
from models.attention.lsh import default_n_buckets

DTYPE = torch.bfloat16
FLASH_LENGTHS, DRY_FLASH_LENGTHS = (1024, 2048, 4096, 8192, 16384), (32,)
FLASH_HEAD_DIM, DRY_FLASH_HEAD_DIM = 128, 16
DRY_FLASH_SHAPE = (1, 2)
"""(batch, heads) of a dry run; a GPU run takes benchmarks.methods.kernels.shapes(n, d)."""
LONG_LENGTHS, DRY_LONG_LENGTHS = tuple(2**p for p in range(12, 18)), (32,)
NON_CAUSAL_ONLY_LENGTHS = (2**18,)
"""256k runs non-causal only, at batch 1 as every case: causal SDPA there (about 4 x its 128k time) would take the
part's time for the one row that the non-causal one already gives (whether the methods fit and scale)."""
LONG_MODEL = {"d_model": 1024, "heads": 16, "chunk": 64,
              "knobs": {"lsh": {"bucket_size": 64, "n_hashes": 2}, "lsh-r4": {"bucket_size": 64, "n_hashes": 4},
                        "lsh-r4f": {"bucket_size": 64, "n_hashes": 4},
                        "hyper": {}, "linformer": {"k": 256, "sharing": "headwise"}}}
DRY_LONG_MODEL = {"d_model": 32, "heads": 2, "chunk": 16,
                  "knobs": {"lsh": {"bucket_size": 8, "n_hashes": 2}, "lsh-r4": {"bucket_size": 8, "n_hashes": 4},
                            "lsh-r4f": {"bucket_size": 8, "n_hashes": 4},
                            "hyper": {"block_size": 8, "sample_size": 8, "min_seq_len": 16},
                            "linformer": {"k": 8, "sharing": "headwise"}}}
"""Toy sizes at which every layer still takes its approximate path (hyper's exact base case is shorter than n)."""
LAYER_KINDS = ("mha", "lsh", "lsh-r4", "lsh-r4f", "hyper", "linformer")
"""The layers long_attention times; `lsh-r4` is the lsh layer with 4 hash rounds (Reformer's own setting in its
speed figures), beside the 2 rounds the first GPU runs timed; `lsh-r4f` the same with its bucket count factorized
(`FACTORIZED`)."""
LAYER_KIND_OF = {"lsh-r4": "lsh", "lsh-r4f": "lsh"}
"""A layer's attention kind where its name is not one (a kind at other knobs)."""
FACTORIZED = ("lsh-r4f",)
"""Layers whose n_buckets is the default count at each n as two factors (`factorized_buckets`; trax's and Hugging
Face's factorized hashing, docs/long_attention.md): the same number of buckets, the hash's cost growing as n
instead of n^2, which at 128k is about twice the chunked attention's FLOPs."""


def factorized_buckets(n: int, bucket_size: int) -> list[int]:
    """The default bucket count at n (`default_n_buckets`) as two even factors, the smaller as large as it can be
    (64 x 64 at 128k and buckets of 64); the count alone when it has no such split (2, or twice an odd number)."""
    count = default_n_buckets(n, bucket_size)
    splits = [low for low in range(2, math.isqrt(count) + 1, 2) if count % low == 0 and (count // low) % 2 == 0]
    return [splits[-1], count // splits[-1]] if splits else [count]


def layer_knobs(name: str, n: int, model: dict) -> dict:
    """The knobs of layer `name` at n tokens: the model's, with the factorized bucket count where it has one."""
    knobs = model["knobs"].get(name, {})
    return {**knobs, "n_buckets": factorized_buckets(n, knobs["bucket_size"])} if name in FACTORIZED else knobs
COMPILED = "+inductor"
"""A layer name ending so (`lsh+inductor`) is that layer under `torch.compile` (inductor on a GPU, as the training
core's `run.compile`; dynamo's eager backend in a dry run, which checks the plumbing, not the speed): whether
fusing the glue's elementwise ops and cutting its launches is what the methods' short lengths lack."""
GRAPHED = "+graphs"
"""A layer name ending so (`lsh+graphs`) is that layer with its forward and its backward each replayed from one CUDA
graph (`torch.cuda.make_graphed_callables`, after its warm-up calls): the same kernels with the host's Python,
dispatch and launches taken out, which set the lsh and hyper layers' time up to 16k on the second H200 window
(attention_profile: about 50 us of host per launch). The layers can be captured because on the kernels they read
nothing back from the device (tests/test_attention_glue.py). On a CPU the row is `unavailable`."""
GRAPHED_KINDS = ("lsh", "lsh-r4", "hyper")
"""The layers long_attention also times as CUDA graphs: the methods whose launches outnumber the exact layer's."""


def graphs_unavailable(device: torch.device) -> str | None:
    return None if device.type == "cuda" else "CUDA graphs need a CUDA GPU"


class FixedCausal(torch.nn.Module):
    """`layer(x, causal=causal)` as a module of one tensor: what `make_graphed_callables` captures (a module, so that
    the backward graph computes its parameters' gradients too, as a training step's backward does)."""

    def __init__(self, layer: torch.nn.Module, causal: bool) -> None:
        super().__init__()
        self.layer, self.causal = layer, causal

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.layer(x_BTD, causal=self.causal)


def graphed_layer(layer: torch.nn.Module, x_BTD: torch.Tensor, causal: bool) -> torch.nn.Module:
    """The layer's forward and backward captured in CUDA graphs (warm-up calls first: autotuning and Triton's
    compiles happen there, never in the capture); called as `module(x)` from then on."""
    sample_BTD = x_BTD.detach().requires_grad_(True)
    return torch.cuda.make_graphed_callables(FixedCausal(layer, causal), (sample_BTD,), allow_unused_input=True)


def triton_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return flash_attention(q, k, v, causal=causal)[0]


def fwd_and_fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: bool = True, **kwargs: Any):
    """Closures of a forward under no_grad and of a forward + backward from a fixed upstream gradient, on leaves
    that require gradients (`grad`; without it, leaves that do not: a forward-only baseline refuses them); the
    backward's gradients are dropped each call, as a training step's are."""
    leaves = [t.detach().requires_grad_(grad) for t in inputs]
    with torch.no_grad():
        grad = torch.randn_like(fn(*leaves, **kwargs))

    def forward() -> None:
        with torch.no_grad():
            fn(*leaves, **kwargs)

    def forward_backward() -> None:
        fn(*leaves, **kwargs).backward(grad)
        for leaf in leaves:
            leaf.grad = None

    return forward, forward_backward


# ---- (b) the fused flash kernel against SDPA's flash backend ----------------------------------------------------


def flash_case(n: int, causal: bool, ctx: SuiteContext) -> list[Row]:
    d = DRY_FLASH_HEAD_DIM if ctx.dry_run else FLASH_HEAD_DIM
    batch, heads = DRY_FLASH_SHAPE if ctx.dry_run else shapes(n, d)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, device=ctx.device, dtype=DTYPE) for _ in range(3))
    base: Row = {"case": f"n={n} causal={causal}", "n": n, "head_dim": d, "causal": causal, "batch": batch,
                 "heads": heads, "dtype": str(DTYPE).removeprefix("torch.")}
    rows = []
    for impl, fn in {"triton": triton_flash, **BASELINES}.items():
        ctx.case_started(f"n={n} causal={causal}, {impl}")
        row: Row = {**base, "impl": impl}
        missing = unavailable(impl, ctx.device)
        if missing:
            rows.append({**row, "status": f"unavailable: {missing}"})
            ctx.record(rows[-1:])
            continue
        no_backward = backward_unavailable(impl, ctx.device)
        fwd_bwd_ms = None
        try:
            forward, forward_backward = fwd_and_fwd_bwd(fn, [q, k, v], causal=causal, grad=not no_backward)
            # The first call autotunes (Triton) or compiles (FlexAttention) a shape: not in the timed calls.
            forward() if no_backward else forward_backward()
            fwd_ms = time_ms(forward, ctx)
            if not no_backward:
                fwd_bwd_ms = time_ms(forward_backward, ctx)
            with torch.no_grad():
                error = (fn(q, k, v, causal).float() - sdpa_flash(q, k, v, causal).float()).abs().max().item()
        except Exception as err:  # noqa: BLE001 - recorded in the row; the part's status names it
            # Only the subject's failure is the part's error; a baseline that refuses these inputs is unavailable.
            status = row_status(err)
            rows.append({**row, "status": status if impl in ("triton", "sdpa-flash") or status == "oom"
                         else f"unavailable: {status.removeprefix('error: ')}"})
            ctx.record(rows[-1:])
            continue
        finally:
            release_memory(ctx.device)
        row.update({"status": f"unavailable: {no_backward}" if no_backward else "ok", "fwd_ms": fwd_ms,
                    "fwd_bwd_ms": fwd_bwd_ms if fwd_bwd_ms is not None else "",
                    "fwd_tflops": attention_flops(batch, heads, n, d, causal, False) / fwd_ms / 1e9,
                    "fwd_bwd_tflops": (attention_flops(batch, heads, n, d, causal, True) / fwd_bwd_ms / 1e9
                                       if fwd_bwd_ms is not None else ""),
                    "max_abs_err_vs_sdpa": error})
        configs = tuned_launch_configs(q, k, causal) if impl == "triton" else {}
        row.update({f"{name}_config": format_config(configs.get(name)) for name in KERNEL_NAMES})
        rows.append(row)
        ctx.record([row])  # each implementation's row as it finishes: a stop mid-case keeps it
    return rows


def flash_cases(ctx: SuiteContext) -> list[tuple[int, bool]]:
    """(n, causal) of every case, shortest first (what a budget keeps when it shrinks the part)."""
    return [(n, causal) for n in (DRY_FLASH_LENGTHS if ctx.dry_run else FLASH_LENGTHS) for causal in (False, True)]


def run_flash(ctx: SuiteContext) -> PartResult:
    rows: list[Row] = []
    chosen = ctx.select(flash_cases(ctx))
    for n, causal in chosen:
        start = time.perf_counter()
        case_rows = flash_case(n, causal, ctx)
        rows.extend(case_rows)
        ctx.case_finished()
        line = " | ".join(f"{r['impl']} {r['fwd_bwd_tflops']:.3g} TFLOP/s fwd+bwd" if r["status"] == "ok"
                          else f"{r['impl']} {r['status'][:60]}" for r in case_rows)
        print(f"  flash n={n:6d} causal={causal!s:5}: {line} ({time.perf_counter() - start:.1f}s)", flush=True)
    add_ratios(rows, key="case", baseline=lambda r: r["impl"] == "sdpa-flash",
               columns={"fwd_ms": "fwd_speedup_vs_sdpa", "fwd_bwd_ms": "fwd_bwd_speedup_vs_sdpa"})
    d = DRY_FLASH_HEAD_DIM if ctx.dry_run else FLASH_HEAD_DIM
    lengths = tuple(dict.fromkeys(n for n, _ in chosen))
    return PartResult(rows, status_of_rows(rows, ctx), settings={"dtype": "bfloat16", "head_dim": d, "n": lengths})


# ---- (c) long sequences: the sorted-chunk kernel and the lsh / hyper / linformer layers ---------------------------


def long_calls(impl: str, n: int, causal: bool, ctx: SuiteContext) -> Callable[[], None]:
    """The forward + backward closure of one (c) case; it holds the case's layer and inputs."""
    model = DRY_LONG_MODEL if ctx.dry_run else LONG_MODEL
    d_model, heads = model["d_model"], model["heads"]
    torch.manual_seed(0)
    if impl in ("sdpa", "chunked", *BASELINES):
        q, k, v = (torch.randn(1, heads, n, d_model // heads, device=ctx.device, dtype=DTYPE) for _ in range(3))
        if impl != "chunked":
            return fwd_and_fwd_bwd(BASELINES.get(impl, sdpa_flash), [q, k, v], causal=causal)[1]

        def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return chunked_flash_attention(q, k, v, model["chunk"], lookback=1, causal=causal)[0]

        return fwd_and_fwd_bwd(chunked, [q, k, v])[1]
    settings = Settings(lengths=(n,), d_model=d_model, heads=heads, batch=1, dtype=DTYPE)
    name = impl.removesuffix(COMPILED).removesuffix(GRAPHED)
    layer, shared_state = build_layer(Variant(name, LAYER_KIND_OF.get(name, name), layer_knobs(name, n, model)), n,
                                      settings)
    layer = layer.to(device=ctx.device, dtype=DTYPE).train()
    shared_state.to(device=ctx.device, dtype=DTYPE)
    x_BTD = torch.randn(1, n, d_model, device=ctx.device, dtype=DTYPE)
    if impl.endswith(COMPILED):  # compiled by the first (untimed) call
        # Each case compiles from scratch: the layers share their forward's code, whose recompiles for each new
        # layer and shape would reach dynamo's recompile limit and fall back to eager unannounced.
        torch._dynamo.reset()
        layer = torch.compile(layer, backend="inductor" if ctx.device.type == "cuda" else "eager")
    if impl.endswith(GRAPHED):
        return fwd_and_fwd_bwd(graphed_layer(layer, x_BTD, causal), [x_BTD])[1]

    def apply(x_BTD: torch.Tensor) -> torch.Tensor:
        return layer(x_BTD, causal=causal)

    return fwd_and_fwd_bwd(apply, [x_BTD])[1]


LONG_BASELINES = ("sdpa-cudnn", "flex", "fa3")
"""Bare attention beside `sdpa` (SDPA's flash backend): baselines.py."""


def long_impls(causal: bool) -> list[str]:
    """Linformer compresses the keys of the whole sequence: it has no causal form (its mechanism says so)."""
    return ["sdpa", *LONG_BASELINES, "chunked", *(kind for kind in LAYER_KINDS if not (causal and kind == "linformer")),
            *(kind + GRAPHED for kind in GRAPHED_KINDS)]


def long_cases(ctx: SuiteContext) -> list[tuple[int, bool]]:
    """(n, causal) of every case, shortest first."""
    lengths = ctx.long_lengths or (DRY_LONG_LENGTHS if ctx.dry_run else LONG_LENGTHS + NON_CAUSAL_ONLY_LENGTHS)
    return [(n, causal) for n in sorted(lengths)
            for causal in ((False,) if n in NON_CAUSAL_ONLY_LENGTHS else (False, True))]


def run_long(ctx: SuiteContext) -> PartResult:
    rows: list[Row] = []
    stopped: dict[tuple[str, bool], str] = {}  # (impl, causal) -> why its larger sizes are skipped
    chosen = ctx.select(long_cases(ctx))
    for n, causal in chosen:
        # Each row's time is printed as it lands (one line per case): a call stopped mid-case keeps them on its console.
        print(f"  long n={n:6d} causal={causal!s:5}: ", end="", flush=True)
        line = []
        for impl in long_impls(causal):
            ctx.case_started(f"n={n} causal={causal}, {impl}")
            row: Row = {"case": f"n={n} causal={causal}", "impl": impl, "n": n, "causal": causal,
                        "dtype": str(DTYPE).removeprefix("torch.")}
            if (impl, causal) in stopped:
                rows.append({**row, "status": f"skipped: {stopped[impl, causal]}"})
                ctx.record(rows[-1:])
                continue
            missing = ((unavailable(impl, ctx.device) or backward_unavailable(impl, ctx.device)) if impl in BASELINES
                       else graphs_unavailable(ctx.device) if impl.endswith(GRAPHED) else None)
            if missing:  # a baseline (baselines.py) or CUDA graphs that cannot run here: recorded, not an error
                rows.append({**row, "status": f"unavailable: {missing}"})
                ctx.record(rows[-1:])
                line.append(f"{impl} unavailable")
                print(f"{' | ' if len(line) > 1 else ''}{line[-1]}", end="", flush=True)
                continue
            step = None
            try:
                step = long_calls(impl, n, causal, ctx)
                step()  # the first call: autotuning, hash set-up; not timed
                row.update({"status": "ok", "fwd_bwd_ms": time_ms(step, ctx)})
            except Exception as err:  # noqa: BLE001 - recorded in the row; the part's status names it
                row["status"] = row_status(err)
                if impl in BASELINES and row["status"] != "oom":  # a baseline refusing these inputs: unavailable
                    row["status"] = f"unavailable: {row['status'].removeprefix('error: ')}"
                if row["status"] == "oom":
                    stopped[impl, causal] = f"oom at n={n}"
            finally:
                del step  # the layer, its inputs and gradients go before the next (larger) case, also after an oom
                release_memory(ctx.device)
            rows.append(row)
            ctx.record([row])
            line.append(f"{impl} {row['fwd_bwd_ms']:.3g} ms" if row["status"] == "ok" else f"{impl} {row['status'][:40]}")
            print(f"{' | ' if len(line) > 1 else ''}{line[-1]}", end="", flush=True)
        print(flush=True)
        ctx.case_finished()
    add_ratios(rows, key="case", baseline=lambda r: r["impl"] == "sdpa", columns={"fwd_bwd_ms": "speedup_vs_sdpa"})
    add_ratios(rows, key="case", baseline=lambda r: r["impl"] == "mha", columns={"fwd_bwd_ms": "speedup_vs_mha"})
    model = DRY_LONG_MODEL if ctx.dry_run else LONG_MODEL
    settings = {"dtype": "bfloat16", "n": tuple(dict.fromkeys(n for n, _ in chosen)),
                "d_model": model["d_model"], "heads": model["heads"], "chunk": model["chunk"],
                **{f"{kind} knobs": knobs or "defaults" for kind, knobs in model["knobs"].items()}}
    oom = sorted({reason for reason in stopped.values()})
    return PartResult(rows, status_of_rows(rows, ctx), note="; ".join(oom), settings=settings)
