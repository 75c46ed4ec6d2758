"""What a run, sweep or experiment may be called: the name becomes a folder in storage (local or s3://), an MLflow
experiment, and a part of Ray's trial and file names, so it is one path component that cannot climb out of its
folder (no `/`, no leading `.`) and that stays well under a file system's 255-byte limit once Ray and the project
add their prefixes and suffixes."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
MAX_NAME_LENGTH = 100


def name_problem(value: str) -> str | None:
    """Why `value` cannot be a name, or None when it can."""
    if len(value) > MAX_NAME_LENGTH:
        return f"{len(value)} characters, at most {MAX_NAME_LENGTH} characters are allowed"
    if not re.fullmatch(NAME_PATTERN, value):
        return "only letters, digits and . _ - are allowed, starting with a letter or digit"
    return None


def _checked_name(value: str) -> str:
    if (problem := name_problem(value)) is not None:
        raise ValueError(f"{value[:80]!r} is not a name: {problem}")
    return value


Name = Annotated[str, AfterValidator(_checked_name)]
"""A spec field that holds a name (the spec's own, tracking.experiment): checked by `name_problem`, the rule the
CLI holds a NAME argument to."""
