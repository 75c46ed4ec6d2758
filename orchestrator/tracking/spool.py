"""What a tracker has not sent yet: metric points, and params and tags (`MlflowTracker.defer`), held in memory
(bounded) and mirrored whole into a spool file when the tracker has one (a run folder's `mlflow-spool.jsonl`,
local or an object next to the checkpoints), so they outlive the process. Each entry carries its run id, or
None for the spool's own run while it is not open yet: `adopt` gives them to it once it is.

The file is one JSON object per line: a point (`run_id`, `key`, `value`, `timestamp`, `step`, and `once` for
a training metric sent only if the run does not hold that step yet), or params or tags (`run_id`, `kind`,
`items`). Sending is the tracker's job (orchestrator/tracking/write.py); this module only keeps.
"""

from __future__ import annotations

import json
from collections import deque

from mlflow.entities import Metric

from orchestrator.storage.locations import read_text, remove, write_text

MAX_BUFFERED_METRICS = 20_000

Deferred = tuple[str | None, str, dict[str, str]]
"""(run id, "params" or "tags", items)."""


class Unsent:
    """Unsent entries of one tracker, and their spool file (`location`; None: memory only)."""

    def __init__(self, location: str | None):
        self.location = location
        self.points: deque[tuple[str | None, Metric]] = deque(maxlen=MAX_BUFFERED_METRICS)
        self.once: set[int] = set()
        """ids of points to send only if their run does not hold that (metric, step) yet."""
        self.deferred: list[Deferred] = []
        """Params and tags, sent before the points."""
        self._in_file = True
        """The file may hold entries: a save with nothing left then deletes it (and only then: on an object
        store every check is a request)."""

    def add(self, run_id: str | None, metric: Metric, *, once: bool) -> None:
        self.points.append((run_id, metric))
        if once:
            self.once.add(id(metric))

    def points_of(self, run_id: str) -> list[Metric]:
        return [m for rid, m in self.points if rid == run_id]

    def holds(self, run_id: str | None) -> bool:
        return any(rid == run_id for rid, _ in self.points) or any(rid == run_id for rid, _, _ in self.deferred)

    def run_ids(self) -> set[str | None]:
        return {rid for rid, _ in self.points} | {rid for rid, _, _ in self.deferred}

    def drop(self, ids: set[int]) -> None:
        """Forget the points with these ids (sent, or not to be sent)."""
        if ids:
            self.points = deque((p for p in self.points if id(p[1]) not in ids), maxlen=MAX_BUFFERED_METRICS)
            self.once -= ids

    def adopt(self, run_id: str) -> bool:
        """The entries of the run not open yet (run id None) become `run_id`'s; True when there were some."""
        if not self.holds(None):
            return False
        self.points = deque(((rid or run_id, m) for rid, m in self.points), maxlen=MAX_BUFFERED_METRICS)
        self.deferred = [(rid or run_id, kind, items) for rid, kind, items in self.deferred]
        return True

    def load(self) -> None:
        """Take the file as the whole truth: every save mirrors memory into it, and another process (the worker)
        may have sent or added entries since. OSError when storage does not answer (memory is kept then)."""
        if self.location is None:
            return
        rows = (read_text(self.location) or "").splitlines()
        self._in_file = bool(rows)
        self.points, self.once, self.deferred = deque(maxlen=MAX_BUFFERED_METRICS), set(), []
        for line in rows:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a partial line: files are replaced whole, so only a foreign edit makes one
            if "items" in row:
                self.deferred.append((row["run_id"], row["kind"], row["items"]))
            else:
                self.add(row["run_id"], Metric(row["key"], row["value"], row["timestamp"], row["step"]),
                         once=bool(row.get("once")))

    def save(self) -> None:
        """Mirror memory into the file, whole (layout.write_text: a kill leaves the old or the new); delete it
        when nothing is left. OSError when storage does not answer (the entries stay in memory)."""
        if self.location is None or (not self.points and not self.deferred and not self._in_file):
            return
        if not self.points and not self.deferred:
            remove(self.location)
        else:
            rows = [json.dumps({"run_id": rid, "kind": kind, "items": items}) for rid, kind, items in self.deferred]
            rows += [json.dumps({"run_id": rid, "key": m.key, "value": m.value, "timestamp": m.timestamp,
                                 "step": m.step, **({"once": True} if id(m) in self.once else {})})
                     for rid, m in self.points]
            write_text(self.location, "\n".join(rows) + "\n")
        self._in_file = bool(self.points or self.deferred)
