"""The GPUs a study is planned for: memory and dense bf16 tensor-core peak, one table for `orchestrator plan`,
the trainer's `train/mfu` and benchmarks/gpu/training.py.

Sources (NVIDIA's data sheets quote bf16 "with sparsity"; the dense peak is half of it):
- H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU data sheet, BF16 1,979 TFLOPS with sparsity -> 989.4 dense
  (also glennklockwood.com/garden/processors/h100: BF16 matrix 989.4). The PCIe and NVL cards are slower and
  have no row: their names do not match, so they get no MFU rather than the SXM peak.
- H200 SXM 141 GB: NVIDIA H200 data sheet, BF16 1,979 TFLOPS with sparsity, the H100's compute with more HBM3e.
- A100 SXM4/PCIe 80 GB and 40 GB: NVIDIA A100 data sheet, BF16 312 TFLOPS dense (624 with sparsity).
- L4 24 GB: NVIDIA L4 data sheet, BF16 242 TFLOPS with sparsity -> 121 dense.
- A10G 24 GB (AWS g5): AWS publishes no tensor peak for it; the row uses NVIDIA's A10 data sheet, BF16 125 TFLOPS
  dense, an upper bound (the A10G runs lower clocks).
Capacity is the data sheet's GB taken as GiB, the way nvidia-smi reports these cards (an "80GB" H100 shows
81,559 MiB), and a plan keeps FIT_FRACTION of it, for the CUDA context and the allocator's fragmentation.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuKind:
    """One row of GPUS."""

    name: str
    memory_gib: float
    bf16_dense_flops: float
    """Dense bf16 tensor-core FLOP/s (no 2:4 sparsity)."""
    pattern: str
    """Regular expression on torch.cuda.get_device_name, to find a live device's row."""


GPUS = (
    GpuKind("H100", 80, 989.4e12, r"\bH100\b(?!.*\b(PCIe|NVL)\b)"),
    GpuKind("H200", 141, 989.4e12, r"\bH200\b(?!.*\bNVL\b)"),
    GpuKind("A100-80GB", 80, 312e12, r"\bA100\b.*\b80GB\b"),
    GpuKind("A100-40GB", 40, 312e12, r"\bA100\b(?!.*\b80GB\b)"),
    GpuKind("L4", 24, 121e12, r"\bL4\b"),
    GpuKind("A10G", 24, 125e12, r"\bA10G?\b"),
)
DEFAULT_GPU = "H100"
FIT_FRACTION = 0.9
"""Share of a GPU's memory a plan may fill: the CUDA context (about 0.5 GiB) and the caching allocator's
fragmentation take the rest."""


def gpu_kind(name: str) -> GpuKind:
    """The row named `name` (case-insensitive, "A100" meaning the 80 GB card); ValueError listing the names."""
    wanted = {"a100": "a100-80gb"}.get(name.lower(), name.lower())
    for gpu in GPUS:
        if gpu.name.lower() == wanted:
            return gpu
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(g.name for g in GPUS)}")


def peak_bf16_flops(device_name: str | None) -> float | None:
    """The dense bf16 peak in FLOP/s of a device named `device_name` (torch.cuda.get_device_name), or None (no
    GPU, or one not in GPUS: an MFU against a guessed peak would mislead)."""
    if device_name is None:
        return None
    return next((g.bf16_dense_flops for g in GPUS if re.search(g.pattern, device_name)), None)


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, device_name: str | None,
                            gpus: int = 1) -> float | None:
    """MFU: the FLOP/s the model's count says the run does (tokens/s x training FLOPs per token, both over all
    `gpus`) over the dense bf16 peak of `gpus` devices named `device_name`; None where that peak is unknown (a CPU,
    a GPU not in GPUS). Against the bf16 peak in every precision, as torchtitan's MFU (components/metrics.py):
    an fp32 or TF32 run's MFU is its share of what the GPU does in bf16."""
    peak = peak_bf16_flops(device_name)
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / (peak * gpus)


def gpu_argument(value: str) -> str:
    """`--gpu VALUE` checked when the command line is read (argparse names the flag and exits 2)."""
    try:
        gpu_kind(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def mfu_argument(value: str) -> float:
    """`--mfu VALUE`: a model FLOP utilisation in (0, 1] (0 divided the step time by zero; 2 printed 200% MFU)."""
    try:
        mfu = float(value)
    except ValueError:
        mfu = math.nan
    if not 0.0 < mfu <= 1.0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a utilisation in (0, 1]; e.g. --mfu 0.4 (40% of the "
                                         "GPU's dense bf16 peak)")
    return mfu
