"""One live launcher per run name: the lock that `train`, `sweep` and `resume` hold while they drive a name, so a
second launcher is refused instead of racing the first over its checkpoints and MLflow runs.

Local storage: a lock file created exclusively (O_EXCL). s3:// storage: an object with a lease, written only
with S3 conditional writes, so that two launchers on different machines never both hold it:
- take: PUT with `If-None-Match: *` (created only when absent);
- keep: a thread re-writes it every RENEW_S with `If-Match: <its ETag>`, which moves its Last-Modified on;
  a rewrite refused with 412 means another launcher took the lease over: said loudly, as the run goes on;
- take over: a holder of this host whose process is gone, or a lease not renewed for LEASE_S (by the store's
  own clock: its Date header against the object's Last-Modified, so no two machines' clocks are compared),
  is replaced with `If-Match: <the ETag read>`: of two launchers taking over at once, one wins;
- give back: DELETE with `If-Match: <its ETag>`.
A store that ignores conditional writes is refused by the preflight (orchestrator/storage/object_store.py). Other remote
storage (gs://, ...) has no lock."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from orchestrator.launch.preflight import LaunchError
from orchestrator.storage.layout import RunLayout
from orchestrator.storage.object_store import bucket_and_key, error_code, s3_client

LEASE_S = 300.0
"""A lease not renewed for this long is free: a launcher killed on another machine frees its name after 5
minutes (one killed on this machine at once: its process is gone). Long enough to outlast a storage outage
during which renewals fail."""
RENEW_S = 30.0


def process_alive(pid: int) -> bool:
    """A process of this host with that pid runs (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def holder_gone(holder: dict[str, Any]) -> bool:
    """The lock's launcher ran on this host and its process is gone (killed)."""
    return holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) and \
        not process_alive(holder["pid"])


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "owner": uuid.uuid4().hex}


def _in_use(layout: RunLayout, holder: dict[str, Any], fix: str) -> LaunchError:
    return LaunchError(f"{layout.name!r} is in use by process {holder.get('pid', '?')} on {holder.get('host', '?')} "
                       f"(since {holder.get('since', '?')}); wait for it to end, or, if that process is gone, {fix}")


@contextmanager
def name_lock(layout: RunLayout) -> Iterator[None]:
    """Hold the name's lock while this process drives it (the module's docstring says how, per storage)."""
    if layout.lock_path is not None:
        with _file_lock(layout, layout.lock_path):
            yield
    elif layout.lock_location is not None:
        lease = S3Lease(layout)
        lease.acquire()
        try:
            yield
        finally:
            lease.release()
    else:
        yield


@contextmanager
def _file_lock(layout: RunLayout, path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    me = _me()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = layout.lock_holder() or {}
            if holder_gone(holder):
                path.unlink(missing_ok=True)  # stale: its launcher was killed
                continue
            raise _in_use(layout, holder, f"delete {path}") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


class S3Lease:
    """The lock object of an s3:// name, held with a lease (the module's docstring)."""

    def __init__(self, layout: RunLayout, *, lease_s: float = LEASE_S, renew_s: float = RENEW_S):
        assert layout.lock_location is not None
        self.layout, self.lease_s, self.renew_s = layout, lease_s, renew_s
        self.bucket, self.key = bucket_and_key(layout.lock_location)
        self.me = _me()
        self.etag: str | None = None
        self.lost = False
        """Another launcher took the lease over (this one's renewals had stopped for longer than the lease)."""
        self._client = s3_client()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({**self.me, "lease_s": self.lease_s,
                           "renewed": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()

    def _put(self, **condition: str) -> str:
        return self._client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(), **condition)["ETag"]

    def _read(self) -> tuple[dict[str, Any], str, float] | None:
        """(holder, ETag, seconds since its last renewal by the store's clock), or None when there is no lock."""
        try:
            got = self._client.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as err:  # noqa: BLE001
            if error_code(err) in ("NoSuchKey", "404"):
                return None
            raise
        try:
            holder = json.loads(got["Body"].read() or b"{}")
        except json.JSONDecodeError:
            holder = {}
        now = parsedate_to_datetime(got["ResponseMetadata"]["HTTPHeaders"]["date"])
        return holder, got["ETag"], (now - got["LastModified"]).total_seconds()

    def acquire(self) -> None:
        """Take the lock (LaunchError naming the holder when it is held), then keep it renewed."""
        for _ in range(3):
            try:
                self.etag = self._put(IfNoneMatch="*")
                break
            except Exception as err:  # noqa: BLE001
                if error_code(err) not in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise
            found = self._read()
            if found is None:
                continue  # given back meanwhile: try to create it again
            holder, etag, age = found
            if not (holder_gone(holder) or age > float(holder.get("lease_s", self.lease_s))):
                left = float(holder.get("lease_s", self.lease_s)) - age
                raise _in_use(self.layout, holder, f"its lease runs out within {max(left, 0):.0f} s (then the next "
                              f"launcher takes it over), or delete s3://{self.bucket}/{self.key}")
            try:
                self.etag = self._put(IfMatch=etag)  # stale: its launcher died or stopped renewing
                break
            except Exception as err:  # noqa: BLE001
                if error_code(err) not in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise
                # another launcher took it over first: look again
        else:
            raise LaunchError(f"{self.layout.name!r}: the lock s3://{self.bucket}/{self.key} changed hands while "
                              "this launcher tried to take it; another launcher drives the name")
        self._thread = threading.Thread(target=self._keep, name="orchestrator-lease", daemon=True)
        self._thread.start()

    def renew(self) -> bool:
        """Renew the lease once; False when it could not be (an outage: tried again next time, or lost)."""
        try:
            self.etag = self._put(IfMatch=self.etag)
            return True
        except Exception as err:  # noqa: BLE001 - a renewal must never stop the run
            if error_code(err) in ("PreconditionFailed", "ConditionalRequestConflict"):
                self.lost = True
                print(f"[{self.layout.name}] WARNING: the name lock s3://{self.bucket}/{self.key} was taken over by "
                      "another launcher (this one could not renew its lease in time); two launchers now drive "
                      "this name: stop one of them", file=sys.stderr, flush=True)
            return False

    def _keep(self) -> None:
        while not self._stop.wait(self.renew_s) and not self.lost:
            self.renew()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.lost or self.etag is None:
            return
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)
        except Exception:  # noqa: BLE001 - taken over meanwhile, or the store is down: its lease then runs out
            pass
