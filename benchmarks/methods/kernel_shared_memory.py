"""The flash kernels' shared memory as the compiler allocates it, against `shared_memory_estimate`, which must
bound it: `prune_configs` keeps the autotuner's candidates by the estimate, and a candidate that needs more than
the device has fails at launch. Every candidate of CONFIGS, head dims 64 and 128, bf16, is compiled for sm_90
(H100, H200) and sm_80 (A100) on this machine, through Triton's bundled ptxas (kernels/offline_compile.py), with
whatever Triton is installed: run it once per Triton version a GPU may bring (the GPU image's 3.6, CI's 3.9).

    python -m benchmarks.methods.kernel_shared_memory --out benchmarks/results      # about 3 min on 2 cores cold
    /tmp/v36/bin/python -m benchmarks.methods.kernel_shared_memory --out benchmarks/results   # a Triton 3.6 venv

Writes this Triton's rows into `<out>/<machine>/kernel_shared_memory.csv`, replacing its earlier ones and keeping
the other versions': one row per (kernel, arch, head dim, candidate), with the compiler's bytes, the estimate's,
and the slack (estimate - compiler; negative where the bound fails). Prints the candidates over the estimate,
and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

from benchmarks.harness import Row, read_csv, results_dir, write_csv

ARCHS = (90, 80)
HEAD_DIMS = (64, 128)
MASKS = dict(CAUSAL=True, HAS_KPM=False, EVEN_M=True, EVEN_N=True, EVEN_D=True)


def rows_for_this_triton() -> list[Row]:
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compiled, not interpreted
    import triton

    from kernels import k_flash_attention as kf
    from kernels.offline_compile import shared_memory

    kernels = {"fwd": kf._flash_fwd, "bwd_dkdv": kf._flash_bwd_dkdv, "bwd_dq": kf._flash_bwd_dq}
    rows: list[Row] = []
    for name, fn in kernels.items():
        for config in kf.CONFIGS[name]:
            cfg = {**config.kwargs, "num_stages": config.num_stages}
            for head_dim in HEAD_DIMS:
                estimate = kf.shared_memory_estimate(name, cfg, head_dim, 2)
                for arch in ARCHS:
                    constexprs = {"DOT_PRECISION": "tf32", "DOT_UPCAST": False, "BLOCK_D": head_dim, **MASKS,
                                  **config.kwargs}
                    compiled = shared_memory(fn, constexprs, config.num_warps, config.num_stages, arch)
                    rows.append({"triton": triton.__version__, "kernel": name, "arch": f"sm_{arch}",
                                 "head_dim": head_dim, "dtype": "bf16", "block_m": cfg["BLOCK_M"],
                                 "block_n": cfg["BLOCK_N"], "num_warps": config.num_warps,
                                 "num_stages": config.num_stages, "compiler_bytes": compiled,
                                 "estimate_bytes": estimate, "slack_bytes": estimate - compiled})
                    print(f"triton {triton.__version__} {name} sm_{arch} d{head_dim} {config.kwargs} "
                          f"stages {config.num_stages}: compiler {compiled:,} B, estimate {estimate:,} B", flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="results root (a machine folder is added)")
    args = parser.parse_args(argv)
    rows = rows_for_this_triton()
    path = results_dir(args.out, torch.device("cpu")) / "kernel_shared_memory.csv"
    version = rows[0]["triton"]
    kept = [r for r in read_csv(path) if r["triton"] != version] if path.exists() else []
    write_csv([*kept, *rows], path)  # this Triton's rows replaced, the other versions' kept
    over = [r for r in rows if r["slack_bytes"] < 0]
    for r in over:
        print(f"OVER THE ESTIMATE: {r['kernel']} {r['arch']} d{r['head_dim']} {r['block_m']}x{r['block_n']} "
              f"stages {r['num_stages']}: {r['compiler_bytes']:,} > {r['estimate_bytes']:,}")
    slack = [r["slack_bytes"] for r in rows]
    print(f"{len(rows)} compiles with triton {version}: {len(over)} over the estimate; slack {min(slack):,} to "
          f"{max(slack):,} B; {path}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
