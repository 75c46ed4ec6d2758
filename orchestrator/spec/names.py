"""What a run, sweep or experiment may be called: the name becomes a folder in storage (local or s3://), an MLflow
experiment, and a part of Ray's trial and file names, so it is one path component that cannot climb out of its
folder (no `/`, no leading `.`) and that stays well under a file system's 255-byte limit once Ray and the project
add their prefixes and suffixes."""

from __future__ import annotations

import re

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
MAX_NAME_LENGTH = 100


def name_problem(value: str) -> str | None:
    """Why `value` cannot be a name, or None when it can."""
    if len(value) > MAX_NAME_LENGTH:
        return f"{len(value)} characters, more than {MAX_NAME_LENGTH}"
    if not re.fullmatch(NAME_PATTERN, value):
        return "only letters, digits and . _ - are allowed, starting with a letter or digit"
    return None
