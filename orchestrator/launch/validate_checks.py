"""What `orchestrator validate` checks of the machine before Ray, beyond the spec and its data files: the checks
train's and sweep's preflight make, so that a spec that validates is not refused by train before Ray. Apart from
preflight because the `model.init_from` check reads checkpoints (launch/pretrained.py), whose module needs
launch/evaluate.py, which needs preflight."""

from __future__ import annotations

import tempfile

from orchestrator.launch.preflight import check_labelled_data, check_storage, check_tracking, check_tracking_uri
from orchestrator.spec import ExperimentSpec


def check_before_ray(spec: ExperimentSpec) -> None:
    """The storage (check_storage), a classification spec's columns and labels (parsed into a throwaway cache, so
    that validate writes nothing), the tracking store (check_tracking_uri, then, for a server, the round trip of
    check_tracking), and the pretraining run `model.init_from` names, resolved and compared with the model."""
    check_storage(spec)
    with tempfile.TemporaryDirectory(prefix="orchestrator-validate-") as cache:
        check_labelled_data(spec, cache)
    check_tracking_uri(spec)
    if spec.tracking.uri.startswith(("http://", "https://")):
        from orchestrator.tracking.write import open_tracker  # mlflow: only when there is a server to ask

        check_tracking(spec, open_tracker(spec.tracking))
    if spec.model.init_from is not None:  # its module imports torch and Ray's storage helpers: only when needed
        from orchestrator.launch.pretrained import preflight as check_init_from

        check_init_from(spec)
