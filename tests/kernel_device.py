"""Where the kernel tests run (tests/test_kernels.py, test_lsh_hash_kernel.py, test_hyper_blocks_kernel.py):
``KERNEL_TESTS_DEVICE=cpu`` (the default: the Triton interpreter at small shapes) or ``cuda`` (the kernels compiled
on a GPU). Import it before anything launches a kernel: on the CPU it sets TRITON_INTERPRET=1, which must precede
the first import of the @triton.jit modules (kernels.k_*, imported at the first launch)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

KERNEL_DEVICE = os.environ.get("KERNEL_TESTS_DEVICE", "cpu")
if KERNEL_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"KERNEL_TESTS_DEVICE must be cpu or cuda; got {KERNEL_DEVICE!r}")
if KERNEL_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed; the kernels cannot run")
"""The mark of a test that launches a kernel: skipped without triton, or asked for cuda without a GPU."""
if KERNEL_DEVICE == "cuda" and not torch.cuda.is_available():
    needs_triton = pytest.mark.skip(reason="KERNEL_TESTS_DEVICE=cuda but no CUDA GPU is visible")
DEVICE = torch.device(KERNEL_DEVICE)

GPU_TEST_BLOCKS = (64, 64)
"""The one launch configuration of the flash kernel's tests on cuda (with 4 warps and 2 stages)."""


@pytest.fixture(autouse=True)
def one_gpu_launch_config(request: pytest.FixtureRequest):
    """On cuda, the flash kernel's tests run at one launch configuration, as the GPU suite's parity part does,
    instead of the autotuner's candidates: compiled, their time is compilation (the H200 run's slowest case took
    77.7 s autotuned: benchmarks/results/nvidia-h200/console.txt), and one configuration compiles each kernel variant
    once. Tests marked `autotuned` keep the autotuner (they test it); tests that set a configuration of their own
    (block shapes) override this one inside it. Under the interpreter it does nothing: the interpreter's own 16 x 16
    blocks apply. Imported into each kernel test module, where pytest finds it."""
    if KERNEL_DEVICE != "cuda" or request.node.get_closest_marker("autotuned") is not None:
        yield
        return
    from kernels.flash_attention import fixed_launch_config

    with fixed_launch_config(*GPU_TEST_BLOCKS):
        yield


def run_gpu_compile_script(script: str, timeout: float) -> str:
    """The stdout of `script`, run from the repository root in a fresh process without TRITON_INTERPRET (this one
    has it on the CPU), where it compiles kernels for an NVIDIA GPU through Triton's bundled ptxas
    (kernels/offline_compile.py); the test is skipped where this triton install has no ptxas."""
    triton_dir = Path(importlib.util.find_spec("triton").origin).parent
    if not (triton_dir / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton install has no bundled ptxas; cannot compile for NVIDIA GPUs")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1], timeout=timeout, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
