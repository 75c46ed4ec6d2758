"""Attention time and peak memory against sequence length, for every kind in the registry.

One attention layer (batch 1, d_model 512, 8 heads by default) runs forward-only under `no_grad` (the
inference setting of the Linformer paper's Table 3, Wang et al., 2020, arXiv 2006.04768) and
forward + backward (a training step's attention cost) at n = 512 ... 16k on a CPU, up to 64k on a GPU.
Each variant's time and memory are divided into `mha`'s at the same n in the same run: `fwd_speedup_vs_mha`
is the paper's "time saved", `fwd_mem_ratio_vs_mha` our counterpart of its "memory saved" (the paper
measures the largest batch that fits in 16 GB instead; see benchmarks/RESULTS.md).

    python -m benchmarks.methods.attention_scaling --out benchmarks/results            # full
    python -m benchmarks.methods.attention_scaling --quick --out benchmarks/results    # about 30 s of CPU time

A focused run (Linformer and its mha baselines at n <= 2048, one thread, its own CSV and PNG):

    python -m benchmarks.methods.attention_scaling --kinds linformer --max-n 2048 --threads 1 --name attention_scaling_linformer
    python -m benchmarks.methods.attention_scaling --linformer-paths --max-n 2048 --threads 1 --name attention_scaling_linformer

A variant that fails (not implemented, out of memory) is recorded with its error; one whose single call
exceeds `--call-budget-s` is recorded as over_budget and its larger n as skipped, never silently dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.harness import (
    Measurement, Row, add_ratios, describe_error, interleaved_medians, measure, peak_memory_bytes, plot_loglog,
    read_csv, results_dir, write_csv,
)
from models import ModelConfig
from models.attention import ATTENTION_KINDS, build_attention

BASELINE = "mha"
MATH_BASELINE = "mha-math"


@dataclass(frozen=True)
class Variant:
    """One attention configuration: `label` names it in the CSV and the plot legend."""

    label: str
    kind: str
    knobs: dict = field(default_factory=dict)
    math_sdpa: bool = False
    """Force SDPA's math backend, which materialises the n x n scores like the 2017 Transformer the
    Linformer paper measured against; by default torch picks a fused (flash) kernel with O(n) memory."""


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...]
    d_model: int = 512
    heads: int = 8
    batch: int = 1
    linformer_k: tuple[int, ...] = (128, 256)
    lsh_bucket: int = 64
    lsh_hashes: tuple[int, ...] = (1, 4, 8)
    warmup: int = 1
    repeats: int = 5
    call_budget_s: float = 120.0
    """A single call slower than this ends the variant (over_budget) for this and larger n."""
    timing_budget_s: float = 30.0
    """Timed repeats are cut to take about this long per case (at least one)."""
    max_materialised_gb: float = 6.0
    """math-SDPA calls whose estimated n x n buffers exceed this are skipped (the machine is shared)."""
    dtype: torch.dtype = torch.float32
    kinds: tuple[str, ...] = ATTENTION_KINDS


def variants(settings: Settings) -> list[Variant]:
    """Every kind of the registry; Linformer at each k x sharing mode, LSH at each hash count, others at defaults."""
    out: list[Variant] = []
    for kind in settings.kinds:
        if kind == "linformer":
            for k in settings.linformer_k:
                for sharing in ("none", "headwise", "kv", "layerwise"):
                    out.append(Variant(f"linformer k={k} {sharing}", kind, {"k": k, "sharing": sharing}))
        elif kind == "lsh":
            for hashes in settings.lsh_hashes:
                knobs = {"bucket_size": settings.lsh_bucket, "n_hashes": hashes}
                out.append(Variant(f"lsh b={settings.lsh_bucket} h={hashes}", kind, knobs))
        else:
            out.append(Variant(kind, kind))
        if kind == BASELINE:
            out.append(Variant(MATH_BASELINE, kind, math_sdpa=True))
    return out


# Live n x n float buffers of math SDPA, in score matrices: scores and probabilities forward; their
# gradients on top in backward (measured on CPU: about 2.3 forward, 4.5 forward + backward).
_MATERIALISED = {"fwd": 3, "fwdbwd": 5}


def _over_memory_limit(variant: Variant, n: int, mode: str, settings: Settings) -> str | None:
    if not variant.math_sdpa:
        return None
    itemsize = torch.empty((), dtype=settings.dtype).element_size()
    estimate_gb = _MATERIALISED[mode] * settings.batch * settings.heads * n * n * itemsize / 2**30
    if estimate_gb <= settings.max_materialised_gb:
        return None
    return f"skipped: about {estimate_gb:.0f} GiB of n x n buffers > --max-materialised-gb {settings.max_materialised_gb:g}"


def build_layer(variant: Variant, n: int, settings: Settings) -> tuple[nn.Module, nn.ModuleDict]:
    """The attention of layer 0 of a model with max_seq_len = n, and the model-owned shared state it uses."""
    cfg = ModelConfig(
        d_model=settings.d_model, layers=1, ffn=4 * settings.d_model, dropout=0.0, max_seq_len=n,
        attention={"kind": variant.kind, "heads": settings.heads, **variant.knobs},
    )
    shared_state = nn.ModuleDict()
    layer = build_attention(cfg.attention, 0, shared_state)
    return layer, shared_state


def _calls(layer: nn.Module, shared_state: nn.ModuleDict, x_BTD: torch.Tensor, math_sdpa: bool,
           apply: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda layer, x_BTD: layer(x_BTD)):
    """Forward under no_grad (inference), and forward + backward from a fixed upstream gradient."""
    grad_BTD = torch.randn_like(x_BTD)
    x_grad_BTD = x_BTD.detach().clone().requires_grad_(True)

    def backend():
        return sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext()

    def forward() -> None:
        with torch.no_grad(), backend():
            apply(layer, x_BTD)

    def forward_backward() -> None:
        # Drop old gradients so every call allocates them afresh, as the first step of training does.
        layer.zero_grad(set_to_none=True)
        shared_state.zero_grad(set_to_none=True)
        x_grad_BTD.grad = None
        with backend():
            apply(layer, x_grad_BTD).backward(grad_BTD)

    return forward, forward_backward


def run(settings: Settings, device: torch.device) -> list[Row]:
    rows: list[Row] = []
    # The first memory-profiled call of a process starts the profiler (seconds on a loaded CPU); pay that here,
    # not in the first case, whose single slow call would otherwise be its whole measurement.
    peak_memory_bytes(lambda: None, device)
    for variant in variants(settings):
        stopped: str | None = None  # why larger n are skipped for this variant
        for n in settings.lengths:
            row: Row = {"variant": variant.label, "kind": variant.kind, "n": n, "batch": settings.batch,
                        "d_model": settings.d_model, "heads": settings.heads, "threads": torch.get_num_threads()}
            if stopped is not None:
                skipped = Measurement(f"skipped: {stopped}")
                rows.append({**row, **skipped.as_row("fwd"), **skipped.as_row("fwdbwd")})
                continue
            try:
                torch.manual_seed(0)
                layer, shared_state = build_layer(variant, n, settings)
                layer = layer.to(device=device, dtype=settings.dtype).eval()
                shared_state = shared_state.to(device=device, dtype=settings.dtype)
                x_BTD = torch.randn(settings.batch, n, settings.d_model, device=device, dtype=settings.dtype)
            except (ValueError, RuntimeError, NotImplementedError) as err:
                failed = Measurement(describe_error(err))
                rows.append({**row, **failed.as_row("fwd"), **failed.as_row("fwdbwd")})
                print(f"{variant.label:28s} n={n:6d}  {failed.status}", flush=True)
                continue
            calls = dict(zip(("fwd", "fwdbwd"), _calls(layer, shared_state, x_BTD, variant.math_sdpa)))
            budget = {"warmup": settings.warmup, "repeats": settings.repeats,
                      "call_budget_s": settings.call_budget_s, "timing_budget_s": settings.timing_budget_s}
            fwd, fwdbwd = (
                Measurement(reason) if (reason := _over_memory_limit(variant, n, mode, settings))
                else measure(fn, device, **budget)
                for mode, fn in calls.items()
            )
            rows.append({**row, **fwd.as_row("fwd"), **fwdbwd.as_row("fwdbwd")})
            print(f"{variant.label:28s} n={n:6d}  fwd {fwd.median_s:9.4f}s {fwd.peak_bytes / 2**20:9.1f}MB {fwd.status}"
                  f" | fwd+bwd {fwdbwd.median_s:9.4f}s {fwdbwd.peak_bytes / 2**20:9.1f}MB {fwdbwd.status}", flush=True)
            if "over_budget" in (fwd.status, fwdbwd.status):
                stopped = f"over_budget at n={n}"
            del layer, shared_state, x_BTD, calls
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for baseline, suffix in ((BASELINE, "mha"), (MATH_BASELINE, "mha_math")):
        add_ratios(
            rows, key="n", baseline=lambda r, b=baseline: r["variant"] == b,
            columns={"fwd_median_s": f"fwd_speedup_vs_{suffix}", "fwdbwd_median_s": f"fwdbwd_speedup_vs_{suffix}",
                     "fwd_peak_mb": f"fwd_mem_ratio_vs_{suffix}", "fwdbwd_peak_mb": f"fwdbwd_mem_ratio_vs_{suffix}"},
        )
    return rows


def _project_first(layer: nn.Module, x_BTD: torch.Tensor) -> torch.Tensor:
    """Linformer in the paper's order: K, V projected at all n positions, then compressed by the mechanism."""
    q_BHTE, k_BHSE, v_BHSE = layer.projection.qkv(x_BTD, x_BTD)
    return layer.projection.output(layer.mechanism(q_BHTE, k_BHSE, v_BHSE))


