"""Reading MLflow: experiments, runs by key tag, trial or parent, metric histories and tags. Every reader of the
store (status, report, pretrained, the CLI, benchmarks) goes through `TrackingReader`; writing is
orchestrator/tracking/write.py's. Calls raise as MLflow does: a read-only command says what went wrong.
"""

from __future__ import annotations

import math
import os
from urllib.parse import quote

from mlflow import MlflowClient
from mlflow.entities import Experiment, Metric, Run, RunStatus, ViewType

from orchestrator.tracking.describe import PARENT_TAG

__all__ = ["RUN_STATUSES", "Experiment", "Metric", "Run", "TrackingReader", "configure_http", "logged_steps",
           "newest_run_with_tag", "ui_url"]

RUN_STATUSES = frozenset(RunStatus.to_string(status) for status in RunStatus.all_status())
"""MLflow's run statuses: RUNNING, SCHEDULED, FINISHED, FAILED, KILLED."""
_PAGE_SIZE = 1000


def configure_http(timeout_s: float) -> None:
    """Short per-request timeouts and no urllib3-level retries: `MlflowTracker` retries itself, bounded."""
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, math.ceil(timeout_s)))
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"


def newest_run_with_tag(client: MlflowClient, experiment_id: str, tag: str, value: str) -> str | None:
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{tag}` = '{value}'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None




def logged_steps(client: MlflowClient, run_id: str) -> dict[str, int]:
    """Per metric of the run, the last step it holds."""
    keys = client.get_run(run_id).data.metrics
    return {key: max(m.step for m in client.get_metric_history(run_id, key)) for key in keys}


class TrackingReader:
    """Read-only access to one tracking store. The client is made on construction (for a SQLite URI that opens
    the store), so construct it where a failure is handled."""

    def __init__(self, uri: str, *, timeout_s: float | None = None):
        if timeout_s is not None:
            configure_http(timeout_s)
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)

    def experiment(self, name: str) -> Experiment | None:
        return self.client.get_experiment_by_name(name)

    def experiment_id(self, name: str) -> str | None:
        found = self.experiment(name)
        return found.experiment_id if found is not None else None

    def experiment_names(self) -> list[str]:
        return [experiment.name for experiment in self.client.search_experiments(max_results=_PAGE_SIZE)]

    def run(self, run_id: str) -> Run:
        return self.client.get_run(run_id)

    def runs(self, experiment_id: str, filter_string: str = "", order_by: list[str] | None = None) -> list[Run]:
        """Every active run of the experiment (matching `filter_string`); the search API pages, so follow the
        page token."""
        runs: list[Run] = []
        token = None
        while True:
            page = self.client.search_runs([experiment_id], filter_string=filter_string,
                                           run_view_type=ViewType.ACTIVE_ONLY, max_results=_PAGE_SIZE,
                                           order_by=order_by, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def run_by_tag(self, experiment_id: str, tag: str, value: str) -> str | None:
        """The newest run whose `tag` is `value`: a run by its key (RUN_KEY_TAG), a trial by TRIAL_TAG."""
        return newest_run_with_tag(self.client, experiment_id, tag, value)

    def run_of(self, experiment: str, tag: str, value: str) -> str:
        """The newest run of the experiment named `experiment` whose `tag` is `value`; ValueError without one."""
        experiment_id = self.experiment_id(experiment)
        run_id = self.run_by_tag(experiment_id, tag, value) if experiment_id is not None else None
        if run_id is None:
            raise ValueError(f"no run with {tag}={value!r} in experiment {experiment!r} of {self.uri}")
        return run_id

    def runs_with_tag(self, experiment_id: str, tag: str, value: str) -> list[Run]:
        """The active runs whose `tag` is `value`, oldest first."""
        return self.runs(experiment_id, f"tags.`{tag}` = '{value}'", order_by=["attributes.start_time ASC"])

    def children(self, experiment_id: str, parent_run_id: str) -> list[Run]:
        """The child runs of a sweep's parent run (its trials)."""
        return self.runs(experiment_id, f"tags.`{PARENT_TAG}` = '{parent_run_id}'")

    def metric_history(self, run_id: str, key: str) -> list[Metric]:
        """Every logged point of one metric, by step (a resumed run may hold a step twice: by time then)."""
        return sorted(self.client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))

    def first_metric_ms(self, run_ids: list[str]) -> int | None:
        """Epoch milliseconds of the earliest metric point any of the runs logged."""
        stamps = [point.timestamp for run_id in run_ids for key in self.run(run_id).data.metrics
                  for point in self.client.get_metric_history(run_id, key)]
        return min(stamps, default=None)


def ui_url(base: str, experiment_id: str, run_id: str | None = None, *, metric: str | None = None,
           mode: str = "min") -> str:
    """A page of the MLflow UI at `base`: a run's, or the experiment's training runs, sorted best first by
    `metric` (sorting by a metric also lists a sweep's children flat, not folded under the parent).
    `workflowType=machine_learning`: MLflow 3.17's UI opens every experiment in its GenAI view unless told,
    whatever the experiment's kind tag says, once its workflow switch is on."""
    experiment = f"{base.rstrip('/')}/#/experiments/{experiment_id}"
    if run_id:
        return f"{experiment}/runs/{run_id}?workflowType=machine_learning"
    if not metric:  # the experiment's own address: the UI picks the page for the workflow type
        return f"{experiment}?workflowType=machine_learning"
    order = f"&orderByKey={quote(f'metrics.`{metric}`', safe='')}&orderByAsc={'true' if mode == 'min' else 'false'}"
    return f"{experiment}/runs?workflowType=machine_learning{order}"
