"""The glue around the attention kernels, measured on a CPU: the proxies of a GPU run (issue 55).

The layers of the GPU suite's `long_attention` part (benchmarks/gpu/speed.py `LONG_MODEL`: d_model 1024, 16 heads
of 64, bf16, batch 1; `mha` with SDPA inside, `lsh` with buckets of 64 and 2 hash rounds, `hyper` at its
defaults, `linformer` k = 256 headwise) and `lsh-r4` (4 rounds, the issue's bar), causal and not, at
n = 4k ... 128k and 256k, run forward + backward on fake tensors (`FakeTensorMode`: shapes and dtypes, no
storage). The Triton kernels are replaced by their stand-in (kernels.dispatch.stand_in_kernels): their wrappers
allocate what they allocate on a GPU and each launch is counted instead of run. Per case:

- `peak_mib`: peak memory of forward + backward, from PyTorch's tracker on fake tensors (the planner's
  `orchestrator.spec.counting.peak_tracker`): weights, the input and its gradient, activations, temporaries;
- `glue_mib`, `glue_launches`: bytes of the new tensors made by aten ops outside the attention kernels, and the
  number of those ops (view ops and bare allocations, which launch nothing on a GPU, are not counted as launches);
- `kernel_launches`: the Triton kernels' launches (the stand-in's count) plus SDPA's attention ops, with the
  bytes of the buffers they fill (`kernel_mib`: out, lse, delta, dq, dk, dv).

The counter is `GlueCounter`; what it counts as a kernel is everything between the kernels' autograd.Function
boundaries (kernels/stand_in.py `kernel_region`) and SDPA's fused ops. It counts the ops the CPU dispatches;
where a GPU run would take another path (SDPA's CPU kernel) the docstring of `run_case` says so. Fake tensors have
no values, so a layer that reads one back from the device (a host sync) fails here, as it would fail a CUDA graph's
capture.

    python -m benchmarks.methods.attention_glue --label before        # rows of this code version, into the CSV
    python -m benchmarks.methods.attention_glue --label after --kinds lsh lsh-r4 --max-n 65536

Rows of every run stay in benchmarks/results/cpu-2core/attention_glue.csv (a rerun with the same label and commit
replaces its rows), each with the git commit that produced it (`version`; `+dirty` when tracked code differed).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.methods.attention_scaling import Settings, Variant, build_layer
from benchmarks.gpu.speed import LAYER_KIND_OF, LAYER_KINDS, LONG_MODEL, layer_knobs
from benchmarks.harness import Row, code_version, read_csv, results_dir, write_csv
from kernels import stand_in
from kernels.dispatch import stand_in_kernels

DTYPE = torch.bfloat16
LENGTHS = tuple(2**p for p in range(12, 18)) + (2**18,)
"""4k ... 128k as the GPU suite, and 256k (every case is batch 1)."""
LAYERS: dict[str, str] = {label: LAYER_KIND_OF.get(label, label) for label in LAYER_KINDS}
"""label -> kind: the GPU suite's layers (LSH at 2 and at the 4 rounds of the issue's bar, and at 4 factorized);
their knobs at each n are speed.layer_knobs'."""
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
"""aten ops (by name, any overload) that only allocate: no launch on a GPU, and inside a kernel's Function they are
the kernel's buffers."""
NO_COPY = frozenset({"_unsafe_view", "_reshape_alias", "lift_fresh", "alias"})
"""aten ops that share their input's storage without a view's alias annotation: neither a launch nor new bytes."""


def is_sdpa(func: Any) -> bool:
    """SDPA's fused attention ops (forward and backward, any backend): `mha`'s attention kernel."""
    return "scaled_dot_product" in func._opname


def fresh_bytes(func: Any, out: Any) -> int:
    """Bytes of the outputs an op allocates: the returns its schema does not alias to an input (a view or an
    in-place result is not new memory)."""
    outs = out if isinstance(out, tuple | list) else (out,)
    total = 0
    for ret, value in zip(func._schema.returns, outs):
        if ret.alias_info is None and isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


