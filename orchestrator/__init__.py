"""Experiment orchestration: Ray Train/Tune launching, MLflow tracking and reports.

The package is a set of rooms, one job each, layered as docs/architecture.md draws them: `storage/` (where a
run's files live), `console/` (what the terminal shows), `spec/`, `tracking/` (MLflow), `training/` (the
Ray-free training core), `cluster/` (Ray and the cluster), `report/` and `launch/` (commands and the run
lifecycle), with `cli.py` on top. A room's `__init__` is its face: the names it offers the CLI, the benchmarks
and users, loaded lazily by `lazy_face`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from pathlib import Path
from typing import Any


def lazy_face(package: str, offers: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for a room's `__init__` (PEP 562): `offers` maps each name the room offers to
    the module of the room that defines it, imported on first use. A face therefore costs nothing to import and
    `from orchestrator.launch import status_cli` loads `launch/status.py` alone, not Ray with `launch/run.py`:
    the read-only commands stay Ray-free and every command keeps the imports it had before the rooms.

    A name may not be a module's name too: once Python imports a submodule it sets the package attribute of that
    name to the module, which would then shadow the offered name for every later import.
    """
    folder = Path(import_module(package).__file__).parent
    shadowed = sorted(name for name in offers if (folder / f"{name}.py").exists() or (folder / name).is_dir())
    if shadowed:
        raise ImportError(f"{package} offers names that are also its modules' names: {shadowed}")

    def __getattr__(name: str) -> Any:
        module = offers.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(offers)

    return __getattr__, __dir__
