"""`orchestrator resume NAME`: continue a stored run or sweep from what its launcher wrote in storage."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.launch.preflight import LaunchError
from orchestrator.launch.run import RunOutcome, run_training
from orchestrator.launch.sweep import SweepOutcome, run_sweep
from orchestrator.spec import apply_resume_overrides, study_from_raw, validate_spec
from orchestrator.storage.layout import META_FILE, RunLayout, resolve


def resume(name: str, storage_path: str, overrides: Sequence[str] = ()) -> RunOutcome | SweepOutcome:
    """Continue the run or sweep `name` stored under `storage_path`, from what it stored there, with the
    overrides a resume may make (spec.RESUME_OVERRIDES; e.g. optim.max_steps trains a run further)."""
    layout = RunLayout(resolve(storage_path), name)
    meta = layout.read_meta()
    if meta is None:
        raise LaunchError(f"nothing named {name!r} in {layout.storage} (no {META_FILE}); check the name and "
                          "--storage-path")
    if meta["kind"] == "run":
        raw = apply_resume_overrides(meta["spec"], overrides, kind="run")
        return run_training(validate_spec(raw, where=f"stored spec of {name}"), resume=True)
    return run_sweep(study_from_raw(apply_resume_overrides(meta["raw"], overrides, kind="sweep")), resume=True)
