"""Which runs a report compares: the store and experiment must exist, sweep parents, report runs and
pretraining stages are left out, and only runs with the wanted MLflow status count."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from orchestrator.report.metrics import ReportError
from orchestrator.tracking.describe import PARENT_TAG, ROLE_TAG
from orchestrator.tracking.read import RUN_STATUSES, Run, TrackingReader

REPORT_TAG = "orchestrator.report"
"""Marks the run a report creates when there is no sweep parent to attach to; such runs hold only artifacts and
are never read back as compared runs."""


SERVER_ANSWER_S = 10.0
"""How long a report waits for a tracking server's first answer (MLflow's client retried for minutes)."""


def check_store_exists(tracking_uri: str) -> None:
    """Refuse a SQLite path that does not exist (MLflow would create an empty store there instead), and a
    tracking server that does not answer within SERVER_ANSWER_S (any HTTP answer counts, 401 included)."""
    if tracking_uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=SERVER_ANSWER_S).close()
        except urllib.error.HTTPError:
            pass  # it answered (an auth proxy's 401, an older server without /health)
        except (OSError, ValueError) as err:
            raise ReportError(f"the tracking server at {tracking_uri} did not answer within {SERVER_ANSWER_S:g} s "
                              f"({getattr(err, 'reason', err)}); start it, or pass --tracking-uri naming the store "
                              "the runs were logged to (the spec's tracking.uri)") from None
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix) and tracking_uri != prefix + ":memory:":
        path = Path(tracking_uri[len(prefix) :])
        if not path.exists():
            raise ReportError(
                f"no MLflow database at {path.resolve()}; pass --tracking-uri pointing at the store the "
                "runs were logged to (the spec's tracking.uri)"
            )


def find_experiment_id(reader: TrackingReader, name: str, *, store_flag: str = "--tracking-uri") -> str:
    """The id of experiment `name`; a missing one is refused listing the store's experiments and naming the
    caller's flags (`store_flag`: the one that names the store)."""
    experiment = reader.experiment(name)
    if experiment is None:
        names = sorted(reader.experiment_names())
        raise ReportError(
            f"experiment {name!r} does not exist in this tracking store; existing experiments: "
            f"{', '.join(repr(n) for n in names) or '(none)'}. Check --experiment and {store_flag}."
        )
    if experiment.lifecycle_stage == "deleted":
        raise ReportError(
            f"experiment {name!r} is deleted; restore it with `mlflow experiments restore "
            f"--experiment-id {experiment.experiment_id}` to report on it."
        )
    return experiment.experiment_id


def parent_ids(runs: Sequence[Run]) -> set[str]:
    return {parent for run in runs if (parent := run.data.tags.get(PARENT_TAG))}


def _describe_parents(runs: Sequence[Run]) -> str:
    parents = parent_ids(runs)
    described = [f"{run.info.run_id} ({run.info.run_name})" for run in runs if run.info.run_id in parents]
    return ", ".join(described) or "(none)"


def compared_runs(runs: Sequence[Run], parent_run_id: str | None, experiment: str) -> list[Run]:
    """The trials to compare: children of one sweep, or every run that is not a sweep parent."""
    parents = parent_ids(runs)
    compared = [
        run
        for run in runs
        if run.info.run_id not in parents
        and not run.data.tags.get(REPORT_TAG)
        and run.data.tags.get(ROLE_TAG) != "pretrain"  # a two-stage study compares its fine-tuned runs
        and (parent_run_id is None or run.data.tags.get(PARENT_TAG) == parent_run_id)
    ]
    if parent_run_id is not None and not compared:
        known = {run.info.run_id for run in runs}
        what = "has no child runs" if parent_run_id in known else f"is not a run of experiment {experiment!r}"
        raise ReportError(
            f"parent run {parent_run_id!r} {what}; sweep parent runs in this experiment: "
            f"{_describe_parents(runs)}. Pass one of them to --parent-run, or omit it to use all runs."
        )
    if not compared:
        raise ReportError(f"experiment {experiment!r} has no runs to compare; run a sweep first.")
    return compared


def with_status(runs: Sequence[Run], statuses: Sequence[str] | None) -> tuple[list[Run], dict[str, int]]:
    """The runs whose status is in `statuses` (all when None), and how many of each other status were left out."""
    if statuses is None:
        return list(runs), {}
    wanted = {status.upper() for status in statuses}
    known = RUN_STATUSES
    if unknown := sorted(wanted - known):
        raise ReportError(f"--status {','.join(unknown)}: not an MLflow run status; use a comma-separated list of "
                          f"{', '.join(sorted(known))}, or 'all'")
    left_out: dict[str, int] = {}
    for run in runs:
        if run.info.status not in wanted:
            left_out[run.info.status] = left_out.get(run.info.status, 0) + 1
    kept = [run for run in runs if run.info.status in wanted]
    if not kept:
        raise ReportError(f"no run to compare has status {'/'.join(sorted(wanted))} (there are {counts(left_out)}); "
                          "wait for the sweep to finish, or pass --status all to compare runs at their last value")
    return kept, left_out


def counts(by_status: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {status}" for status, n in sorted(by_status.items()))
