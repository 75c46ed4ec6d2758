"""Checks that need the machine, not just the spec, done before Ray starts: a missing or empty data file
fails here in a second with the field's name, not half a minute later inside a Ray worker; a tracking store
that cannot be reached is refused unless the spec opts into offline logging; a multi-node cluster gets
storage and tracking that every node reaches (`check_multi_node`, once the cluster is known); and a storage
URI has a known scheme, a local storage folder can be made and written, an s3:// storage answers and takes
writes (`check_storage`). `orchestrator validate` runs these too, the tracking server's round trip included
(`check_before_ray`). (A run name is held by one live launcher at a time: orchestrator/launch/name_lock.py.)"""

from __future__ import annotations

import codecs
import gzip
import ipaddress
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from orchestrator.spec import ExperimentSpec, SpecError
from orchestrator.spec.messages import did_you_mean
from orchestrator.storage.layout import cache_dir_of
from orchestrator.storage.locations import is_remote, storage_scheme_problem
from orchestrator.storage.object_store import (
    StorageError,
    check_s3_storage,
    is_s3,
    use_storage,
)

if TYPE_CHECKING:  # mlflow is imported only by the commands that log
    from orchestrator.tracking.write import MlflowTracker

class LaunchError(RuntimeError):
    """A run or sweep cannot be started or resumed; the message says why and what to do."""

    exit_code = 1


class NameNotFound(LaunchError):
    """The storage holds nothing of the name given to resume, status or evaluate: a wrong argument, which exits
    as an invalid spec does (2), not as a failed run (1)."""

    exit_code = 2


def check_storage(spec: ExperimentSpec) -> None:
    """The spec's run.storage_endpoint / storage_region become this process's S3 settings (storage.use_storage),
    and an s3:// run.storage_path answers and takes writes, before any trial starts (SpecError naming the field
    and the fix); a URI's scheme is one pyarrow's file systems know; a local path is checked against the file
    system's length limits (`check_path_lengths`) and must be a folder this process can make and write
    (`folder_problem`, nothing created); other remote storage (gs://) is checked by its first write."""
    storage = spec.run.storage_path
    if problem := storage_scheme_problem(storage):
        raise SpecError(f"run.storage_path={storage!r}: {problem}")
    check_path_lengths(spec)
    if not is_remote(storage) and (problem := folder_problem(Path(storage))):
        raise SpecError(f"run.storage_path={storage!r} cannot hold runs: {problem}; choose a folder this user can "
                        "create and write (e.g. run.storage_path=runs), or fix that folder's permissions")
    use_storage(spec.run.storage_endpoint, spec.run.storage_region)
    if is_s3(storage):
        try:
            check_s3_storage(spec.run.storage_path)
        except StorageError as err:
            raise SpecError(str(err)) from None


def folder_problem(path: Path) -> str | None:
    """Why `path` cannot be (or become) a folder this process writes, judged at its nearest existing part without
    creating anything (an unnamed O_TMPFILE probe, which works as root too, unlike os.access), or None."""
    existing = path.expanduser().absolute()
    while not _exists(existing) and existing != existing.parent:  # False under a regular file too
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"{existing} cannot be written ({err.strerror or err})"
    return None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a folder above it not searchable (EACCES), a name too long: judged at a parent instead
        return False


TRACKING_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks",
                    "databricks-uc", "uc")
"""URI schemes MLflow's tracking stores take (a database scheme may name its driver: postgresql+psycopg2)."""


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow cannot use `uri` as a tracking store whatever answers there (a host:port without its scheme,
    which MLflow reads as a folder; a misspelt scheme), or None; no store is contacted."""
    if re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[\w.-]+):\d+/?", uri):
        return (f"tracking.uri={uri!r} is a host and port without a scheme (MLflow would read it as a folder); "
                f"write tracking.uri=http://{uri.rstrip('/')}")
    found = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", uri)
    scheme = found.group(1).lower() if found else ""
    if not scheme or scheme.split("+")[0] in TRACKING_SCHEMES:
        return None
    hint = did_you_mean(scheme, TRACKING_SCHEMES, most=1)
    return (f"tracking.uri={uri!r}: {scheme!r} is not a tracking store scheme; {hint}use one of "
            f"{', '.join(TRACKING_SCHEMES)} (e.g. tracking.uri=sqlite:///mlflow.db or http://<host>:5000)")


def check_tracking_uri(spec: ExperimentSpec) -> None:
    """The tracking URI is one MLflow takes, and a SQLite store's or file store's folder can be made and written
    (SpecError naming tracking.uri); nothing is contacted or created."""
    uri = spec.tracking.uri
    if problem := tracking_uri_problem(uri):
        raise SpecError(problem)
    if database := _sqlite_file(uri):
        folder = Path(database).parent
    elif _is_local_tracking(uri) and not uri.startswith("sqlite:"):
        folder = Path(uri.removeprefix("file://"))
    else:
        return
    if problem := folder_problem(folder):
        raise SpecError(f"tracking.uri={uri!r}: the store cannot be written there: {problem}; point it at a folder "
                        "this user can write (e.g. tracking.uri=sqlite:///mlflow.db) or fix its permissions")


PATH_HEADROOM = 512
"""Bytes a run adds under a folder the spec names: its name (at most 100), trials/trial_<id>/checkpoint_<step>/,
a file name, or a tracking store's artifacts/<experiment>/<run id>/..., with room to spare."""


