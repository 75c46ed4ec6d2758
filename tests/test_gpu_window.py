"""A GPU window's two tools without a GPU: benchmarks/gpu/bundle.py (the packages a GPU image lacks: which, at
which versions, pruned, stripped, packed; its network part, pip's resolver and downloads, is not run here) and
benchmarks/gpu/window.sh (every GPU check in one call: run in its dry mode on the CPU, with a bundle of one probe
module, a kernel-test file that imports it, and the suite's dry run)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tarfile
from importlib.metadata import requires, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from benchmarks.gpu import bundle
from tests.test_gpu_suite import summary_rows

REPO = Path(__file__).resolve().parents[1]
WINDOW = REPO / "benchmarks" / "gpu" / "window.sh"


def test_have_lists_take_bare_names_and_pip_freeze_lines():
    text = """# the image's packages
ray==2.60.0
PyYAML @ file:///tmp/pyyaml.whl
numpy

foo_bar.Baz>=1 ; python_version > "3"
torch[cuda]==2.11.0
"""
    assert bundle.names_in(text) == {"ray", "pyyaml", "numpy", "foo-bar-baz", "torch"}


def test_the_image_always_has_its_torch_triton_and_cuda_wheels():
    for name in ("torch", "Triton", "nvidia-cublas", "nvidia_cudnn_cu13", "cuda-bindings"):
        assert bundle.image_has(name, set()), name
    assert not bundle.image_has("ray", set())
    assert bundle.image_has("Py_YAML", {"py-yaml"})


def test_requirements_are_the_projects_runtime_ones_the_image_lacks_pinned_to_the_installed_versions():
    pinned = {Requirement(text).name: Requirement(text) for text in bundle.pinned_requirements({"transformers",
                                                                                               "pandas"})}
    runtime = {Requirement(text).name for text in requires(bundle.PROJECT)
               if "extra" not in str(Requirement(text).marker or "")}
    assert set(pinned) == runtime - {"torch", "triton", "transformers", "pandas"}
    for name, requirement in pinned.items():
        assert str(requirement.specifier) == f"=={version(name)}", requirement  # the versions the tests ran with
    assert pinned["ray"].extras == {"train", "tune"}
    assert pinned["mlflow"].extras == set()  # [auth]: the login server, not for a GPU run
    assert "pytest" not in pinned and "playwright" not in pinned  # the dev extra's


def test_carried_leaves_out_what_the_image_has():
    resolved = {"ray": "2.60.0", "numpy": "2.5.2", "nvidia-cublas": "13.0", "PyYAML": "6.0.3", "mlflow": "3.17.2"}
    assert bundle.carried(resolved, {"pyyaml", "numpy"}) == ["mlflow==3.17.2", "ray==2.60.0"]


def test_prune_removes_what_no_gpu_run_imports_and_keeps_the_rest(tmp_path):
    kept = ["ray/train/__init__.py", "ray/core/src/ray/raylet/raylet", "mlflow/server/__init__.py",
            "ray-2.60.0.dist-info/METADATA"]
    dropped = ["ray/jars/ray_dist.jar", "ray/rllib/__init__.py", "ray/serve/api.py", "ray/llm/__init__.py",
               "ray/dashboard/client/build/index.html", "mlflow/server/js/build/index.html", "bin/ray",
               "ray/train/__pycache__/x.cpython-312.pyc"]
    for relative in kept + dropped:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("x")
    bundle.prune(tmp_path)
    assert [r for r in kept if not (tmp_path / r).exists()] == []
    assert [r for r in dropped if (tmp_path / r).exists()] == []


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("strip") is None, reason="needs gcc and strip")
def test_stripping_shrinks_a_library_that_still_loads_and_leaves_other_files_alone(tmp_path):
    source = tmp_path / "probe.c"
    source.write_text("int probe_value(void) { return 42; }\n" +
                      "".join(f"static int unused_{i}(int x) {{ return x + {i}; }}\n" for i in range(200)))
    site = tmp_path / "site"
    site.mkdir()
    library = site / "libprobe.so"
    subprocess.run(["gcc", "-g", "-O0", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    text = site / "notes.txt"
    text.write_bytes(b"\x7fELX not an ELF file" * 100)
    before = library.stat().st_size, text.read_bytes()
    saved = bundle.strip_binaries(site, min_bytes=0)
    assert saved == before[0] - library.stat().st_size > 0
    assert text.read_bytes() == before[1]
    assert ctypes.CDLL(str(library)).probe_value() == 42  # the dynamic symbols it links by stay


def test_pack_holds_every_file_under_its_path(tmp_path):
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (site / "top.py").write_text("X = 2\n")
    out = tmp_path / "out" / "deps.tar.xz"
    bundle.pack(site, out)
    with tarfile.open(out) as archive:
        names = sorted(member.name for member in archive.getmembers() if member.isfile())
        assert names == ["pkg/__init__.py", "top.py"]
        assert archive.extractfile("pkg/__init__.py").read() == b"VALUE = 1\n"
    assert not out.with_name(out.name + ".partial").exists()


@pytest.mark.parametrize("argv, flag", [(["--python-version", "3"], "--python-version"),
                                        (["--have", "/nonexistent/have.txt"], "--have")])
def test_bad_arguments_are_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as stop:
        bundle.parse_args(argv)
    assert stop.value.code == 2
    assert flag in capsys.readouterr().err


def test_the_default_have_list_names_the_images_packages_but_none_the_project_must_carry():
    have = bundle.names_in((REPO / "benchmarks" / "gpu" / "image_packages.txt").read_text())
    assert {"numpy", "pyarrow", "transformers", "pytest-xdist"} <= have
    assert not have & {"ray", "mlflow", "pydantic", "optuna"}


def _window(out: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RUN_SLOW"))}
    return subprocess.run(["bash", str(WINDOW), str(out), *args], cwd=REPO, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)


def _probe_bundle(tmp_path: Path) -> Path:
    """A bundle of one module, and a kernel-test file that passes only if the module is importable in the test
    processes (the bundle on their PYTHONPATH)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "window_probe.py").write_text("VALUE = 42\n")
    bundle.pack(site, tmp_path / "probe.tar.xz")
    (tmp_path / "test_probe.py").write_text("import window_probe\n\n\ndef test_probe():\n"
                                            "    assert window_probe.VALUE == 42\n")
    return tmp_path / "probe.tar.xz"


