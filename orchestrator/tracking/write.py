"""Writing to MLflow without ever stopping training: run creation (the only place runs are made), tags, params,
metrics, artifacts, and sending what the spool (orchestrator/tracking/spool.py) kept through an outage.

Every MLflow call goes through `MlflowTracker._call`: short HTTP timeouts, a bounded number of
attempts with exponential backoff, then a warning and a cool-down during which calls are skipped, so a
dead or slow server costs training at most a few seconds per cool-down. Metrics logged while the
server is away are buffered (bounded) and, when the tracker has a spool file (a run's storage folder),
written there too, so they survive the process: the launcher sends them before it ends the run, or a later
`orchestrator resume` does. A resumed or restarted run logs each (metric, step) once: steps MLflow (or the
spool) already holds are not sent again, and training metrics (`log_metrics(..., once=True)`) are checked
again when they are sent, so points spooled by a worker that could not ask MLflow (resumed during an outage)
beside an earlier attempt's are sent once too.

A tracker with a spool serves the one MLflow run of that spool's run folder. Points, params and tags given
before that run could be opened (the server was away when the run started, and maybe for all of it) are spooled
without a run id; they become the run's as soon as the run is opened (`ensure_run`) or ended (`end_run`)
through a tracker of the spool, in whichever process and however much later: the worker when the server comes
back, the launcher at the run's end, or `orchestrator resume`.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from orchestrator.console.progress import verbose
from orchestrator.tracking.describe import (
    MAX_PARAM_CHARS,
    RunHandle,
    artifact_location,
    stale_failure_tags,
)
from orchestrator.tracking.read import configure_http, logged_steps, newest_run_with_tag
from orchestrator.tracking.spool import Unsent

if TYPE_CHECKING:
    from orchestrator.spec import TrackingSettings

_BATCH = 100  # log_batch takes at most 100 params (and 1000 metrics) per call
_COOLDOWN_S = 30.0
_MAX_COOLDOWN_S = 600.0

T = TypeVar("T")


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""MLflow 3's UI opens an experiment without this tag on its GenAI overview (traces, tokens, latency); with
it, on the training runs. The values are the UI's `ExperimentKind` (mlflow/server/js); a tag an experiment
already has (a user's choice in the UI) is kept."""


class TrackingWarning(UserWarning):
    """MLflow was unreachable or refused a call; training continued without it."""


def create_run(client: MlflowClient, experiment_id: str, run_name: str, tags: Mapping[str, str]) -> str:
    """A new run: the one place runs are created (`MlflowTracker.ensure_run`, `new_run`)."""
    return client.create_run(experiment_id, run_name=run_name, tags=dict(tags)).info.run_id


def new_run(uri: str, experiment_id: str, run_name: str, tags: Mapping[str, str]) -> str:
    """A run that holds only artifacts (a report with no sweep to attach to), created ended."""
    client = MlflowClient(tracking_uri=uri)
    run_id = create_run(client, experiment_id, run_name, tags)
    client.set_terminated(run_id)
    return run_id


def log_files(uri: str, run_id: str, files: Iterable[Path], artifact_path: str) -> None:
    """Files as artifacts of a run, raising when the store refuses them (a command the user waits on)."""
    client = MlflowClient(tracking_uri=uri)
    for path in files:
        client.log_artifact(run_id, str(path), artifact_path=artifact_path)