def check_path_lengths(spec: ExperimentSpec) -> None:
    """Each local folder the spec names fits the file system's limits: one folder name of more than NAME_MAX bytes
    (255 on Linux), or a path too long for what runs add under it, failed at the first mkdir with a bare
    ENAMETOOLONG naming no field (for task.prepared_path, in a Ray worker)."""
    for field, value in _local_paths(spec):
        path = Path(value)
        name_max, path_max = _limits(path)
        for part in path.parts:
            size = len(os.fsencode(part))
            if size > name_max:
                raise SpecError(f"{field}: the name {part[:40]!r}... is {size} bytes, more than the {name_max} "
                                "a file name may have on this file system; choose a shorter one")
        size = len(os.fsencode(str(path)))
        if size + PATH_HEADROOM > path_max:
            raise SpecError(f"{field} is {size} bytes long, and runs add up to {PATH_HEADROOM} under it: past the "
                            f"{path_max} bytes a path may have on this file system; choose a shorter path")


def _local_paths(spec: ExperimentSpec) -> list[tuple[str, str]]:
    paths = [] if is_remote(spec.run.storage_path) else [("run.storage_path", spec.run.storage_path)]
    prepared = getattr(spec.task, "prepared_path", None)  # corpus tasks only
    if prepared and not is_remote(prepared):
        paths.append(("task.prepared_path", prepared))
    if database := _sqlite_file(spec.tracking.uri):
        paths.append(("tracking.uri", database))
    return paths


def _sqlite_file(uri: str) -> str | None:
    """The database file of a SQLite tracking URI (None for another store, or SQLite in memory)."""
    prefix = "sqlite:///"
    return uri[len(prefix):] if uri.startswith(prefix) and uri != prefix + ":memory:" else None


