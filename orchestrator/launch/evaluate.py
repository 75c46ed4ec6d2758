"""`orchestrator evaluate` and the final evaluation of every run: choose a run's checkpoint, score it on a split
(orchestrator/training/scoring.py does the scoring, without Ray or MLflow), export the model, log it all.

`orchestrator train` (and every sweep trial) ends here: the best checkpoint by the spec's metric (kept by
Ray's CheckpointConfig score attribute next to the latest) is scored on all of the test split in a Ray task
with one worker's resources (a GPU node on a cluster), the `test/*` metrics and outputs (hypotheses, the
exported model) go to the run's MLflow run and to `<run folder>/evaluation/` in storage.
`orchestrator evaluate NAME` runs the same scoring again on a finished run, for any split and checkpoint; a
checkpoint other than the best keeps its own folder, `evaluation/<checkpoint folder>/`, beside the final one.

Selecting on the split being scored would leak it into the score: when the spec evaluates on the test split
during training (task.eval_split: test, e.g. WikiText-2 here, which has no other held-out split), the latest
checkpoint is scored instead of the best, and the result says so.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.cluster.ray_env import stored_result
from orchestrator.launch.deliver import deliver_outputs
from orchestrator.launch.preflight import NameNotFound
from orchestrator.spec import ExperimentSpec
from orchestrator.storage.layout import (
    EVALUATION_DIR,
    RunLayout,
    cache_dir_of,
    checkpoint_evaluation_dir,
    evaluation_record,
    spool_of,
)
from orchestrator.storage.locations import join, upload, write_json
from orchestrator.storage.object_store import use_storage
from orchestrator.tracking.write import open_tracker
from orchestrator.training.checkpoint import read_checkpoint
from orchestrator.training.scoring import (
    Evaluation,
    evaluate_checkpoint,
    split_task_config,
)

Which = str
"""best | latest | a kept checkpoint's folder name (checkpoint_000002750); `evaluate_stored` also takes all."""


@dataclass(frozen=True)
class ChosenCheckpoint:
    checkpoint: Any
    """The ray.train.Checkpoint: its path and the filesystem it lives on (local, or remote storage)."""
    which: Which
    """What was actually taken (latest when best was asked but selection would see the scored split)."""
    metrics: dict[str, Any]
    """The report that came with it."""
    note: str = ""

    @property
    def path(self) -> str:
        return self.checkpoint.path


def choose_checkpoint(result: Any, spec: ExperimentSpec, which: Which, split: str | None) -> ChosenCheckpoint | None:
    """From a ray.train.Result: its best checkpoint by spec.metric, or its latest. None without checkpoints.
    `split` is the split the choice will be scored on (None: no split, e.g. a checkpoint to fine-tune from)."""
    if result.checkpoint is None:
        return None
    note = ""
    if which == "best" and spec.task.eval_split == split:
        which, note = "latest", (f"task.eval_split is {split!r}: the best checkpoint was chosen on that split, "
                                 "so the latest is scored instead")
    if which not in ("best", "latest"):
        kept = {Path(c.path).name: (c, m) for c, m in (result.best_checkpoints or [])}
        if which not in kept:
            raise ValueError(f"--checkpoint {which!r} is not kept in this run; kept: {', '.join(sorted(kept))}, "
                             "or best, latest, all")
        checkpoint, metrics = kept[which]
        return ChosenCheckpoint(checkpoint, which, dict(metrics), note)
    if which == "best":
        scored = [(c, m) for c, m in (result.best_checkpoints or []) if m.get(spec.metric) is not None]
        if scored:
            pick = (min if spec.mode == "min" else max)(scored, key=lambda cm: cm[1][spec.metric])
            return ChosenCheckpoint(pick[0], "best", dict(pick[1]), note)
        which, note = "latest", f"no checkpoint reported {spec.metric}; the latest is scored"
    return ChosenCheckpoint(result.checkpoint, which, dict(result.metrics or {}), note)


def score_and_store(spec: ExperimentSpec, chosen: ChosenCheckpoint, split: str, *, cache_dir: str,
                    destination: str, export: bool) -> dict[str, float]:
    """Score `chosen` on `split` and write the outputs to the evaluation folder `destination` (in the run's
    storage): the files first, then `<split>.metrics.json` with the scores, so a record always has its files.
    MLflow gets them from there (orchestrator/launch/deliver.py), sent by the launcher."""
    # as_directory downloads the checkpoint first when it lives in remote storage.
    with chosen.checkpoint.as_directory() as directory, tempfile.TemporaryDirectory(prefix="evaluation-") as out:
        evaluation: Evaluation = evaluate_checkpoint(Path(directory), split, cache_dir=Path(cache_dir),
                                                     out_dir=Path(out), export=export)
        upload(Path(out), destination)
    write_json(evaluation_record(destination, split),
               {"split": split, "step": evaluation.step, "metrics": evaluation.metrics,
                "tags": {f"{split}.checkpoint": f"{chosen.which} (step {evaluation.step})"}})
    return dict(evaluation.metrics)


def _score_on_a_node(spec: ExperimentSpec, chosen: ChosenCheckpoint, split: str, **kwargs: Any) -> dict[str, float]:
    """`score_and_store` as the final evaluation's Ray task: on a joined cluster the task's process has only the
    job's environment, so the spec's store becomes this process's first, as in each Train worker and trial driver
    (an s3:// run with run.storage_endpoint otherwise read its checkpoint from, and wrote its scores to, AWS)."""
    use_storage(spec.run.storage_endpoint, spec.run.storage_region)
    return score_and_store(spec, chosen, split, **kwargs)


