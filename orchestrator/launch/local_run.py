"""The training core in this process, without Ray: what benchmarks and the golden-loss test train with.

Same seeds, steps, evaluation and checkpoint state as a one-worker `orchestrator train` run (the Ray worker
drives the same `Trainer`), minus Ray's placement and storage: checkpoints, when a folder is given, are
written there (the latest and the best by the spec's metric are kept), and running again resumes from the
latest. Metrics go to a callback; nothing is logged to MLflow.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from orchestrator.launch.pretrained import load, preflight
from orchestrator.spec import ExperimentSpec, spec_to_yaml
from orchestrator.storage.layout import checkpoint_name, local_checkpoints
from orchestrator.training.checkpoint import read_checkpoint, write_checkpoint
from orchestrator.training.trainer import Trainer
from tasks import WorkerContext

MetricsCallback = Callable[[Mapping[str, float], int], None]


@dataclass
class LocalHooks:
    """Keeps every logged metric; writes checkpoints to `folder` (latest + best) when given."""

    spec: ExperimentSpec
    folder: Path | None = None
    on_metrics: MetricsCallback | None = None
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    best_checkpoint: Path | None = None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.history.append((step, dict(metrics)))
        if self.on_metrics is not None:
            self.on_metrics(metrics, step)

    def report(self, trainer: Trainer, step: int, metrics: Mapping[str, float], checkpoint: bool) -> None:
        self.log(metrics, step)
        if not checkpoint or self.folder is None:
            return
        path = write_checkpoint(self.folder, trainer.checkpoint_state(None), spec_to_yaml(self.spec),
                                trainer.task.artifacts().get("tokenizer"))
        if trainer.best.step == step:
            self.best_checkpoint = path
        for old in local_checkpoints(self.folder):
            if old not in (path, self.best_checkpoint):
                shutil.rmtree(old, ignore_errors=True)

    def after_step(self, step: int) -> None:
        pass


def latest_checkpoint(folder: Path) -> Path | None:
    found = local_checkpoints(Path(folder))
    return found[-1] if found else None


def train_locally(spec: ExperimentSpec, *, cache_dir: Path, folder: Path | None = None,
                  on_metrics: MetricsCallback | None = None) -> tuple[Trainer, LocalHooks]:
    """Train `spec` to optim.max_steps in this process (resuming from `folder` when it holds a checkpoint)."""
    ctx, initialize = WorkerContext(seed=spec.optim.seed, cache_dir=Path(cache_dir)), None
    pretrained = preflight(spec)
    if pretrained is not None:  # fine-tuning: the pretrained encoder and its tokenizer
        loaded = load(pretrained.location, Path(cache_dir) / "init-from" / Path(pretrained.location).name)
        ctx, initialize = replace(ctx, tokenizer_path=loaded.tokenizer), loaded.initializer(spec.model.freeze)
    trainer = Trainer.create(spec, ctx, initialize=initialize)
    hooks = LocalHooks(spec, Path(folder) if folder is not None else None, on_metrics)
    if folder is not None and (latest := latest_checkpoint(Path(folder))) is not None:
        trainer.restore(read_checkpoint(latest))
        best = Path(folder) / checkpoint_name(trainer.best.step or 0)
        hooks.best_checkpoint = best if best.exists() else None
    trainer.fit(hooks)
    return trainer, hooks
