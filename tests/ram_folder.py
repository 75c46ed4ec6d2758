"""A temporary folder in RAM (/dev/shm) where the machine has a writable one, else in the usual temporary place:
for the report tests' MLflow SQLite stores, whose thousands of small writes a disk makes slow."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def ram_folder() -> tempfile.TemporaryDirectory:
    in_ram = Path("/dev/shm")
    return tempfile.TemporaryDirectory(dir=in_ram if in_ram.is_dir() and os.access(in_ram, os.W_OK) else None)