def final_evaluation(spec: ExperimentSpec, result: Any, run_folder: str, *, cache_dir: str,
                     console: str | None = None) -> dict[str, float]:
    """The end of a run: the best checkpoint on the test split, exported, written to `<run_folder>/evaluation/`
    (the launcher sends it to MLflow: orchestrator/launch/deliver.py); {} when switched off or when the data has no
    test split. Runs as a Ray task with one training worker's resources. Its console lines are labelled
    `console` (the trial's label in a sweep; the spec's name by default)."""
    import ray

    console = console or spec.name

    if not spec.run.final_eval:
        return {}
    if split_task_config(spec.task, "test") is None:
        print(f"[{console}] no test split in task.files: final evaluation skipped")
        return {}
    chosen = choose_checkpoint(result, spec, "best", "test")
    if chosen is None:
        return {}
    if chosen.note:
        print(f"[{console}] {chosen.note}")
    print(f"[{console}] final evaluation: {chosen.which} checkpoint {Path(chosen.path).name} on the test split")
    resources: dict[str, float] = {"num_cpus": spec.run.cpus_per_worker}
    if spec.run.gpus_per_worker:
        resources["num_gpus"] = min(1.0, spec.run.gpus_per_worker)
    # "DEFAULT" scheduling: outside a sweep trial's placement group, which reserves only its driver's CPU.
    task = ray.remote(**resources)(_score_on_a_node).options(scheduling_strategy="DEFAULT")
    metrics = ray.get(task.remote(spec, chosen, "test", cache_dir=cache_dir,
                                  destination=join(run_folder, EVALUATION_DIR), export=True))
    print(f"[{console}] " + " | ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    return metrics


def evaluation_folder(which: Which, chosen: ChosenCheckpoint) -> str:
    """Where `orchestrator evaluate` stores a scoring, relative to the run folder. The default (best) is what the
    final evaluation scored, so it goes to `evaluation/` and a re-run rewrites the same record; any other
    checkpoint goes to `evaluation/<its folder name>/`, or `--checkpoint latest` would replace the final
    evaluation's scores and files (orchestrator/launch/deliver.py keeps its MLflow keys apart too)."""
    return EVALUATION_DIR if which == "best" else checkpoint_evaluation_dir(Path(chosen.path).name)


def _stored_runs(storage: str, name: str) -> list[tuple[str, str]]:
    """(label, Train run folder) of a stored run, or of every Train run of a stored sweep (its trials' and their
    pretraining stages')."""
    layout = RunLayout(storage, name)
    meta = layout.read_meta()
    if meta is None:
        raise NameNotFound(f"nothing named {name!r} in {storage}; check the name and --storage-path")
    if meta["kind"] == "run":
        return [(name, layout.folder)]
    return [(f"{name} {label}", folder) for label, folder in layout.stage_runs()]


def evaluate_stored(name: str, storage: str, *, split: str = "test", which: Which = "best",
                    cache_dir: str | None = None) -> list[dict[str, Any]]:
    """`orchestrator evaluate`: score a finished run (or every trial of a sweep) again, in this process, and
    send the scores to its MLflow run (each (metric, step) once, however often this runs). One dict per run:
    label, checkpoint, which, metrics."""
    out = []
    for label, run_path in _stored_runs(storage, name):
        result = stored_result(run_path)
        if result.checkpoint is None:
            print(f"[{label}] no checkpoint yet: skipped")
            continue
        with result.checkpoint.as_directory() as directory:
            state = read_checkpoint(Path(directory))
        spec = ExperimentSpec.model_validate(state.spec)
        # all: every kept checkpoint, in step order, a learning curve on the whole split.
        asked = sorted(Path(c.path).name for c, _ in (result.best_checkpoints or [])) if which == "all" else [which]
        choices = [(chosen, evaluation_folder(which, chosen)) for chosen in
                   (choose_checkpoint(result, spec, one, split) for one in asked)]
        cache = cache_dir or cache_dir_of(storage)  # the cache that moved with the runs, if they moved
        for chosen, folder in choices:
            if chosen.note:
                print(f"[{label}] {chosen.note}")
            checkpoint = Path(chosen.path).name  # `--checkpoint checkpoint_000000420` chose it by that name
            shown = (f"checkpoint {checkpoint}" if chosen.which == checkpoint
                     else f"the {chosen.which} checkpoint {checkpoint}")
            print(f"[{label}] scoring {shown} on the {split} split")
            metrics = score_and_store(spec, chosen, split, cache_dir=cache, destination=join(run_path, folder),
                                      export=False)
            print(f"[{label}] " + " | ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
            out.append({"label": label, "checkpoint": chosen.path, "which": chosen.which, "metrics": metrics,
                        "outputs": join(run_path, folder)})
        tracker = open_tracker(spec.tracking, spool_of(run_path))
        run_id = state.mlflow_run_id
        delivered = deliver_outputs(tracker, run_id, run_path)
        if run_id is not None:
            tracker.flush(run_id, force=True)
        if not delivered or (run_id is not None and tracker.holds_unsent(run_id)):
            print(f"[{label}] the tracking server at {spec.tracking.uri} did not take every output; they wait in "
                  f"{run_path} and the next `orchestrator evaluate` or `orchestrator resume` sends them")
    return out