@pytest.mark.slow
def test_a_dry_window_unpacks_the_bundle_runs_the_kernel_tests_and_the_suite_and_packs_every_file(tmp_path):
    probe = _probe_bundle(tmp_path)
    out = tmp_path / "out"
    done = _window(out, {"WINDOW_DRY_RUN": "1", "KERNEL_TESTS": str(tmp_path / "test_probe.py"),
                         "SUITE_ARGS": "--parts train_step", "WINDOW_SECONDS": "240"}, str(probe))
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["console.txt", "gpu_suite_summary.md", "kernel_tests.txt",
                                                     "window.tar.xz"]
    console = (out / "console.txt").read_text()
    assert "1 passed" in (out / "kernel_tests.txt").read_text()  # window_probe imported from the bundle
    budget = int(console.split("GPU suite (--budget ")[1].split(")")[0])
    assert 240 - 20 - 25 - 60 < budget <= 240 - 20 - 25  # the window less packing, the suite's start, the setup
    assert summary_rows((out / "gpu_suite_summary.md").read_text())["train_step"]["status"] == "dry-run"
    with tarfile.open(out / "window.tar.xz") as archive:
        names = {member.name.removeprefix("./") for member in archive.getmembers() if member.isfile()}
        freeze = archive.extractfile("pip_freeze.txt").read().decode()
    machine = next(name.split("/")[1] for name in names if name.startswith("suite/"))
    assert names == {"versions.txt", "pip_freeze.txt", "kernel_tests.txt", f"suite/{machine}/gpu_suite_summary.md",
                     f"suite/{machine}/gpu_train_step.csv"}
    assert f"torch=={version('torch')}" in freeze  # the next bundle's --have
    assert console.rstrip().endswith("window.tar.xz)")  # the console is whole: its tee was waited for


@pytest.mark.slow
def test_a_window_stops_the_kernel_tests_at_their_limit_and_says_what_it_left_out(tmp_path):
    (tmp_path / "test_stuck.py").write_text("import time\n\n\ndef test_stuck():\n    time.sleep(120)\n")
    out = tmp_path / "out"
    done = _window(out, {"WINDOW_DRY_RUN": "1", "KERNEL_TESTS": str(tmp_path / "test_stuck.py"),
                         "KERNEL_TEST_SECONDS": "15", "WINDOW_SECONDS": "60"})
    assert done.returncode == 0, done.stdout + done.stderr
    console = (out / "console.txt").read_text()
    assert "kernel tests: stopped at their limit (15 s)" in console
    assert "GPU suite: not run" in console  # too little of the 60 s left for a budget
    assert (out / "window.tar.xz").is_file() and not (out / "files").exists()


@pytest.mark.parametrize("args, env, message", [
    ([], {}, "usage: bash benchmarks/gpu/window.sh OUT"),
    (["/nonexistent/deps.tar.xz"], {}, "no such file (make it with python -m benchmarks.gpu.bundle"),
    (["--"], {"WINDOW_SECONDS": "ten"}, "take whole seconds"),
])
def test_the_window_refuses_bad_arguments_before_it_runs_anything(tmp_path, args, env, message):
    out = tmp_path / "out"
    argv = args if not args or args[0] != "--" else []
    command = ["bash", str(WINDOW)] + ([str(out), *argv] if args else [])
    done = subprocess.run(command, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr
    assert not out.exists()
