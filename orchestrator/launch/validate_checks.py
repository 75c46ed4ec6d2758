"""What `orchestrator validate` checks of the machine before Ray, beyond the spec and its data files: the checks
train's and sweep's preflight make, so that a spec that validates is not refused by train or sweep before Ray.
Apart from preflight because the `model.init_from` check reads checkpoints (launch/pretrained.py), whose module
needs launch/evaluate.py, which needs preflight; a sweep walks its trials' init_from here too
(check_pretrained_runs), so validate and sweep check the same runs."""

from __future__ import annotations

import tempfile
from typing import Any

from orchestrator.launch.preflight import check_labelled_data, check_storage, check_tracking, check_tracking_uri
from orchestrator.spec import Study
from orchestrator.spec.search_space import raw_holds, validation_points
from orchestrator.spec.vocabulary import check_study_adaptive_bands


def check_before_ray(study: Study) -> None:
    """The storage (check_storage), a classification spec's columns and labels (parsed into a throwaway cache, so
    that validate writes nothing), the tracking store (check_tracking_uri, then, for a server, the round trip of
    check_tracking), and the pretraining run `model.init_from` names, in every trial, resolved and compared with
    its model (check_pretrained_runs)."""
    spec = study.base
    check_storage(spec)
    with tempfile.TemporaryDirectory(prefix="orchestrator-validate-") as cache:
        check_labelled_data(spec, cache)
    check_tracking_uri(spec)
    if spec.tracking.uri.startswith(("http://", "https://")):
        from orchestrator.tracking.write import open_tracker  # mlflow: only when there is a server to ask

        check_tracking(spec, open_tracker(spec.tracking))
    check_pretrained_runs(study)
    check_study_adaptive_bands(study)


def check_pretrained_runs(study: Study) -> None:
    """Each trial's pretrained run (model.init_from) resolved and checked against its model, before any cluster
    time: a grid over init_from (or over a model field it must match) names another run per trial, so the first
    trial's alone says nothing of the rest. A study that names no init_from skips the walk: it would validate the
    grid again (up to MAX_TRIALS specs, seconds) for nothing; one that does reads each named run once (a read of
    storage or a download of its tokenizer, s3:// included) and checks each distinct model and task against it."""
    if not raw_holds(study.raw, lambda block: "init_from" in block):
        return
    # Its module imports torch and Ray's storage helpers: only when a spec fine-tunes.
    from orchestrator.launch.pretrained import check_compatible, resolve

    runs: dict[tuple[str, ...], Any] = {}
    checked: set[str] = set()
    for assignment in validation_points(study.domains, search=study.base.tune.search) if study.domains else [{}]:
        spec = study.spec_for(assignment)
        if spec.model.init_from is None:
            continue
        # What names the run: the value, and where it is looked for (storage, then the tracking store).
        where = (spec.model.init_from, spec.run.storage_path, str(spec.run.storage_endpoint), spec.tracking.uri)
        if where not in runs:
            runs[where] = resolve(spec)
        key = repr(where) + spec.model.model_dump_json() + spec.task.model_dump_json()
        if key not in checked:
            checked.add(key)
            check_compatible(spec, runs[where])