class MlflowTracker:
    """A guarded MlflowClient: each call returns None (with a TrackingWarning) instead of raising."""

    def __init__(self, uri: str, *, retries: int = 3, timeout_s: float = 5.0, backoff_s: float = 0.5,
                 cooldown_s: float = _COOLDOWN_S, spool: Path | str | None = None):
        configure_http(timeout_s)
        # MLflow prints "View run ... / View experiment ..." each time a run ends, in every process that ends one:
        # several times per trial. The launcher prints its own links (status, ui); --verbose lets MLflow's through.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "false" if verbose() else "true")
        self.uri = uri
        self.retries = retries
        self.backoff_s = backoff_s
        self.cooldown_s = cooldown_s
        self.spool = str(spool) if spool is not None else None
        """Where unsent metric points are kept across processes: a local path or a URI (None: in memory only)."""
        # Created on first use, inside the guard: for a SQLite URI the constructor already opens the store.
        self._client: MlflowClient | None = None
        self._down_until = 0.0
        self._failures = 0  # consecutive failed calls: each doubles the cool-down, up to _MAX_COOLDOWN_S
        self._waiting = Unsent(self.spool)
        """Points, params and tags the server has not taken, mirrored into the spool."""
        self._held: dict[str, dict[str, int]] = {}
        """Per run, the last step of each metric the server holds, as far as this tracker knows."""
        self.last_error: Exception | None = None
        """Why the last failed call failed (the launcher's preflight explains it)."""
        self._load_spool()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def reachable(self) -> bool:
        """One guarded round trip to the store (the launcher's preflight, before Ray starts). Without the usual
        warning: its "training continues" is not what happens next (the preflight refuses, with the reason:
        `last_error`)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TrackingWarning)
            return self._call("connection check", lambda client: client.search_experiments(max_results=1),
                              force=True) is not None

    def _call(self, what: str, fn: Callable[[MlflowClient], T], *, force: bool = False) -> T | None:
        """`fn(client)` with bounded retries; on failure a TrackingWarning, a cool-down, and None.
        `force` tries even during a cool-down (the last chance to send before a run ends)."""
        if not self.available and not force:
            return None
        error: Exception | None = None
        for attempt in range(self.retries):
            try:
                if self._client is None:
                    self._client = MlflowClient(tracking_uri=self.uri)
                result = fn(self._client)
            except Exception as err:  # noqa: BLE001 - any tracking failure must stay a warning
                error = err
                if attempt + 1 < self.retries:
                    time.sleep(min(self.backoff_s * 2**attempt, 4.0))
            else:
                self._failures = 0
                return result
        # A server that stays down costs one round of timeouts per cool-down; doubling it keeps that share of
        # training time shrinking instead of fixed.
        cooldown = min(self.cooldown_s * 2**self._failures, _MAX_COOLDOWN_S)
        self._failures += 1
        self._down_until = time.monotonic() + cooldown
        self.last_error = error
        warnings.warn(
            f"MLflow {what} at {self.uri} failed after {self.retries} attempts ({type(error).__name__}: "
            f"{str(error)[:200]}); training continues, tracking retries in {cooldown:.0f}s",
            TrackingWarning,
            stacklevel=3,
        )
        return None

    # --- experiments and runs ------------------------------------------------------------------------

    def experiment_id(self, name: str) -> str | None:
        def get_or_create(client: MlflowClient) -> str:
            found = client.get_experiment_by_name(name)
            if found is None:
                return client.create_experiment(name, artifact_location=artifact_location(self.uri, name),
                                                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            if EXPERIMENT_KIND_TAG not in found.tags:  # made before the tag existed, or by another client
                client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return found.experiment_id

        return self._call(f"experiment {name!r}", get_or_create)

    def find_run(self, experiment_id: str, tag: str, value: str) -> str | None:
        """The newest run of the experiment whose `tag` equals `value` (e.g. a trial's child run)."""
        return self._call("run search", lambda client: newest_run_with_tag(client, experiment_id, tag, value))

    def create_run(self, experiment_id: str, run_name: str, tags: Mapping[str, str],
                   key: tuple[str, str] | None = None) -> str | None:
        """A new run; with `key`, a retried attempt first looks for the run carrying it: a create the server did
        but whose answer timed out is found by the retry instead of being made twice. (The first attempt does not
        look: ensure_run searched by the key just before.)"""
        attempts = 0

        def create(client: MlflowClient) -> str:
            nonlocal attempts
            attempts += 1
            found = newest_run_with_tag(client, experiment_id, *key) if key is not None and attempts > 1 else None
            return found or create_run(client, experiment_id, run_name, tags)

        return self._call(f"run creation ({run_name})", create)

    def _reopen(self, run_id: str) -> str:
        self._call("run reopen", lambda client: client.update_run(run_id, status="RUNNING"))
        return run_id

    def ensure_run(self, handle: RunHandle) -> str | None:
        """The run `handle` describes: its run id reopened, else the run carrying its key tag, else a new run
        with its tags, params and spec. The only way runs are created, so a run started during an outage and
        opened later by the worker, or found again by the launcher after training, is the same run."""
        run_id = self._open(handle)
        if run_id is not None:
            self._adopt(run_id)
        return run_id

    def _open(self, handle: RunHandle) -> str | None:
        if handle.run_id:
            return self._reopen(handle.run_id)
        experiment_id = self.experiment_id(handle.experiment)
        if experiment_id is None:
            return None
        found = self.find_run(experiment_id, *handle.key)
        if found:
            return self._reopen(found)
        run_id = self.create_run(experiment_id, handle.run_name, handle.tags, key=handle.key)
        if run_id is not None:
            self.log_params(run_id, handle.params)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "spec.yaml"
                path.write_text(handle.spec_yaml)
                self.log_artifact(run_id, path)
        return run_id

    def _adopt(self, run_id: str) -> None:
        """`run_id` is the spool's run: the points, params and tags given before it was known (run id None)
        become its."""
        if self._waiting.adopt(run_id):
            self._save_spool()

    def run_status(self, run_id: str) -> str | None:
        """RUNNING, FINISHED, FAILED or KILLED (None when the server cannot be asked)."""
        return self._call("run lookup", lambda client: client.get_run(run_id).info.status)

    def end_run(self, run_id: str, status: str = "FINISHED") -> bool:
        """Send every spooled point of the run (the worker's too), then mark it `status`. When points cannot
        be sent the run is left open, so it is never shown as ended with holes; False then, and the spool
        keeps them for the next launcher of this run (`orchestrator resume`)."""
        self._load_spool()
        self._adopt(run_id)
        self.flush(run_id, force=True)
        if self.holds_unsent(run_id):
            return False
        return self._call("run end", lambda client: client.set_terminated(run_id, status=status) or True,
                          force=True) is not None

    def last_steps(self, run_id: str) -> dict[str, int] | None:
        """Per metric, the last step the run holds in MLflow or in the spool (None when MLflow cannot be
        asked): a resumed run re-computes the steps after its checkpoint and must not log them again."""
        last = self._call("metric history", lambda client: logged_steps(client, run_id))
        if last is None:
            return None
        for metric in self._waiting.points_of(run_id):
            last[metric.key] = max(last.get(metric.key, metric.step), metric.step)
        return last

    def steps_held(self, run_id: str, keys: Iterable[str]) -> dict[str, set[int]]:
        """Per metric, the steps the run holds in MLflow or in the spool (the spool's alone when MLflow cannot
        be asked): what must not be sent again."""
        keys = list(keys)
        self._load_spool()  # the worker may have spooled or sent points since
        held: dict[str, set[int]] = {key: set() for key in keys}
        history = self._call("metric history", lambda client: {
            key: {m.step for m in client.get_metric_history(run_id, key)} for key in keys})
        for key, steps in (history or {}).items():
            held[key] |= steps
        for metric in self._waiting.points_of(run_id):
            if metric.key in held:
                held[metric.key].add(metric.step)
        return held

    def holds_unsent(self, run_id: str | None) -> bool:
        """Points of `run_id` wait in this tracker (in memory, and in its spool file if it has one); None: points
        whose run is not open yet."""
        return self._waiting.holds(run_id)

    # --- params, tags, metrics, artifacts ------------------------------------------------------------

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        self._log_items(run_id, "params", params)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> bool:
        """True when the server took them (or there were none)."""
        return self._log_items(run_id, "tags", tags)

    def clear_failure(self, run_id: str) -> bool:
        """Remove what `failure_tags` set (the reason; the description while it is still the failure's) from a run
        that has now FINISHED after a resume; True when none is left."""
        def clear(client: MlflowClient) -> bool:
            for key in stale_failure_tags(client.get_run(run_id).data.tags):
                client.delete_tag(run_id, key)
            return True
        return self._call("failure tag removal", clear) is not None

    def _log_items(self, run_id: str, kind: str, items: Mapping[str, Any], *, force: bool = False) -> bool:
        """Params or tags (`kind`) through log_batch, 100 a call; True when the server took them all (or there
        were none)."""
        entities = ([Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in items.items()] if kind == "params" else
                    [RunTag(k, str(v)) for k, v in items.items()])
        for i in range(0, len(entities), _BATCH):
            chunk = {kind: entities[i : i + _BATCH]}
            # `or True`: log_batch returns None, which _call uses to say "failed".
            if self._call(f"{kind[:-1]} logging", lambda client, chunk=chunk: client.log_batch(run_id, **chunk) or True,
                          force=force) is None:
                return False
        return True

    def defer(self, run_id: str | None, kind: str, items: Mapping[str, Any]) -> None:
        """Params or tags (`kind`) of a run that may not be open yet (run id None) or may not answer: spooled,
        and sent before its points by every flush until the server takes them. What a worker learns once
        (its model's sizes, its device) must reach the run even if the worker never sees the server."""
        if items:
            self._waiting.deferred.append((run_id, kind, {k: str(v) for k, v in items.items()}))
            self.flush(run_id)

    def _send_deferred(self, run_id: str, force: bool) -> bool:
        """Send the run's deferred params and tags; True when none is left."""
        for entry in [e for e in self._waiting.deferred if e[0] == run_id]:
            _, kind, items = entry
            if not self._log_items(run_id, kind, items, force=force):
                if not _refused(self.last_error):
                    return False
                # The server answered, no (a param logged before with another value): retrying cannot help,
                # and holding it would hold every point behind it.
                warnings.warn(f"MLflow refused the {kind} {sorted(items)} of run {run_id}; they are dropped",
                              TrackingWarning, stacklevel=2)
            self._waiting.deferred.remove(entry)
        return True

    def log_metrics(self, run_id: str | None, metrics: Mapping[str, float], step: int, *,
                    once: bool = False) -> None:
        """Buffer and send. `once`: a training metric, sent only if the run does not hold that (metric, step)
        yet, checked when it is sent: points logged while the server could not say which steps it holds (a
        worker resumed during an outage recomputes steps it logged before) are spooled all the same, and
        whichever attempt's point of a step reaches the server first is the one kept. `run_id` None: the
        spool's run, not open yet (the points are spooled and sent once it is)."""
        now_ms = int(time.time() * 1000)
        for key, value in metrics.items():
            self._waiting.add(run_id, Metric(key, float(value), now_ms, step), once=once)
        self.flush(run_id)

    def flush(self, run_id: str | None, *, force: bool = False) -> None:
        """Send buffered metrics of `run_id`, 1000 a call; what the server does not take stays buffered
        (and spooled). `force` (a launcher's last chance) also asks the server again which steps it holds.
        None (points of a run not open yet) only spools them."""
        if run_id is None:
            self._save_spool()
            return
        if force:
            self._held.pop(run_id, None)
        if (self.available or force) and not self._send_deferred(run_id, force):
            self._save_spool()
            return
        while (self.available or force) and self._waiting.points_of(run_id):
            batch = self._unsent(run_id, force)
            if batch is None:
                break
            if batch:
                # `or True`: log_batch returns None, which _call uses to say "failed".
                if self._call("metric logging", lambda client: client.log_batch(run_id, metrics=batch) or True,
                              force=force) is None:
                    break
                held = self._held.setdefault(run_id, {})
                for metric in batch:
                    if id(metric) in self._waiting.once:
                        held[metric.key] = max(held.get(metric.key, metric.step), metric.step)
            self._waiting.drop({id(m) for m in batch})
        self._save_spool()

    def _unsent(self, run_id: str, force: bool) -> list[Metric] | None:
        """The next batch of the run's points (at most 1000); `once` points whose (metric, step) the run
        holds, or an earlier pending point has, are dropped from the buffer here. None when the server
        cannot say which steps it holds."""
        mine, once = self._waiting.points_of(run_id), self._waiting.once
        if not any(id(m) in once for m in mine):
            return mine[:1000]
        if run_id not in self._held:
            held = self._call("metric history", lambda client: logged_steps(client, run_id), force=force)
            if held is None:
                return None
            self._held[run_id] = held
        seen, batch, duplicates = dict(self._held[run_id]), [], set()
        for metric in mine:
            if id(metric) in once:
                if metric.step <= seen.get(metric.key, -1):
                    duplicates.add(id(metric))
                    continue
                seen[metric.key] = metric.step
            batch.append(metric)
        self._waiting.drop(duplicates)
        return batch[:1000]

    def send_spooled(self) -> None:
        """Send every point the spool holds, whichever run it belongs to (a launcher's last chance, before it
        goes on: resume of a sweep whose trials ended during an outage). Points of a run never opened wait
        for whoever opens it (the resumed trial, or the launcher's closing of a finished one)."""
        self._load_spool()
        for run_id in self._waiting.run_ids():  # None: kept (flush only spools it)
            self.flush(run_id, force=True)

    def _load_spool(self) -> None:
        """Take the spool as the unsent entries (another process, the worker, may have sent or added some)."""
        try:
            self._waiting.load()
        except OSError as err:  # storage is away: what this process holds stays the truth until it answers
            warnings.warn(f"metric spool {self.spool} not read ({type(err).__name__}: {str(err)[:200]})",
                          TrackingWarning, stacklevel=3)

    def _save_spool(self) -> None:
        """Mirror the unsent entries into the spool. A storage outage keeps them in memory only, with a warning,
        until the next flush writes them."""
        try:
            self._waiting.save()
        except OSError as err:
            warnings.warn(f"metric spool {self.spool} not written ({type(err).__name__}: {str(err)[:200]}); the "
                          "points stay in memory until storage answers", TrackingWarning, stacklevel=3)

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> bool:
        """True when the store took the file."""
        return self._call(f"artifact upload ({Path(path).name})",
                          lambda client: client.log_artifact(run_id, str(path), artifact_path) or True) is not None

    def log_artifacts(self, run_id: str, directory: Path, artifact_path: str | None = None) -> None:
        """Every file under `directory`, as the artifact folder `artifact_path`."""
        self._call(f"artifact upload ({Path(directory).name}/)",
                   lambda client: client.log_artifacts(run_id, str(directory), artifact_path))


def _refused(error: Exception | None) -> bool:
    """The server answered and said no to the request itself (not: it could not be reached)."""
    return isinstance(error, MlflowException) and error.error_code == "INVALID_PARAMETER_VALUE"


def open_tracker(settings: TrackingSettings, spool: str | None = None) -> MlflowTracker:
    """The tracker of a spec's `tracking:` block; with `spool`, a run folder's spool file (RunLayout)."""
    return MlflowTracker(settings.uri, retries=settings.retries, timeout_s=settings.timeout_s, spool=spool)
