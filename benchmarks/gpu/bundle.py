"""The Python packages a GPU machine lacks, in one file that travels with the checkout.

    python -m benchmarks.gpu.bundle --out .bundle/gpu-deps.tar.xz        # here, where a package index answers
    bash benchmarks/gpu/window.sh OUT .bundle/gpu-deps.tar.xz            # there: unpacks it, runs every GPU check

A GPU machine's image for PyTorch work holds torch, triton, numpy, pandas, pyarrow, transformers and the like, but
not Ray, MLflow, pydantic or Optuna, and may reach no package index. The bundle is what the project needs there:
its runtime requirements at the versions installed here (CI's: the GPU then runs the versions the tests passed
with), resolved by pip for the GPU machine's Python and platform, less every package its image already has
(`--have`: a file of names, or of `pip list --format=freeze` lines read there; window.sh writes that list at each
run, `pip_freeze.txt`), unpacked without bytecode, pruned of what no run imports there (Ray's Java jars, its
dashboard's web build, RLlib, Serve and its LLM library; MLflow's web UI: the suite reads MLflow's store, it does
not browse it) and packed with xz. A GPU call carries 64 MiB at most, the checkout included: a bundle above
`--limit-mib` is refused with its largest packages named.

The packages are unpacked into a folder put on PYTHONPATH behind the checkout. Nothing in the bundle replaces a
package of the image (those are left out by name), so the image's torch, numpy and CUDA libraries stay the ones
its torch was built against.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canonical  # PEP 503: as pip compares names

PROJECT = "attention-orchestrator"

ALWAYS_THERE = ("torch", "triton")
"""A GPU machine's PyTorch and the Triton it ships: the bundle never carries these, whatever `--have` says."""

ALWAYS_THERE_PREFIXES = ("nvidia-", "cuda-")
"""CUDA's libraries as wheels (nvidia-cublas, cuda-bindings, ...): the image's torch was built against its own."""

PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)) + ("manylinux2014_x86_64",
                                                                                  "manylinux1_x86_64")
"""Every glibc a wheel may name up to the GPU image's (Ubuntu 24.04: glibc 2.39). pip matches each tag exactly."""

PRUNED = ("ray/jars", "ray/dashboard/client/build", "ray/rllib", "ray/serve", "ray/llm", "mlflow/server/js/build",
          "bin")
"""Left out of the unpacked packages: no run on the GPU machine imports them (`bin`: console scripts whose first
line names this machine's Python)."""

EXTRAS_LEFT_OUT = {"mlflow": {"auth"}}
"""Extras of the project's requirements that no GPU run uses: MLflow's login server (a run there tracks to a file)."""

DEFAULT_LIMIT_MIB = 56.0
"""The call's 64 MiB, less the checkout's own files (about 7 MiB) and some room."""


def names_in(text: str) -> set[str]:
    """The package names of a `--have` file: one per line, a bare name or `pip list --format=freeze` /
    `pip freeze` lines (`name==1.2`, `name @ file://...`); blank lines and # comments skipped."""
    names = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonical(re.split(r"[\s=<>!~@;\[]", line, maxsplit=1)[0]))
    return names


def image_has(name: str, have: set[str]) -> bool:
    name = canonical(name)
    return name in have or name in ALWAYS_THERE or name.startswith(ALWAYS_THERE_PREFIXES)


def pinned_requirements(have: set[str], project: str = PROJECT) -> list[str]:
    """The project's runtime requirements that the image lacks, each pinned to the version installed here (with its
    extras): `ray[train,tune]==2.60.0`, ... Optional extras (dev, bench, cluster) are not for a GPU run."""
    pinned = []
    for text in requires(project) or []:
        requirement = Requirement(text)
        if requirement.marker is not None and "extra" in str(requirement.marker):
            continue
        if image_has(requirement.name, have):
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError as err:
            raise SystemExit(f"{requirement.name} is not installed here: install the project first "
                             "(pip install -e .), so the bundle pins the versions the tests ran with") from err
        kept = sorted(set(requirement.extras) - EXTRAS_LEFT_OUT.get(canonical(requirement.name), set()))
        extras = f"[{','.join(kept)}]" if kept else ""
        pinned.append(f"{requirement.name}{extras}=={installed}")
    return pinned


