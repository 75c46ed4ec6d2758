"""Reading a local MLflow SQLite store with the standard library's sqlite3, read-only.

Benchmarks read what runs logged (metric histories, timestamps, params, tags) without importing mlflow, which
only orchestrator/ imports (STYLE.md section 5); the tables read (experiments, runs, metrics, params, tags)
are MLflow's tracking schema.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence

SQLITE_PREFIX = "sqlite:///"


@contextlib.contextmanager
def _store(uri: str) -> Iterator[sqlite3.Connection]:
    if not uri.startswith(SQLITE_PREFIX):
        raise ValueError(f"tracking.uri={uri!r}: this benchmark reads a local SQLite store (sqlite:///path)")
    connection = sqlite3.connect(f"file:{uri[len(SQLITE_PREFIX):]}?mode=ro", uri=True)
    try:
        yield connection
    finally:
        connection.close()


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """(step, value, timestamp in ms) of one metric of one run, by step."""
    with _store(uri) as db:
        rows = db.execute("SELECT step, value, timestamp FROM metrics WHERE run_uuid = ? AND key = ? ORDER BY step",
                          (run_id, key)).fetchall()
    return [(int(s), float(v), int(t)) for s, v, t in rows]


def first_metric_ms(uri: str, run_ids: Sequence[str]) -> int | None:
    """Epoch milliseconds of the earliest metric any of the runs logged."""
    if not run_ids:
        return None
    marks = ",".join("?" * len(run_ids))
    with _store(uri) as db:
        (value,) = db.execute(f"SELECT MIN(timestamp) FROM metrics WHERE run_uuid IN ({marks})", tuple(run_ids)).fetchone()
    return None if value is None else int(value)




def metric_keys(uri: str, run_id: str) -> list[str]:
    with _store(uri) as db:
        return [k for (k,) in db.execute("SELECT DISTINCT key FROM metrics WHERE run_uuid = ? ORDER BY key", (run_id,))]


def run_params(uri: str, run_id: str) -> dict[str, str]:
    with _store(uri) as db:
        return dict(db.execute("SELECT key, value FROM params WHERE run_uuid = ?", (run_id,)).fetchall())


def run_tags(uri: str, run_id: str) -> dict[str, str]:
    with _store(uri) as db:
        return dict(db.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)).fetchall())


def find_run(uri: str, experiment: str, run_name: str) -> str:
    """The newest run named `run_name` in `experiment` (ValueError when there is none)."""
    with _store(uri) as db:
        row = db.execute(
            "SELECT r.run_uuid FROM runs r JOIN experiments e ON r.experiment_id = e.experiment_id "
            "WHERE e.name = ? AND r.name = ? ORDER BY r.start_time DESC LIMIT 1", (experiment, run_name)).fetchone()
    if row is None:
        raise ValueError(f"no run named {run_name!r} in experiment {experiment!r} of {uri}")
    return row[0]


def runs_with_tag(uri: str, experiment: str, key: str, value: str) -> list[str]:
    """Ids of the active runs of `experiment` whose tag `key` is `value`, oldest first."""
    with _store(uri) as db:
        rows = db.execute(
            "SELECT r.run_uuid FROM runs r JOIN experiments e ON r.experiment_id = e.experiment_id "
            "JOIN tags t ON t.run_uuid = r.run_uuid WHERE e.name = ? AND t.key = ? AND t.value = ? "
            "AND r.lifecycle_stage = 'active' ORDER BY r.start_time", (experiment, key, value)).fetchall()
    return [run_id for (run_id,) in rows]