def linformer_paths(settings: Settings, device: torch.device) -> list[Row]:
    """Linformer layers that compress their input first, timed against the project-first order, paired.

    Same layer, weights and input; the two orders alternate call by call (harness.interleaved_medians), so
    load from other processes hits both alike. `*_paired_speedup` is the median over rounds of
    project-first time / compress-first time.
    """
    rows: list[Row] = []
    for n in settings.lengths:
        for k in settings.linformer_k:
            for sharing in ("headwise", "kv", "layerwise"):
                torch.manual_seed(0)
                layer, shared_state = build_layer(Variant("", "linformer", {"k": k, "sharing": sharing}), n, settings)
                layer = layer.to(device=device, dtype=settings.dtype).eval()
                shared_state = shared_state.to(device=device, dtype=settings.dtype)
                assert layer.compresses_context
                x_BTD = torch.randn(settings.batch, n, settings.d_model, device=device, dtype=settings.dtype)
                compress = dict(zip(("fwd", "fwdbwd"), _calls(layer, shared_state, x_BTD, False)))
                project = dict(zip(("fwd", "fwdbwd"), _calls(layer, shared_state, x_BTD, False, _project_first)))
                calls = {f"{mode} {order}": fns[mode] for order, fns in (("compress", compress), ("project", project))
                         for mode in ("fwd", "fwdbwd")}
                times = interleaved_medians(calls, device, warmup=settings.warmup, repeats=settings.repeats)
                row: Row = {"variant": f"linformer k={k} {sharing}", "n": n, "k": k, "sharing": sharing,
                            "batch": settings.batch, "d_model": settings.d_model, "heads": settings.heads,
                            "threads": torch.get_num_threads(), "repeats": settings.repeats}
                for mode in ("fwd", "fwdbwd"):
                    first, later = times[f"{mode} project"], times[f"{mode} compress"]
                    row[f"{mode}_project_first_s"] = statistics.median(first)
                    row[f"{mode}_compress_first_s"] = statistics.median(later)
                    row[f"{mode}_paired_speedup"] = statistics.median(p / c for p, c in zip(first, later))
                print(f"{row['variant']:28s} n={n:6d}  fwd {row['fwd_paired_speedup']:.2f}x  "
                      f"fwd+bwd {row['fwdbwd_paired_speedup']:.2f}x", flush=True)
                rows.append(row)
    return rows


