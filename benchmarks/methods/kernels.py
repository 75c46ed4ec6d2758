"""Time, TFLOP/s and peak memory of the Triton FlashAttention-2 kernel (kernels.flash_attention; Dao, 2023,
arXiv 2307.08691) against torch SDPA restricted to its flash backend, in the same run on the same GPU.

Cases: n = 1k ... 64k, head dim 64 and 128, causal and not, bf16, forward and forward + backward. As in the
FlashAttention README, the hidden size is 2048 (heads = 2048 / d) and the batch keeps 16k tokens per step
(batch = max(1, 16384 / n)). FLOPs are counted as in the Triton tutorial: 4 B H n^2 d for the forward, halved
when causal, times 3.5 for forward + backward (the backward is 2.5 forwards).

    python -m benchmarks.methods.kernels --out benchmarks/results            # full sweep, a few minutes on an H100
    python -m benchmarks.methods.kernels --quick --out benchmarks/results    # n = 1k and 4k only

Before timing, each (d, causal) pair is checked against SDPA at the smallest n (max abs error of out in the
CSV), so a fast but wrong kernel cannot produce a good-looking table. The Triton kernels autotune their
block sizes per (n rounded up to a power of two, d, causal, dtype) at the first call of a case, which the
warmup calls absorb; the configuration each kernel settled on goes into the CSV (fwd_config,
bwd_dkdv_config, bwd_dq_config, as "BLOCK_MxBLOCK_N w<warps> s<stages>"). Without a CUDA GPU this prints
why and exits 0.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from benchmarks.harness import Row, add_ratios, cases, measure, plot_loglog, results_dir, write_csv
from kernels.flash_attention import KERNEL_NAMES, tuned_launch_configs

TOKENS_PER_BATCH = 16384
HIDDEN = 2048
IMPLS = ("triton", "sdpa-flash")
BASELINE = "sdpa-flash"


def shapes(n: int, d: int) -> tuple[int, int]:
    """(batch, heads) at sequence length n and head dim d."""
    return max(1, TOKENS_PER_BATCH // n), HIDDEN // d


def attention_flops(batch: int, heads: int, n: int, d: int, causal: bool, backward: bool) -> float:
    flops = 4.0 * batch * heads * n * n * d * (0.5 if causal else 1.0)
    return flops * 3.5 if backward else flops


def attention_fn(impl: str, causal: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """q, k, v [B, H, n, d] -> out [B, H, n, d] for one implementation."""
    if impl == "triton":
        from kernels import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, causal=causal)[0]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Only the flash backend: a silent fallback to the math kernel would make the comparison meaningless.
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return sdpa


def max_error_vs_sdpa(n: int, d: int, causal: bool, device: torch.device, dtype: torch.dtype) -> float:
    batch, heads = shapes(n, d)
    q, k, v = (torch.randn(batch, heads, n, d, device=device, dtype=dtype) for _ in range(3))
    out = attention_fn("triton", causal)(q, k, v)
    out_ref = attention_fn(BASELINE, causal)(q, k, v)
    return (out.float() - out_ref.float()).abs().max().item()


def format_config(cfg: dict[str, int] | None) -> str:
    """'128x64 w4 s3' (BLOCK_M x BLOCK_N, warps, pipeline stages); '' when the kernel has not run."""
    if cfg is None:
        return ""
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"


def triton_configs(n: int, d: int, causal: bool, dtype: torch.dtype) -> dict[str, str]:
    """The launch configuration each Triton kernel runs with at this case (after it has run)."""
    batch, heads = shapes(n, d)
    like = torch.empty(batch, heads, n, d, dtype=dtype, device="meta")  # only shape and dtype are read
    configs = tuned_launch_configs(like, like, causal)
    return {f"{name}_config": format_config(cfg) for name, cfg in configs.items()}


def calls(impl: str, n: int, d: int, causal: bool, device: torch.device, dtype: torch.dtype):
    """The forward-only and the forward + backward call of one case, on fresh inputs."""
    batch, heads = shapes(n, d)
    fn = attention_fn(impl, causal)
    q, k, v = (torch.randn(batch, heads, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(batch, heads, n, d, device=device, dtype=dtype)

    def forward() -> None:
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward() -> None:
        fn(q, k, v).backward(dout)
        q.grad = k.grad = v.grad = None

    return forward, forward_backward


def run(args: argparse.Namespace, device: torch.device) -> list[Row]:
    dtype = getattr(torch, args.dtype)
    lengths = [2**p for p in range(int(math.log2(args.min_n)), int(math.log2(args.max_n)) + 1)]
    if args.quick:
        lengths = [1024, 4096]
    rows: list[Row] = []
    errors = {}
    for case in cases(d=args.head_dims, causal=(False, True)):
        errors[case["d"], case["causal"]] = max_error_vs_sdpa(lengths[0], case["d"], case["causal"], device, dtype)
        print(f"d={case['d']} causal={case['causal']}: max |triton - sdpa| = {errors[case['d'], case['causal']]:.3g}")
    for case in cases(n=lengths, d=args.head_dims, causal=(False, True), impl=IMPLS):
        n, d, causal, impl = case["n"], case["d"], case["causal"], case["impl"]
        batch, heads = shapes(n, d)
        forward, forward_backward = calls(impl, n, d, causal, device, dtype)
        if impl == "triton":
            # The first call at each tuning key compiles and times every candidate configuration: make it
            # here, so that it counts neither as the first measured call nor against the call budget.
            forward_backward()
        kw = dict(warmup=args.warmup, repeats=args.repeats, call_budget_s=args.call_budget_s)
        fwd = measure(forward, device, **kw)
        fwd_bwd = measure(forward_backward, device, **kw)
        row: Row = {
            "case": f"n={n} d={d} causal={causal}",
            "series": f"{impl} d={d} {'causal' if causal else 'full'}",
            "impl": impl, "n": n, "d": d, "causal": causal, "batch": batch, "heads": heads, "dtype": args.dtype,
            **fwd.as_row("fwd"), **fwd_bwd.as_row("fwd_bwd"),
            "fwd_tflops": attention_flops(batch, heads, n, d, causal, False) / fwd.median_s / 1e12,
            "fwd_bwd_tflops": attention_flops(batch, heads, n, d, causal, True) / fwd_bwd.median_s / 1e12,
            "max_abs_err_vs_sdpa": errors[d, causal],
        }  # fmt: skip
        configs = triton_configs(n, d, causal, dtype) if impl == "triton" else {}
        row.update({f"{name}_config": configs.get(f"{name}_config", "") for name in KERNEL_NAMES})  # sdpa: ""
        print(
            f"{row['series']:>28} n={n:>6}: fwd {fwd.status} {fwd.median_s * 1e3:9.3f} ms "
            f"{row['fwd_tflops']:7.1f} TFLOP/s | fwd+bwd {fwd_bwd.status} {fwd_bwd.median_s * 1e3:9.3f} ms "
            f"{row['fwd_bwd_tflops']:7.1f} TFLOP/s | peak {fwd_bwd.peak_bytes / 2**20:9.1f} MiB"
            + (f" | {row['fwd_config']} / {row['bwd_dkdv_config']} / {row['bwd_dq_config']}" if configs else "")
        )
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    add_ratios(
        rows, key="case", baseline=lambda r: r["impl"] == BASELINE,
        columns={"fwd_median_s": "fwd_speedup_vs_sdpa", "fwd_bwd_median_s": "fwd_bwd_speedup_vs_sdpa"},
    )  # fmt: skip
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="results root; files go to <out>/<machine>/")
    parser.add_argument("--quick", action="store_true", help="n = 1024 and 4096 only")
    parser.add_argument("--min-n", type=int, default=1024)
    parser.add_argument("--max-n", type=int, default=65536)
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--call-budget-s", type=float, default=60.0)
    parser.add_argument("--name", default="kernels", help="file stem of the CSV and PNG")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.methods.kernels: no CUDA GPU here; the Triton kernels and SDPA's flash backend need one.")
        print("Nothing measured.")
        return 0
    device = torch.device("cuda")
    rows = run(args, device)
    folder = results_dir(args.out, device)
    csv_path = write_csv(rows, folder / f"{args.name}.csv")
    png_path = plot_loglog(
        rows, folder / f"{args.name}.png", x="n", series="series",
        panels={"fwd_median_s": "forward (s)", "fwd_bwd_median_s": "forward + backward (s)",
                "fwd_bwd_tflops": "forward + backward TFLOP/s", "fwd_bwd_peak_mb": "fwd + bwd peak memory (MiB)"},
        title=f"Triton FlashAttention-2 vs SDPA flash, {args.dtype}, {torch.cuda.get_device_name(device)}",
    )  # fmt: skip
    print(f"wrote {csv_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
