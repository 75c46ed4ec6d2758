"""`orchestrator prepare SPEC [overrides]`: tokenise a spec's data once, before any run, where its runs look.

Every task block the spec's runs will read is prepared (the spec's own; a `pretrain:` stage's; one per grid
point of a sweep whose domains change the task block) into the folder the workers map: task.prepared_path, or
the cache folder of run.storage_path (orchestrator/storage/layout.py `cache_dir_of`). `train` and `sweep` then find
every split prepared and only map it. The work itself is tasks/data.py `prepare_all`; this module chooses the
task blocks and prints where they went. Ray is not imported: preparation runs on the machine that calls it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.spec import ExperimentSpec, Study
from orchestrator.spec.search_space import grid_points
from orchestrator.storage.layout import cache_dir_of


def task_specs(study: Study) -> tuple[list[ExperimentSpec], list[str]]:
    """(specs whose task blocks differ, notes): the runs' task blocks, each once."""
    notes = []
    specs = [study.base]
    task_domains = [d for d in study.domains if d.path.startswith("task.")]
    if task_domains:
        if study.base.tune.search == "grid":
            specs = [study.spec_for(point) for point in grid_points(study.domains)]
        sampled = [d.path for d in task_domains if not d.is_grid or study.base.tune.search != "grid"]
        if sampled:
            notes.append(f"{', '.join(sampled)} are drawn per trial: each trial prepares its own value's data "
                         "when it starts (the spec's first values are prepared here)")
    specs += [s.pretraining_spec() for s in list(specs) if s.pretrain is not None]
    unique: dict[str, ExperimentSpec] = {}
    for spec in specs:
        unique.setdefault(spec.task.model_dump_json(), spec)
    return list(unique.values()), notes


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def prepare_spec(study: Study, argv: Sequence[str]) -> int:
    """Prepare every task block of the study; prints each split's folder and counts."""
    from tasks.data import prepare_all  # deferred: the data stack is imported by the command that needs it

    rebuild = shlex.join(["orchestrator", "prepare", *argv])
    specs, notes = task_specs(study)
    for note in notes:
        print(f"note: {note}")
    for spec in specs:
        task = spec.task
        if task.kind == "classify":
            print(f"{task.source_label}: classification sets are read whole (they are small); nothing to prepare")
            continue
        cache_dir = Path(cache_dir_of(spec.run.storage_path))
        summaries = prepare_all(task, cache_dir, rebuild)
        head = summaries[0]
        print(f"{task.kind} data {task.source_label}: tokenizer {head['tokenizer']} "
              f"({'cached' if head['tokenizer_existed'] else 'trained'})")
        for row in summaries:
            target = f", target side {_count(row['target_tokens'])} tokens" if row["target_tokens"] is not None else ""
            how = "already prepared" if row["existed"] else f"prepared in {row['seconds']:.1f} s"
            print(f"  {row['split']}: {_count(row['tokens'])} tokens ({row['dtype']}), "
                  f"{_count(row['documents'])} documents{target}; {how}: {row['folder']}")
    return 0


def describe_argv(spec_path: str, overrides: Sequence[str], scale: str | None) -> list[str]:
    """The command-line arguments that prepare this spec again (written into every manifest)."""
    out: list[Any] = [spec_path, *overrides]
    return out + (["--scale", scale] if scale else [])