def _target_flags(python_version: str) -> list[str]:
    flags = ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
    for platform_tag in PLATFORMS:
        flags += ["--platform", platform_tag]
    return flags


def resolve(requirements: Sequence[str], python_version: str) -> dict[str, str]:
    """Every distribution the requirements need on the target, by pip's resolver: {name: version}."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--target", str(Path(scratch) / "site"), "--report", str(report),
                        *_target_flags(python_version), *requirements], check=True)
        resolved = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in resolved}


def carried(resolved: dict[str, str], have: set[str]) -> list[str]:
    """The resolved distributions the image lacks, as `name==version`, sorted."""
    return sorted(f"{name}=={ver}" for name, ver in resolved.items() if not image_has(name, have))


def unpack(distributions: Sequence[str], python_version: str, site: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                    "--target", str(site), *_target_flags(python_version), *distributions], check=True)


def prune(site: Path, pruned: Iterable[str] = PRUNED) -> None:
    for relative in pruned:
        path = site / relative
        if path.is_dir():
            shutil.rmtree(path)
    for cache in list(site.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)


def strip_binaries(site: Path, min_bytes: int = 2**20) -> int:
    """Strip the symbol tables from the compiled programs and libraries (Ray ships its raylet, GCS server and core
    library with theirs: about 35 MB of its 150): the dynamic symbols they link by stay. The bytes saved."""
    strip = shutil.which("strip")
    if strip is None:
        print("strip not found (binutils): the bundle keeps the binaries' symbol tables", flush=True)
        return 0
    saved = 0
    for path in site.rglob("*"):
        if not path.is_file() or path.is_symlink() or path.stat().st_size < min_bytes:
            continue
        with path.open("rb") as head:
            if head.read(4) != b"\x7fELF":
                continue
        before = path.stat().st_size
        subprocess.run([strip, "--strip-unneeded", str(path)], check=True)
        saved += before - path.stat().st_size
    return saved


def folder_sizes(site: Path) -> list[tuple[int, str]]:
    """The unpacked size of each top-level entry of the folder, largest first."""
    sizes = []
    for entry in site.iterdir():
        files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
        sizes.append((sum(p.stat().st_size for p in files), entry.name))
    return sorted(sizes, reverse=True)


def pack(site: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w:xz", preset=9) as archive:
        for entry in sorted(site.iterdir()):
            archive.add(entry, arcname=entry.name)
    partial.replace(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".bundle/gpu-deps.tar.xz"), help="the bundle's path")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--have", type=Path, default=Path(__file__).with_name("image_packages.txt"),
                        help="the packages the GPU machine's image already has: names or `pip freeze` lines")
    parser.add_argument("--limit-mib", type=float, default=DEFAULT_LIMIT_MIB,
                        help="refuse a bundle larger than this (a GPU call carries 64 MiB with the checkout)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: give major.minor, e.g. 3.12")
    if not args.have.is_file():
        parser.error(f"--have {args.have}: no such file (one package name a line, or `pip list --format=freeze` "
                     "output from the GPU machine)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    have = names_in(args.have.read_text())
    requirements = pinned_requirements(have)
    print(f"requirements the image lacks ({len(have)} packages there): {' '.join(requirements)}", flush=True)
    distributions = carried(resolve(requirements, args.python_version), have)
    print(f"carrying {len(distributions)} distributions for Python {args.python_version}: "
          f"{' '.join(distributions)}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        site = Path(scratch) / "site"
        unpack(distributions, args.python_version, site)
        prune(site)
        saved = strip_binaries(site)
        largest = folder_sizes(site)
        pack(site, args.out)
    size_mib = args.out.stat().st_size / 2**20
    top = ", ".join(f"{name} {size / 2**20:.1f}" for size, name in largest[:6])
    print(f"{args.out}: {size_mib:.1f} MiB packed ({saved / 2**20:.0f} MiB of symbol tables stripped; largest "
          f"unpacked, MiB: {top})")
    if size_mib > args.limit_mib:
        args.out.unlink()
        print(f"error: the bundle is {size_mib:.1f} MiB, over --limit-mib {args.limit_mib:g}: add what the image "
              f"already has to --have, or prune more (PRUNED); largest: {top}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
