"""What every `task:` block that reads local files shares: the frozen, strict pydantic base of task configs, the
files of each split, and the check of the split that `evaluate` scores. tasks/config.py joins the task kinds;
tasks/pretrained_config.py builds on these too, so they live apart from both."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataFiles(_Config):
    """Local files per split. LM: plain text paths (gzipped or not). Translation: path prefixes, read as
    `<prefix>.<lang>` or `<prefix>.<lang>.gz`. Relative paths are made absolute against the working directory
    where the spec is validated, because Ray workers may run elsewhere."""

    train: str
    """Training split (file for LM, prefix for translation)."""
    validation: str | None = None
    """Validation split; needed when task.eval_split is "validation"."""
    test: str | None = None
    """Test split; needed when task.eval_split is "test"."""

    @field_validator("train", "validation", "test")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().resolve())


def check_eval_split(files: DataFiles, eval_split: str, eval_batches: int | None) -> None:
    """The evaluation settings of a task that reads local files: the split's file given, a positive cap."""
    if eval_batches is not None and eval_batches < 1:
        raise ValueError(f"task.eval_batches={eval_batches} must be >= 1, or leave it unset")
    if getattr(files, eval_split) is None:
        raise ValueError(f"task.eval_split={eval_split!r} but task.files.{eval_split} is not given; "
                         f"add task.files.{eval_split} or change task.eval_split")