class GlueCounter(TorchDispatchMode):
    """Counts the aten ops a block dispatches, split into the attention kernels' and the glue's: launches (ops
    that are neither views nor bare allocations) and bytes of the tensors they make."""

    def __init__(self) -> None:
        super().__init__()
        self.glue_launches = 0
        self.glue_bytes = 0
        self.kernel_ops = 0
        """SDPA's fused ops; the Triton launches are in the stand-in's log."""
        self.kernel_bytes = 0
        self.ops: dict[str, int] = {}
        """Glue launches by op name: where to look when a count moves."""
        self.op_bytes: dict[str, int] = {}
        """Glue bytes by op name."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace != "aten" or func.is_view or func._opname in NO_COPY:
            return out  # prim::device and the like are queries, not ops
        made = fresh_bytes(func, out)
        log = stand_in.active()
        if is_sdpa(func):
            self.kernel_ops += 1
            self.kernel_bytes += made
        elif func._opname in ALLOCATIONS and log is not None and log.inside_kernel:
            self.kernel_bytes += made
        else:
            if func._opname not in ALLOCATIONS:
                self.glue_launches += 1
                self.ops[func._opname] = self.ops.get(func._opname, 0) + 1
            self.glue_bytes += made
            self.op_bytes[func._opname] = self.op_bytes.get(func._opname, 0) + made
        return out


def run_case(label: str, n: int, causal: bool) -> Row:
    """Forward + backward of one layer at n tokens on fake tensors, with the kernels stood in for.

    Differences from a GPU run, all in the glue's favour or neutral: SDPA runs its CPU kernel
    (`_scaled_dot_product_flash_attention_for_cpu`, whose buffers are those of the GPU's flash backend: out and
    an fp32 lse). LSH's causal (past-only) layout takes its bound for any hash distribution (about 3n rows where
    random keys give about 2n) as on a GPU: on the kernels' path no length is read back (models/attention/lsh.py).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from orchestrator.spec.counting import peak_tracker

    kind, knobs = LAYERS[label], layer_knobs(label, n, LONG_MODEL)
    d_model, heads = LONG_MODEL["d_model"], LONG_MODEL["heads"]
    settings = Settings(lengths=(n,), d_model=d_model, heads=heads, batch=1, dtype=DTYPE)
    default_dtype = torch.get_default_dtype()
    with FakeTensorMode():
        torch.manual_seed(0)
        # Built in bf16 directly: .to() cannot swap fake parameters.
        torch.set_default_dtype(DTYPE)
        try:
            layer, shared_state = build_layer(Variant(label, kind, knobs), n, settings)
        finally:
            torch.set_default_dtype(default_dtype)
        layer.train()
        x_BTD = torch.randn(1, n, d_model, dtype=DTYPE, requires_grad=True)
        grad_BTD = torch.randn(1, n, d_model, dtype=DTYPE)
        tracker = peak_tracker()
        tracker.track_external(layer, shared_state, x_BTD, grad_BTD)
        counter = GlueCounter()
        with tracker, counter, stand_in_kernels() as log:
            layer(x_BTD, causal=causal).backward(grad_BTD)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    triton_launches = sum(log.launches.values())
    return {
        "layer": label, "kind": kind, "n": n, "causal": causal, "batch": 1, "d_model": d_model, "heads": heads,
        "dtype": "bfloat16", "peak_mib": peak / 2**20, "glue_mib": counter.glue_bytes / 2**20,
        "kernel_mib": counter.kernel_bytes / 2**20, "glue_launches": counter.glue_launches,
        "kernel_launches": triton_launches + counter.kernel_ops,
        "launches": counter.glue_launches + triton_launches + counter.kernel_ops,
        "kernels": " ".join([*(f"{name}:{count}" for name, count in sorted(log.launches.items())),
                             *([f"sdpa:{counter.kernel_ops}"] if counter.kernel_ops else [])]),
        "top_glue_ops": " ".join(f"{name}:{count}" for name, count in
                                 sorted(counter.ops.items(), key=lambda item: -item[1])[:6]),
        "top_glue_mib": " ".join(f"{name}:{size / 2**20:.0f}" for name, size in
                                 sorted(counter.op_bytes.items(), key=lambda item: -item[1])[:6]),
    }


def cases(labels: Sequence[str], lengths: Sequence[int]) -> list[tuple[str, int, bool]]:
    """(layer, n, causal), shortest first; linformer has no causal form (its mechanism refuses it)."""
    return [(label, n, causal) for n in lengths for causal in (False, True) for label in labels
            if not (causal and LAYERS[label] == "linformer")]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="which stage of the code this is (before, after, ...)")
    parser.add_argument("--out", default="benchmarks/results", help="results root; the CSV goes to <out>/<machine>/")
    parser.add_argument("--kinds", nargs="*", default=list(LAYERS), choices=list(LAYERS), help="layers to count")
    parser.add_argument("--max-n", type=int, default=max(LENGTHS))
    parser.add_argument("--name", default="attention_glue", help="file stem of the CSV")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    repo = Path(__file__).resolve().parents[2]
    version = code_version(repo)
    path = results_dir(args.out, torch.device("cpu")) / f"{args.name}.csv"
    kept = [row for row in read_csv(path) if (row["label"], row["version"]) != (args.label, version)] \
        if path.exists() else []
    rows: list[Row] = []
    for label, n, causal in cases(args.kinds, [n for n in LENGTHS if n <= args.max_n]):
        start = time.perf_counter()
        row = {"label": args.label, "version": version, **run_case(label, n, causal)}
        rows.append(row)
        print(f"{label:10s} n={n:7d} causal={causal!s:5} peak {row['peak_mib']:10.1f} MiB  glue {row['glue_mib']:10.1f}"
              f" MiB in {row['glue_launches']:4d} ops  kernels {row['kernel_launches']:3d} "
              f"({time.perf_counter() - start:.1f}s)", flush=True)
    write_csv([*kept, *rows], path)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
