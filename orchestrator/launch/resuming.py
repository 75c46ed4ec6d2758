"""`orchestrator resume NAME`: continue a stored run or sweep from what its launcher wrote in storage."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.launch.preflight import LaunchError, NameNotFound
from orchestrator.launch.run import RunOutcome, run_training
from orchestrator.launch.sweep import SweepOutcome, run_sweep
from orchestrator.spec import apply_resume_overrides, study_from_raw, validate_spec
from orchestrator.storage.layout import META_FILE, RunLayout
from orchestrator.storage.locations import resolve
from orchestrator.storage.object_store import endpoint, is_s3


def resume(name: str, storage_path: str, overrides: Sequence[str] = ()) -> RunOutcome | SweepOutcome:
    """Continue the run or sweep `name` stored under `storage_path`, from what it stored there, with the
    overrides a resume may make (spec.RESUME_OVERRIDES; e.g. optim.max_steps trains a run further)."""
    layout = RunLayout(resolve(storage_path), name)
    try:
        meta = layout.read_meta()
    except OSError as err:
        if not is_s3(layout.storage):
            raise
        where = f"the endpoint {endpoint()}" if endpoint() else "AWS S3 (no endpoint is set)"
        raise LaunchError(
            f"cannot read {name!r} from {layout.storage} at {where}: {type(err).__name__}: {str(err)[:200]}. The "
            "run's spec names its store (run.storage_endpoint), but it is read from the store itself: give the "
            "endpoint with --storage-endpoint URL (or AWS_ENDPOINT_URL_S3), and credentials as AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY") from None
    if meta is None:
        raise NameNotFound(f"nothing named {name!r} in {layout.storage} (no {META_FILE}); check the name and "
                          "--storage-path")
    if meta["kind"] == "run":
        raw = apply_resume_overrides(meta["spec"], overrides, kind="run")
        return run_training(validate_spec(raw, where=f"stored spec of {name}"), resume=True)
    return run_sweep(study_from_raw(apply_resume_overrides(meta["raw"], overrides, kind="sweep")), resume=True)