def paper_comparison(rows: Sequence[Row], ks: Sequence[int], suffix: str) -> str:
    """Markdown: forward speed-up and memory ratio of layerwise Linformer vs the baseline `suffix`, per n and k."""
    lines = ["| n | " + " | ".join(f"k={k} time | k={k} memory" for k in ks) + " |",
             "|---|" + "---|---|" * len(ks)]
    for n in sorted({r["n"] for r in rows}):
        cells = []
        for k in ks:
            row = next((r for r in rows if r["n"] == n and r["variant"] == f"linformer k={k} layerwise"), None)
            for column in (f"fwd_speedup_vs_{suffix}", f"fwd_mem_ratio_vs_{suffix}"):
                value = math.nan if row is None else row.get(column, math.nan)
                cells.append(f"{value:.2f}x" if math.isfinite(value) else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="results root; files go to <out>/<machine>/")
    parser.add_argument("--quick", action="store_true", help="n = 256, 512 and 2 repeats (under a minute)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-n", type=int, default=None, help="largest n (default 16384 on CPU, 65536 on GPU)")
    parser.add_argument("--min-n", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--call-budget-s", type=float, default=120.0)
    parser.add_argument("--timing-budget-s", type=float, default=30.0)
    parser.add_argument("--max-materialised-gb", type=float, default=6.0,
                        help="skip mha-math calls whose n x n buffers would exceed this")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); 1 is steadier on a loaded shared CPU")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--kinds", nargs="*", default=list(ATTENTION_KINDS), help="subset of the registry's kinds")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--linformer-k", type=int, nargs="*", default=[128, 256])
    parser.add_argument("--lsh-bucket", type=int, default=64)
    parser.add_argument("--name", default="attention_scaling", help="file stem of the CSV and PNG")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the existing CSV; measure nothing")
    parser.add_argument("--linformer-paths", action="store_true",
                        help="instead: Linformer's compress-first layer against project-first, paired (<name>_paths.csv)")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace, device: torch.device) -> Settings:
    unknown = sorted(set(args.kinds) - set(ATTENTION_KINDS))
    if unknown:
        raise SystemExit(f"--kinds {unknown} are not in the registry; valid kinds: {', '.join(ATTENTION_KINDS)}")
    max_n = args.max_n or (16384 if device.type == "cpu" else 65536)
    min_n = args.min_n
    if args.quick:  # two sizes, two repeats, a short timing budget: every variant's code path in under a minute
        min_n, max_n = 256, 512
        args.repeats, args.timing_budget_s = 2, min(args.timing_budget_s, 1.0)
    lengths = tuple(2**e for e in range(int(math.log2(min_n)), int(math.log2(max_n)) + 1))
    kinds = tuple(k for k in ATTENTION_KINDS if k in args.kinds)
    if BASELINE not in kinds:
        kinds = (BASELINE, *kinds)  # ratios need the baseline in the same run
    return Settings(
        lengths=lengths, d_model=args.d_model, heads=args.heads, linformer_k=tuple(args.linformer_k),
        lsh_bucket=args.lsh_bucket, repeats=args.repeats, call_budget_s=args.call_budget_s,
        timing_budget_s=args.timing_budget_s, max_materialised_gb=args.max_materialised_gb, dtype=getattr(torch, args.dtype), kinds=kinds,
    )