def _limits(path: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system holding `path`'s nearest existing folder; Linux's usual values
    where it cannot be asked."""
    for folder in (path, *path.parents):
        try:
            if folder.is_dir():
                return os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
        except (OSError, ValueError):  # too long to ask about (ENAMETOOLONG), or no such limit on this system
            continue
    return 255, 4096


def _data_files(spec: ExperimentSpec) -> list[tuple[str, list[Path]]]:
    """(field, the files it may name) for each split the spec reads from local files."""
    files = getattr(spec.task, "files", None)  # generated tasks (listops, mqar) read no files
    if files is None:
        return []
    out = []
    for split in ("train", "validation", "test"):
        value = getattr(files, split)
        if value is None:
            continue
        field = f"task.files.{split}"
        if spec.task.kind == "translation":  # a prefix: <prefix>.<lang> or <prefix>.<lang>.gz per side
            for lang in (spec.task.source_lang, spec.task.target_lang):
                out.append((f"{field} ({lang} side)", [Path(f"{value}.{lang}"), Path(f"{value}.{lang}.gz")]))
        else:
            out.append((field, [Path(value)]))
    return out


def check_data_files(spec: ExperimentSpec) -> None:
    """Every local data file the spec names exists and is not empty, and a hub dataset or pretrained model is
    cached here or known to the hub (SpecError naming the field): a missing one fails in seconds, not inside a Ray
    worker."""
    from tasks.text_sources import hub_dataset_problem

    # only tasks that may name a hub dataset have task.dataset (not the generated ones, nor bytelm's files)
    problem = (hub_dataset_problem(spec.task, Path(cache_dir_of(spec.run.storage_path)))
               if hasattr(spec.task, "dataset") else None)
    if spec.task.kind == "pretrained_lm":
        from tasks.pretrained_config import pretrained_model_problem

        problem = pretrained_model_problem(spec.task)
    if problem:
        raise SpecError(problem)
    for field, candidates in _data_files(spec):
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            hint = _translation_hint(spec, field, candidates[0]) if spec.task.kind == "translation" else None
            raise SpecError(f"{field}: {' or '.join(str(p) for p in candidates)} does not exist; " + (hint or (
                "fix the path (relative paths are resolved against the directory the command runs in)")))
        if found.stat().st_size == 0:
            raise SpecError(f"{field}: {found} is empty (0 bytes); point it at the split's text")
        if spec.task.kind != "bytelm" and (problem := utf8_problem(found)):  # bytelm reads bytes, any bytes
            raise SpecError(f"{field}: {found} is not UTF-8 text ({problem}); convert it, e.g. "
                            f"iconv -f latin1 -t utf-8 {found} > {found.stem}.utf8{found.suffix}")


def _translation_hint(spec: ExperimentSpec, field: str, missing: Path) -> str | None:
    """The fix when a translation side is missing but the prefix's folder says why: the prefix was given as a
    whole file name (`train.de.gz`), or the files hold other languages than task.source_lang/target_lang."""
    prefix = Path(missing.name[: -len(missing.suffix)]).name  # <prefix>.<lang> -> <prefix>
    folder, lang = missing.parent, missing.suffix[1:]
    for known in (spec.task.source_lang, spec.task.target_lang):
        for ending in (f".{known}", f".{known}.gz"):
            if prefix.endswith(ending) and any((folder / name).is_file() for name in (prefix, f"{prefix}.gz")):
                return (f"{field.split(' ')[0]} is a prefix, read as <prefix>.<lang>[.gz]: give "
                        f"{folder / prefix[: -len(ending)]}")
    suffixes = {m.name[len(prefix) + 1:].removesuffix(".gz") for m in folder.glob(f"{prefix}.*")}
    langs = sorted(x for x in suffixes if x and "." not in x and x != "gz")
    if not langs:
        return None
    role = "task.source_lang" if lang == spec.task.source_lang else "task.target_lang"
    return (f"the files with that prefix hold languages {langs}, not {lang!r}; set {role} to one of them (language "
            "codes are the file names' suffixes, case included)")


def utf8_problem(path: Path, limit: int = 1 << 20) -> str | None:
    """Why the first `limit` bytes of a text file (decompressed, for .gz) are not UTF-8, or None. A prefix, so
    that a corpus of gigabytes is checked in milliseconds; a bad byte further in is named by the reader
    (tasks/text_sources.py) with its file and offset."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        head = f.read(limit)
    try:  # final only when the file ended: a character cut by the limit is not an error
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < limit)
    except UnicodeDecodeError as err:
        return f"byte {head[err.start]:#04x} at offset {err.start} is not valid UTF-8"
    return None


def check_labelled_data(spec: ExperimentSpec, cache_dir: str) -> None:
    """A classification spec's local files have the named text and label columns, and every label is one of
    the classes (SpecError naming the field), read once here so that a bad column fails before Ray starts.
    The files are parsed into `cache_dir`'s datasets cache, where the workers find them again."""
    if spec.task.kind != "classify" or spec.task.files is None:
        return
    from tasks.classify import classification_data

    splits = tuple(s for s in ("train", "validation", "test") if getattr(spec.task.files, s) is not None)
    try:
        classification_data(spec.task, splits, Path(cache_dir))
    except ValueError as err:
        raise SpecError(str(err)) from None


def check_tracking(spec: ExperimentSpec, tracker: "MlflowTracker") -> None:
    """The tracking URI is one MLflow takes (whatever tracking.offline_ok says: a misspelt scheme never answers),
    and the store answers, or the spec says to train without it (tracking.offline_ok)."""
    if problem := tracking_uri_problem(spec.tracking.uri):
        raise LaunchError(problem)
    if spec.tracking.offline_ok or tracker.reachable():
        return
    refused = str(tracker.last_error or "")
    if "Invalid Host header" in refused:  # MLflow 3's DNS-rebinding guard: a 403 for a Host outside --allowed-hosts
        from urllib.parse import urlparse

        host = urlparse(spec.tracking.uri).netloc
        raise LaunchError(
            f"tracking.uri={spec.tracking.uri!r}: the MLflow server refuses the host name {host!r} (403 Invalid Host "
            f"header: MLflow 3 serves only localhost and private IPs unless told); restart the server with "
            f"`mlflow server ... --allowed-hosts {host}`, or set tracking.uri to the server's private IP"
        )
    if "error code 401" in refused or "error code 403" in refused:
        raise LaunchError(
            f"tracking.uri={spec.tracking.uri!r}: the MLflow server refuses these credentials ({refused[:200]}); set "
            "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for the launcher; on a "
            "cluster the nodes read them from ~/.ray/mlflow_credentials at `ray start` (cluster.yaml; never a "
            "runtime_env, which Ray writes to its logs)"
        )
    why = f"{type(tracker.last_error).__name__}: {str(tracker.last_error)[:200]}" if tracker.last_error else "no answer"
    raise LaunchError(
        f"tracking.uri={spec.tracking.uri!r} cannot be reached ({why}); start the MLflow "
        "server or fix the URI (e.g. tracking.uri=sqlite:///mlflow.db), or set tracking.offline_ok=true to "
        "train anyway: metrics then wait in the run folder's spool and are sent when the server answers"
    )


