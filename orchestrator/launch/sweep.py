"""A Tune sweep: one driver trial per configuration, a parent MLflow run with a child per trial, and its outcome.

Ray Train V2 (default since Ray 2.51, pinned on here) refuses `Tuner(trainer)`: a sweep trial is a
*driver function* that builds and fits its own TorchTrainer (orchestrator/launch/run.py) and forwards rank 0's reports
to Tune with `TuneReportCallback` (Ray doc_code/train_tune_interop.py). Trial names are the trial ids, never
timestamps, so re-running with the same (storage_path, name) resumes instead of starting over.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from orchestrator.cluster.ray_env import stored_result
from orchestrator.cluster.resources import HEAD_RESOURCE, ClusterView
from orchestrator.console.progress import (
    SweepProgress,
    describe_config,
    failure_reason,
    quiet_exit_in_finalizers,
    set_verbose,
    trial_label,
    verbose,
)
from orchestrator.launch.deliver import deliver_outputs
from orchestrator.launch.name_lock import name_lock
from orchestrator.launch.preflight import (
    check_data_files,
    check_labelled_data,
    check_storage,
    check_tracking,
)
from orchestrator.launch.run import (
    build_trainer,
    check_cluster,
    claim,
    connect,
    describe_run,
    fit_and_finish,
    stage_to_train,
)
from orchestrator.launch.sweep_summary import best_of, summarize_sweep
from orchestrator.launch.validate_checks import check_pretrained_runs
from orchestrator.launch.worker_config import WorkerConfig
from orchestrator.spec import ExperimentSpec, Study, expected_trials, validate_spec
from orchestrator.spec.loading import SEED_PATH
from orchestrator.spec.resources import stage_runs
from orchestrator.spec.search_space import resolve, to_param_space
from orchestrator.spec.vocabulary import check_study_adaptive_bands
from orchestrator.storage.layout import RunLayout, finished, mark_finished
from orchestrator.storage.locations import is_remote, ray_storage
from orchestrator.storage.object_store import use_storage
from orchestrator.tracking.describe import (
    POINT_TAG,
    RUN_KEY_TAG,
    SEED_TAG,
    TRIAL_TAG,
    RunHandle,
    failure_tags,
    flatten,
    git_commit,
    run_handle,
)
from orchestrator.tracking.write import MlflowTracker, open_tracker

DRIVER_RESOURCES = {HEAD_RESOURCE: 0.001}
"""What a sweep's trial driver reserves: a sliver of the head node, and no CPU. On the head, a driver outlives
the loss of any worker node (spot GPU nodes), so a lost node costs its Train workers only, which Ray Train
restarts from the latest checkpoint under the same driver and MLflow child run; the head's CPUs may be 0
(kept free of training). Ray Train V2 puts a run's workers in a placement group of its own, made by the run's
controller: a Tune trial's placement group cannot hold them (Ray has no nested placement groups), so bundles
for them there would reserve every worker twice. The driver only waits on its Train run; holding a whole CPU,
drivers admitted on `resume` (Tune restarts every unfinished trial at once) took the CPUs their own workers
needed and no worker group ever started. Holding none, trials beyond what fits wait for their worker group,
and start as others end (or as the autoscaler adds nodes for them). 0.001 of the head: up to 1000 drivers."""


def max_concurrent_trials(spec: ExperimentSpec, cluster: ClusterView) -> int:
    """Trials that fit at once when the autoscaler has added every node it may: GPUs / GPUs per trial; on
    CPU, CPUs / (workers x cpus per worker). More would only wait for their worker groups. A trial with a
    `pretrain:` stage holds the larger of its stages' (the stages run one after the other)."""
    if spec.tune.max_concurrent is not None:
        return spec.tune.max_concurrent
    runs = [run for _, run in stage_runs(spec)]
    gpus = max(run.gpus_per_run for run in runs)
    if gpus > 0:
        return max(1, int(cluster.most("GPU") // gpus))
    per_trial = max(run.workers * run.cpus_per_worker for run in runs)
    return max(1, int(cluster.most("CPU") // per_trial))


# Ray's tune and ray.train modules are imported inside the functions below: ray.train only after connect()
# switched on Train V2 (orchestrator/cluster/ray_env.py), and a trial driver imports them in its own process.


def _trial_driver(config: dict[str, Any], *, study_raw: dict[str, Any], parent_run_id: str | None,
                  commit: str, fail_at_step: int | None = None, verbose_on: bool = False) -> None:
    """One Tune trial: resolve its spec, open its child MLflow run, build and fit its TorchTrainer."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    set_verbose(verbose_on)  # the launcher's --verbose, also on a cluster whose job env does not carry it
    quiet_exit_in_finalizers()
    trial_id = tune.get_context().get_trial_id()
    spec, handle = _trial_run(study_raw, config, trial_id, commit=commit, parent_run_id=parent_run_id)
    use_storage(spec.run.storage_endpoint, spec.run.storage_region)  # a driver on another node: its own process
    run_name = handle.run_name
    layout = RunLayout(spec.run.storage_path, spec.name)
    run_path = layout.trial_folder(trial_id)
    tracker = open_tracker(spec.tracking, layout.spool_of_trial(trial_id))
    if finished(run_path) is not None:
        # Finished before the launcher died, after Tune last saved its state: neither trained nor reopened again
        # (the sweep's outcome counts it from its record and closes its child run if it was left RUNNING).
        return
    # Found by trial id first: a retried or restored trial keeps its child run.
    handle = handle.with_run_id(tracker.ensure_run(handle))
    train_spec, init_checkpoint = stage_to_train(spec, storage_path=layout.trials_folder,
                                                 run_name=layout.trial_pretrain_name(trial_id),
                                                 mlflow_name=f"{run_name}-pretrain", commit=commit,
                                                 parent_run_id=parent_run_id, label=f"{spec.name} {trial_id}",
                                                 console=trial_label(trial_id, config))
    worker = WorkerConfig(spec=train_spec.model_dump(mode="json"), run=handle, label=f"{spec.name} {trial_id}",
                          cache_dir=layout.cache_dir, run_path=run_path, spool=layout.spool_of_trial(trial_id),
                          fail_at_step=fail_at_step, init_checkpoint=init_checkpoint)
    trainer = build_trainer(spec, run_name=layout.trial_run_name(trial_id), storage_path=layout.trials_folder,
                            worker=worker, callbacks=[TuneReportCallback()])
    result, _, final, _ = fit_and_finish(spec, trainer, handle, tracker, layout.cache_dir, label=f"trial {trial_id}",
                                         advice=None, console=trial_label(trial_id, config))
    mark_finished(run_path, {**dict(result.metrics or {}), **final})


def _trial_run(study_raw: dict[str, Any], config: dict[str, Any], trial_id: str, *, commit: str,
               parent_run_id: str | None) -> tuple[ExperimentSpec, RunHandle]:
    """A trial's spec and the handle of its child MLflow run: the trial driver opens the run with it, and the
    launcher, when the server was away for the whole trial (`_close_children`)."""
    spec = validate_spec(resolve(study_raw, config), where=f"trial {trial_id}")
    # What the trial tries, then its id: the MLflow runs page lists children by name.
    run_name = f"{describe_config(config) or spec.name} ({trial_id})"
    run_path = RunLayout(spec.run.storage_path, spec.name).trial_folder(trial_id)
    handle = describe_run(spec, run_name=run_name, role="trial", commit=commit, key=(TRIAL_TAG, trial_id),
                          run_path=run_path, parent_run_id=parent_run_id)
    return spec, replace(handle, tags={**handle.tags, **point_tags(config, spec.optim.seed)})


def point_tags(config: dict[str, Any], seed: int) -> dict[str, str]:
    """A trial's seed and its method point (the swept values but the seed): the runs of one point under every
    seed of `tune.seeds` share POINT_TAG, and the report pairs the runs of two points by SEED_TAG."""
    point = {path: value for path, value in config.items() if path != SEED_PATH}
    return {SEED_TAG: str(seed), POINT_TAG: describe_config(point) or "(no swept values)"}


def tune_config(study: Study, cluster: ClusterView):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    spec = study.base
    settings = spec.tune
    if settings.scheduler == "asha":
        # One ASHA time unit = one report = one evaluation; max_t is the last one. The worker counts them from
        # the step ("evaluations"): Tune's training_iteration restarts at 1 in a resumed trial.
        # stop_last_trials=False: a trial that reaches max_t ends by itself. Stopping it from Tune at its last
        # report would kill its driver while the Train run is still shutting down (cf. ray#54305).
        from orchestrator.training.trainer import (
            Cadence,  # torch.distributed with it: only a sweep's ASHA needs it here
        )

        scheduler = ASHAScheduler(time_attr="evaluations", max_t=Cadence.of(spec).report_count(),
                                  grace_period=settings.grace_period, reduction_factor=settings.reduction_factor,
                                  stop_last_trials=False)
    else:
        scheduler = FIFOScheduler()
    search_alg = None
    metric, mode = spec.metric, spec.mode
    if settings.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        if len(spec.objectives) > 1:
            # Optuna's multi-objective TPE through Ray Tune: the searcher holds the objectives; Tune's own metric
            # and mode stay unset (Tune takes one metric, and refuses one given to both).
            names, modes = zip(*spec.objectives)
            search_alg = OptunaSearch(metric=list(names), mode=list(modes), seed=spec.optim.seed)
            metric, mode = None, None
        else:
            search_alg = OptunaSearch(seed=spec.optim.seed)
    return tune.TuneConfig(metric=metric, mode=mode, scheduler=scheduler, search_alg=search_alg,
                           num_samples=settings.num_samples,
                           max_concurrent_trials=max_concurrent_trials(spec, cluster),
                           trial_name_creator=_trial_name, trial_dirname_creator=_trial_name,
                           reuse_actors=reuses_trial_drivers(settings.scheduler))


def reuses_trial_drivers(scheduler: str) -> bool:
    """Under FIFO a trial starts in an ended trial's driver, saving a new process's imports (docs/orchestrator.md,
    "Trial drivers"); an ASHA-stopped trial's driver is still in `trainer.fit()`, and handing it over hung a sweep."""
    return scheduler == "fifo"


def _console(study: Study):
    """The sweep's lines on the launcher's terminal: a report line per result, a progress line per change."""
    from orchestrator.launch.ray_console import SweepConsole

    spec = study.base
    return SweepConsole(SweepProgress(name=spec.name, total=expected_trials(study), max_steps=spec.optim.max_steps,
                                      metric=spec.metric, mode=spec.mode))


def _trial_name(trial: Any) -> str:
    """`trial_<id>`: the id alone names a trial everywhere (Tune folder, Train run, MLflow child run)."""
    return f"trial_{trial.trial_id}"


@dataclass(frozen=True)
class SweepOutcome:
    name: str
    path: str
    parent_run_id: str | None
    trials: list[dict[str, Any]]
    """Per trial: id, config, status, last metrics."""
    best: dict[str, Any] | None
    errors: int
    interrupted: bool = False
    """Tuner.fit returned before every trial ended (Ctrl-C); `orchestrator resume NAME` continues it."""
    resumable: bool = False
    """Some trial wrote a checkpoint, so `orchestrator resume NAME` has something to continue."""
    metric: str = ""
    """The compared metric (tune.metric)."""


def pin_paths(study: Study) -> Study:
    """The study with every path its trial drivers read made absolute against the launcher's directory:
    run.storage_path and a SQLite tracking.uri as validated, and local data files (task.files.*, also a
    pretrain: stage's). Each driver validates the raw spec again in its own process, in whatever directory Ray
    started it (under Tune's chdir, its trial folder): a relative path there would name another place."""
    raw = copy.deepcopy(study.raw)
    # run and tracking cannot be searched (study_from_raw): the base spec's values are every trial's.
    raw["run"] = {**(raw.get("run") or {}), "storage_path": study.base.run.storage_path}
    raw["tracking"] = {**(raw.get("tracking") or {}), "uri": study.base.tracking.uri}
    for task in (raw.get("task"), (raw.get("pretrain") or {}).get("task")):
        files = task.get("files") if isinstance(task, dict) else None
        if isinstance(files, dict):
            for split, value in files.items():
                if isinstance(value, str) and not is_remote(value):
                    files[split] = str(Path(value).expanduser().resolve())
    return replace(study, raw=raw)


def _trainable(study: Study, parent_run_id: str | None, commit: str, fail_at_step: int | None = None):
    from ray import tune

    driver = tune.with_parameters(_trial_driver, study_raw=study.raw, parent_run_id=parent_run_id, commit=commit,
                                  fail_at_step=fail_at_step, verbose_on=verbose())
    return tune.with_resources(driver, tune.PlacementGroupFactory([dict(DRIVER_RESOURCES)]))


def run_sweep(study: Study, *, resume: bool = False, fail_at_step: int | None = None) -> SweepOutcome:
    """A Tune sweep: one driver trial per configuration, a parent MLflow run with a child per trial.
    `resume=True` restores the Tuner: unfinished and errored trials resume under their own trial ids, so each
    driver reopens its child MLflow run and its Train run restores from its own latest checkpoint.
    `fail_at_step` makes every trial's worker raise after that step, as in run_training: a fault-injection
    hook for testing resume. The trainable is rebuilt on restore, so a resumed sweep runs without it.
    The parent run ends FINISHED only when every trial finished (or ASHA stopped it), FAILED when one errored,
    KILLED when the sweep was interrupted."""
    from ray import tune

    study = pin_paths(study)
    spec = study.base
    layout = RunLayout(spec.run.storage_path, spec.name)
    check_storage(spec)
    check_data_files(spec)
    check_labelled_data(spec, layout.cache_dir)
    check_pretrained_runs(study)
    check_study_adaptive_bands(study)  # the real vocabulary, as validate checks it (orchestrator/spec/vocabulary.py)
    with name_lock(layout):
        tracker = open_tracker(spec.tracking)
        meta = claim(spec, resume, tracker)
        commit = (meta or {}).get("commit") or git_commit()
        sweep_params = {f"tune.{k}": v for k, v in flatten(spec.tune.model_dump(mode="json")).items()}
        sweep_params.update({"sweep.domains": ", ".join(d.path for d in study.domains) or "(none)"})
        parent = run_handle(sweep_params, yaml.safe_dump(study.raw, sort_keys=False),
                            experiment=spec.tracking.experiment, run_name=spec.name, role="sweep",
                            kind=None, commit=commit, key=(RUN_KEY_TAG, layout.folder))
        check_tracking(spec, tracker)
        connect()
        cluster = check_cluster(spec)  # before the parent run: a cluster that cannot run it leaves nothing behind
        parent_run_id = tracker.ensure_run(parent.with_run_id((meta or {}).get("parent_run_id")))
        status = "FAILED"
        try:
            if resume:
                _send_trial_spools(spec, layout)
            layout.write_meta({"kind": "sweep", "name": spec.name, "raw": study.raw,
                               "parent_run_id": parent_run_id, "commit": commit})
            trainable = _trainable(study, parent_run_id, commit, fail_at_step)
            from orchestrator.launch.ray_console import quiet_tune

            tune_verbosity = quiet_tune()  # a restored Tuner too: its logger and reporter would print tracebacks
            tune_path, filesystem = ray_storage(layout.folder)
            if resume and tune.Tuner.can_restore(tune_path, storage_filesystem=filesystem):
                # resume_errored, not restart_errored: a restarted trial is reset to a new trial id, which would
                # start a new Train run from scratch under a new child MLflow run.
                tuner = tune.Tuner.restore(tune_path, trainable, resume_unfinished=True, resume_errored=True,
                                           storage_filesystem=filesystem)
            else:
                tuner = tune.Tuner(
                    trainable,
                    param_space=to_param_space(study.domains, spec.tune.search),
                    tune_config=tune_config(study, cluster),
                    run_config=tune.RunConfig(name=spec.name, storage_path=ray_storage(layout.storage)[0],
                                              storage_filesystem=filesystem,
                                              failure_config=tune.FailureConfig(max_failures=spec.tune.max_failures),
                                              verbose=tune_verbosity, callbacks=[_console(study)]),
                )
            grid = tuner.fit()
            outcome = _sweep_outcome(study, grid, tracker, parent_run_id, commit)
            _summarize(study, outcome, tracker)
            status = "KILLED" if outcome.interrupted else "FAILED" if outcome.errors else "FINISHED"
            return outcome
        except (KeyboardInterrupt, SystemExit):
            status = "KILLED"
            raise
        finally:
            if parent_run_id is not None:
                tracker.end_run(parent_run_id, status)


def newest_report(metrics: dict[str, Any], trial_folder: str) -> dict[str, Any]:
    """Tune's last result of a trial that was cut short (Ctrl-C, an error), or the report its newest registered
    checkpoint carries when that one is later: Tune hears of a trial's reports through its driver, which a Ctrl-C
    stops before it passes the last ones on, so the summary showed a value from before the trial's last
    checkpoint while MLflow and the checkpoint held a newer one."""
    try:
        stored = dict(stored_result(trial_folder).metrics or {})
    except Exception:  # noqa: BLE001 - no checkpoint registered yet (or storage away): Tune's result is all there is
        return metrics
    if isinstance(stored.get("step"), int) and stored["step"] > metrics.get("step", -1):
        return {**metrics, **stored}
    return metrics


def _sweep_outcome(study: Study, grid: Any, tracker: MlflowTracker, parent_run_id: str | None,
                   commit: str) -> SweepOutcome:
    """Per trial: done (its run folder's record says it finished, or ASHA stopped it: Tune's last result says
    done), errored, or neither (the sweep was interrupted); children left RUNNING are closed (KILLED, or FAILED
    when errored). The record, not Tune's last result, decides for a finished trial: Tune saves its state now
    and then, so after a launcher kill it may hold a finished trial as running."""
    spec = study.base
    layout = RunLayout(spec.run.storage_path, spec.name)
    trials = []
    for result in grid:
        metrics = dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or Path(result.path).name.removeprefix("trial_")
        state = "error" if result.error else "done" if metrics.get("done") else "unfinished"
        record = finished(layout.trial_folder(str(trial_id)))
        if record is not None:  # the trial's own record, not Tune's last result (stale after a launcher kill)
            state, metrics = "done", {**metrics, **record}
        elif state != "done":
            metrics = newest_report(metrics, layout.trial_folder(str(trial_id)))
        trials.append({"trial_id": trial_id, "config": {k: v for k, v in (result.config or {}).items()},
                       "state": state, "error": failure_reason(result.error) if state == "error" else None,
                       "metrics": {k: v for k, v in metrics.items() if "/" in k or k in ("step", "evaluations")}})
    _close_children(tracker, study, trials, parent_run_id, commit)
    errors = sum(t["state"] == "error" for t in trials)
    interrupted = any(t["state"] == "unfinished" for t in trials) or len(trials) < expected_trials(study)
    try:
        tune_best = grid.get_best_result(metric=spec.metric, mode=spec.mode, scope="all")
        candidates = [{"config": tune_best.config, "metrics": dict(tune_best.metrics or {})}]
    except RuntimeError:
        candidates = []  # no trial reported the metric to Tune
    best = best_of(candidates + trials, spec.metric, spec.mode)
    return SweepOutcome(name=spec.name, path=layout.folder, parent_run_id=parent_run_id, trials=trials,
                        best=best, errors=errors, interrupted=interrupted,
                        resumable=layout.has_checkpoint(), metric=spec.metric)


def _summarize(study: Study, outcome: SweepOutcome, tracker: MlflowTracker) -> None:
    """The report's comparison on the sweep's parent MLflow run (orchestrator/launch/sweep_summary.py); its files
    also in the sweep's folder (`report/`) when storage is local. Never fails the sweep."""
    spec = study.base
    try:
        summarize_sweep(tracking_uri=spec.tracking.uri, tracker=tracker, experiment=spec.tracking.experiment,
                        parent_run_id=outcome.parent_run_id, name=spec.name, trials=outcome.trials,
                        metric=spec.metric, mode=spec.mode, objectives=spec.objectives,
                        out_dir=RunLayout(spec.run.storage_path, spec.name).report_dir)
    except Exception as err:  # noqa: BLE001 - the trials are done; `orchestrator report` can redo this
        print(f"[{spec.name}] the sweep's summary was not logged to MLflow ({type(err).__name__}: {str(err)[:200]})")


def _send_trial_spools(spec: ExperimentSpec, layout: RunLayout) -> None:
    """Metric points a trial could not send (an outage at its end) go out before the sweep goes on; the
    trials Tune resumes send their own, and those it does not are done."""
    for spool in layout.trial_spools():
        open_tracker(spec.tracking, spool).send_spooled()


def _close_children(tracker: MlflowTracker, study: Study, trials: list[dict[str, Any]], parent_run_id: str | None,
                    commit: str) -> None:
    """Child runs left RUNNING: a finished trial's gets the outputs it still owes (an outage at its end) and ends
    FINISHED once they are in; one ASHA stopped mid-run ends KILLED; an errored one FAILED, with its reason. A
    finished trial with no child run (the server was away for all of it) gets it now, with its spooled points."""
    spec = study.base
    experiment_id = tracker.experiment_id(spec.tracking.experiment)
    if experiment_id is None:
        return
    layout = RunLayout(spec.run.storage_path, spec.name)
    for trial in trials:
        trial_id = str(trial["trial_id"])
        finished_trial = trial["state"] == "done" and trial["metrics"].get("step") == spec.optim.max_steps
        run_id = tracker.find_run(experiment_id, TRIAL_TAG, trial_id)
        if run_id is None and finished_trial:
            _, handle = _trial_run(study.raw, trial["config"], trial_id, commit=commit, parent_run_id=parent_run_id)
            run_id = open_tracker(spec.tracking, layout.spool_of_trial(trial_id)).ensure_run(handle)
        if run_id is None:
            continue
        trial["mlflow_run_id"] = run_id
        if tracker.run_status(run_id) != "RUNNING":
            continue
        if trial["error"]:
            tracker.set_tags(run_id, failure_tags(trial["error"]))
            tracker.end_run(run_id, "FAILED")
        elif finished_trial:
            trial_tracker = open_tracker(spec.tracking, layout.spool_of_trial(trial_id))
            if deliver_outputs(trial_tracker, run_id, layout.trial_folder(trial_id)):
                trial_tracker.end_run(run_id, "FINISHED")
        else:
            tracker.end_run(run_id, "KILLED")
