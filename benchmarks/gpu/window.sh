#!/usr/bin/env bash
# One GPU window: every GPU check of the project in one call to a leased GPU machine, in order of value, each
# under its own limit, and every file it writes brought back in one archive.
#
#     python -m benchmarks.gpu.bundle --out .bundle/gpu-deps.tar.xz      # here: the packages the image lacks
#     bash benchmarks/gpu/window.sh OUT .bundle/gpu-deps.tar.xz          # there, from the repository root
#
# 1. The bundle (benchmarks/gpu/bundle.py) unpacked into a folder on PYTHONPATH behind the checkout; the versions
#    (GPU, driver, Python, every package: pip_freeze.txt, the next bundle's --have) written down.
# 2. The kernel tests compiled on the GPU (KERNEL_TESTS_DEVICE=cuda), every kernel module, in parallel processes:
#    the kernels first, since every speed after them assumes they are right there.
# 3. The GPU suite (benchmarks/gpu/suite.py) under --budget: whatever time is left, less the packing.
# OUT then holds console.txt (everything printed), kernel_tests.txt, gpu_suite_summary.md and window.tar.xz with
# every file (the suite's CSVs and summary under suite/<gpu>/, the versions, the kernel tests' output): a lease
# that returns only a few files returns them all.
#
# Settings (environment):
#   WINDOW_SECONDS      the whole script's time, setup and packing included (default 540: a 10-minute call with
#                       room for the machine's start inside a 15-minute lease)
#   KERNEL_TEST_SECONDS the kernel tests' limit (default 150; 110 s on an H200 with 14 processes, 2026-11-28)
#   KERNEL_TESTS        the test files (default: every module that imports tests/kernel_device.py)
#   SUITE_ARGS          more arguments for the suite (e.g. "--parts long_attention --long-lengths 131072 262144")
#   WINDOW_DRY_RUN=1    on a CPU: the kernel tests under Triton's interpreter and the suite's --dry-run; what
#                       tests/test_gpu_window.py runs, so the script cannot rot before a GPU comes
set -uo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: bash benchmarks/gpu/window.sh OUT [BUNDLE.tar.xz]" >&2
    exit 2
fi
out=$1
bundle=${2:-}
start=$SECONDS
window_s=${WINDOW_SECONDS:-540}
kernel_s=${KERNEL_TEST_SECONDS:-150}
pack_s=20
start_s=25
# Every test module on tests/kernel_device.py's device switch: a new kernel's tests are taken without a list here.
kernel_tests=${KERNEL_TESTS:-$(grep -l "^from tests.kernel_device import" tests/test_*.py)}
for value in "$window_s" "$kernel_s"; do
    case $value in '' | *[!0-9]*) echo "WINDOW_SECONDS and KERNEL_TEST_SECONDS take whole seconds" >&2; exit 2 ;; esac
done
if [ -n "$bundle" ] && [ ! -f "$bundle" ]; then
    echo "bundle $bundle: no such file (make it with python -m benchmarks.gpu.bundle --out $bundle)" >&2
    exit 2
fi

files=$out/files
mkdir -p "$files"
exec > >(tee "$out/console.txt") 2>&1
tee_pid=$!
export PYTHONUNBUFFERED=1
# The GPU image's Python is python3 (it may have no `python`); PYTHON chooses another.
python=${PYTHON:-$(command -v python3 || command -v python)}
step() { echo "== [$((SECONDS - start)) s] $*"; }

step "setup"
if [ -n "$bundle" ]; then
    site=${TMPDIR:-/tmp}/gpu-window-site
    # Python's tarfile, not tar: an image may lack xz. The data filter refuses links and paths out of the folder.
    rm -rf "$site" && mkdir -p "$site" && "$python" -c 'import sys, tarfile
tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$bundle" "$site" ||
        { echo "could not unpack $bundle"; exit 1; }
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "unpacked $bundle into $site ($(du -sm "$site" | cut -f1) MiB)"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
{
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "python: $("$python" --version 2>&1)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "gpu: none"
    echo "cores: $(nproc)"
} > "$files/versions.txt"
"$python" -m pip list --format=freeze > "$files/pip_freeze.txt" 2>/dev/null
cat "$files/versions.txt"
# What the parts import, said once here rather than as each part's error.
"$python" - <<'EOF'
import importlib
found, missing = [], []
for name in ("torch", "triton", "ray", "mlflow", "pydantic", "optuna", "datasets", "transformers", "pytest", "xdist"):
    try:
        module = importlib.import_module(name)
        found.append(f"{name} {getattr(module, '__version__', '')}".strip())
    except Exception as err:  # noqa: BLE001 - any failing import is reported, the window goes on
        missing.append(f"{name} ({type(err).__name__}: {err})")
print("imports:", ", ".join(found))
if missing:
    print("MISSING:", "; ".join(missing), "- the parts that need them will be errors in the summary")
EOF

workers=$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))
if [ "${WINDOW_DRY_RUN:-0}" = 1 ]; then
    device_env=()
    dry=(--dry-run)
else
    device_env=(KERNEL_TESTS_DEVICE=cuda)
    dry=()
fi

step "kernel tests (limit ${kernel_s} s, $workers processes)"
# shellcheck disable=SC2086 # the test files are words
# addopts replaced: pyproject's name pytest-xdist 3.8's options, and the image's pytest-xdist may be older.
env "${device_env[@]}" timeout -s TERM "$kernel_s" "$python" -m pytest -q -p no:cacheprovider -o addopts="-ra" \
    -n "$workers" --dist loadgroup --durations=15 $kernel_tests > "$files/kernel_tests.txt" 2>&1
kernel_rc=$?
tail -n 25 "$files/kernel_tests.txt"
[ "$kernel_rc" = 124 ] && echo "kernel tests: stopped at their limit (${kernel_s} s)"
echo "kernel tests: exit status $kernel_rc"

# The suite's budget counts from its own start: its imports and the GPU's first use (start_s) are outside it.
suite_limit=$(( window_s - (SECONDS - start) - pack_s ))
budget=$(( suite_limit - start_s ))
if [ "$budget" -ge 30 ]; then
    step "GPU suite (--budget $budget)"
    # The suite stops itself at its budget; the timeout is the backstop, as SIGTERM, which the suite answers by
    # keeping its rows and naming the case it stopped in.
    # shellcheck disable=SC2086 # SUITE_ARGS are words
    timeout -s TERM "$suite_limit" "$python" -m benchmarks.gpu.suite --out "$files/suite" --budget "$budget" \
        --parity-workers "$workers" "${dry[@]}" ${SUITE_ARGS:-}
    echo "suite: exit status $?"
else
    step "GPU suite: not run, ${budget} s left of WINDOW_SECONDS=$window_s"
fi

step "packing"
summary=$(find "$files/suite" -name gpu_suite_summary.md 2>/dev/null | head -n 1)
[ -n "$summary" ] && cp "$summary" "$out/gpu_suite_summary.md"
cp "$files/kernel_tests.txt" "$out/kernel_tests.txt"
# The sweep part's MLflow store and Ray's trial folders stay behind: gpu_sweep.csv holds what they showed.
"$python" - "$files" "$out/window.tar.xz" <<'EOF' && rm -rf "$files"
import sys, tarfile
from pathlib import Path
files = Path(sys.argv[1])
with tarfile.open(sys.argv[2], "w:xz") as archive:
    for path in sorted(files.rglob("*")):
        relative = path.relative_to(files)
        in_sweep = len(relative.parts) > 2 and relative.parts[0] == "suite" and relative.parts[2] == "sweep"
        if path.is_file() and not in_sweep:
            archive.add(path, arcname=str(relative))
EOF
step "done: $out (console.txt, kernel_tests.txt, gpu_suite_summary.md, window.tar.xz)"
exec >&- 2>&-
wait "$tee_pid"