def plot(rows: Sequence[Row], path: Path, settings_line: str) -> Path:
    return plot_loglog(
        rows, path, x="n", series="variant", group="kind",
        panels={"fwd_median_s": "forward time (s)", "fwdbwd_median_s": "forward+backward time (s)",
                "fwd_peak_mb": "forward peak memory (MiB)", "fwdbwd_peak_mb": "forward+backward peak memory (MiB)"},
        title=f"Attention scaling on {path.parent.name}: {settings_line}",
    )


def _numeric(row: dict[str, str]) -> Row:
    """A CSV row with its numbers parsed back (for --replot)."""
    out: Row = {}
    for key, value in row.items():
        try:
            out[key] = int(value) if key in ("n", "batch", "d_model", "heads", "threads") else float(value)
        except ValueError:
            out[key] = value
    return out


def _threads(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = settings_from_args(args, device)
    folder = results_dir(args.out, device)
    csv_path = folder / f"{args.name}.csv"
    settings_line = (f"batch {settings.batch}, d_model {settings.d_model}, {settings.heads} heads, "
                     f"{str(settings.dtype).removeprefix('torch.')}")
    if args.replot:
        rows = [_numeric(row) for row in read_csv(csv_path)]
        if "threads" in rows[0]:  # CSVs written before the column existed do not say
            settings_line += f", {_threads(rows[0]['threads'])}"
        print(f"wrote {plot(rows, folder / f'{args.name}.png', settings_line)}")
        return rows
    if args.linformer_paths:
        rows = linformer_paths(settings, device)
        print(f"wrote {write_csv(rows, folder / f'{args.name}_paths.csv')}")
        return rows
    rows = run(settings, device)
    write_csv(rows, csv_path)
    plot(rows, folder / f"{args.name}.png", f"{settings_line}, {_threads(torch.get_num_threads())}")
    print(f"wrote {csv_path}")
    if "linformer" in settings.kinds:
        for suffix in ("mha", "mha_math"):
            print(f"\nLinformer (layerwise) vs {suffix}, forward:\n" + paper_comparison(rows, settings.linformer_k, suffix))
    return rows


if __name__ == "__main__":
    main()