def _is_local_tracking(uri: str) -> bool:
    """A tracking URI that names a file on the machine that opens it (SQLite, ./mlruns), not a server."""
    if uri.startswith(("sqlite:", "file:")):
        return True
    return "://" not in uri and not uri.startswith("databricks")  # a bare path is a file store


def _loopback_host(url: str) -> str | None:
    """The host of `url` when it names the machine that opens it (127.0.0.0/8, ::1, localhost, 0.0.0.0), else None;
    names are not resolved: on the head its own host name may map to 127.0.1.1, on the other nodes to the head."""
    try:
        host = urlsplit(url).hostname  # lower case, without the brackets of [::1]
    except ValueError:
        return None
    if not host:
        return None
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: always the loopback
        return host
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    loopback = address.is_loopback or address.is_unspecified or (mapped is not None and mapped.is_loopback)
    return host if loopback else None


def _head_address(url: str) -> str:
    """`url` with its host replaced by a placeholder for the head's address that the other nodes reach."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return parts._replace(netloc=f"<head-ip>{port}").geturl()


def check_multi_node(spec: ExperimentSpec, nodes: int, autoscaling: bool, *, one_machine: bool = False) -> None:
    """On a cluster of several nodes (or one an autoscaler may grow), storage and tracking must be one place
    that every node reaches: Ray Train workers on other nodes write checkpoints to run.storage_path, and rank 0
    logs to tracking.uri from whichever node it lands on. Called once the cluster is known (after connect),
    before any trial starts; a single node, or a head that runs everything, keeps local paths. A loopback
    address answers this check on the head but is each node itself: refused unless every node is on one machine
    (`one_machine`: Ray's test clusters)."""
    if nodes <= 1 and not autoscaling:
        return
    where = f"{nodes} nodes" + (" and an autoscaler that may add more" if autoscaling else "")
    storage = spec.run.storage_path
    if not is_remote(storage) and not spec.run.shared_storage:
        raise SpecError(
            f"run.storage_path={storage!r} is a local folder, but the Ray cluster has {where}: each node would "
            "keep its own checkpoints, and a trial moved to another node could not resume. Use storage every node "
            "reaches: run.storage_path=s3://<bucket>/runs (or gs://...), or, if this folder is a shared mount "
            "(NFS, EFS) on every node, say so with run.shared_storage=true"
        )
    uri = spec.tracking.uri
    if _is_local_tracking(uri):
        # MLflow's SQLite and file stores are single-machine stores: a worker on another node would open its own
        # file, and SQLite's locking is unreliable on network file systems (sqlite.org/faq.html#q5).
        raise SpecError(
            f"tracking.uri={uri!r} is a file on each node, but the Ray cluster has {where}: rank 0 logs from "
            "whichever node it runs on, so runs would be split across machines. Run `mlflow server` on the head "
            "(cluster.yaml starts one on port 5000) and set tracking.uri=http://<head-ip>:5000"
        )
    if one_machine:
        return
    addresses = [("tracking.uri", uri, "rank 0 there could not reach the tracking server (its metrics would only be "
                  "spooled)", "server's", "the head's private IP"),
                 ("run.storage_endpoint", spec.run.storage_endpoint, "the workers there could not restore or write "
                  "checkpoints", "store's", "the head's private IP, or the store's own host")]
    for field, url, consequence, whose, hint in addresses:
        if url is not None and (host := _loopback_host(url)) is not None:
            raise SpecError(
                f"{field}={url!r} is a loopback address, but the Ray cluster has {where}: it answers on the head, "
                f"where this check runs, but on every other node {host} is that node itself, so {consequence}. Give "
                f"the {whose} address that the worker nodes reach: set {field}={_head_address(url)} ({hint})"
            )
