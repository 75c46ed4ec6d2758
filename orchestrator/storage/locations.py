"""Any storage location, a local path or a URI (s3://bucket/runs, gs://...), read and written through pyarrow.fs
either way: joining and resolving locations, whole-file reads and atomic writes, folders listed, copied and
removed. What the files of a run are called is orchestrator/storage/layout.py's; this module only moves bytes.

An s3:// location goes through the one S3 filesystem of orchestrator/storage/object_store.py (its endpoint, region
and credentials from the standard AWS settings); Ray Train gets the same filesystem (`ray_storage`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow.fs

from orchestrator.storage.object_store import is_s3, s3_filesystem


def is_remote(location: str) -> bool:
    """A URI (s3://, gs://, ...) rather than a path on this machine."""
    return "://" in location


STORAGE_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs", "file")
"""URI schemes pyarrow.fs.FileSystem.from_uri knows (storage_fs); any other is refused by the preflight."""


def storage_scheme_problem(location: str) -> str | None:
    """Why a storage URI's scheme is not one pyarrow's file systems know (with the accepted ones), or None; a local
    path has none. Nothing is contacted."""
    if not is_remote(location):
        return None
    scheme = location.split("://", 1)[0].lower()
    if scheme in STORAGE_SCHEMES:
        return None
    return (f"the scheme {scheme!r} is not one pyarrow's file systems know; use one of "
            f"{', '.join(s + '://' for s in STORAGE_SCHEMES)} (e.g. s3://<bucket>/runs), or a local path")


def resolve(location: str) -> str:
    """A URI as is, a local path made absolute (`~` expanded): what a launcher stores and compares."""
    return location if is_remote(location) else str(Path(location).expanduser().resolve())


def join(location: str, *parts: str) -> str:
    """A path under a storage location, for local paths and URIs (s3://bucket/runs) alike."""
    return "/".join([location.rstrip("/"), *parts])


def parent(location: str) -> str:
    """The folder holding `location` (a path or a URI)."""
    return location.rsplit("/", 1)[0] if is_remote(location) else str(Path(location).parent)


def storage_fs(location: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem and path of a storage location: a URI, or a local path (made absolute). s3:// goes to the
    configured S3 store (orchestrator/storage/object_store.py), whose paths are `bucket/key` as Ray's are."""
    if is_s3(location):
        return s3_filesystem(), location.removeprefix("s3://").rstrip("/")
    return pyarrow.fs.FileSystem.from_uri(location if is_remote(location) else str(Path(location).resolve()))


def ray_storage(location: str) -> tuple[str, pyarrow.fs.FileSystem | None]:
    """(storage_path, storage_filesystem) for Ray's RunConfig and Result.from_path: a local path as is, a URI as
    the path on its filesystem (Ray's convention when it is given the filesystem), so that Ray's uploads and
    reads go to the same store as the launcher's."""
    if not is_remote(location):
        return location, None
    fs, path = storage_fs(location)
    return path, fs


def uri_of(filesystem: pyarrow.fs.FileSystem | None, path: str) -> str:
    """The storage location of a path on a filesystem Ray returned (Result.path, Checkpoint.path): Ray's remote
    paths carry no scheme."""
    if filesystem is None or isinstance(filesystem, pyarrow.fs.LocalFileSystem) or "://" in path:
        return path
    return f"{filesystem.type_name}://{path}"


def read_text(location: str) -> str | None:
    """A file's text, or None when there is none."""
    fs, path = storage_fs(location)
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode()
    except FileNotFoundError:
        return None


def write_text(location: str, text: str) -> None:
    """Write a whole file, atomically: a local file through a temporary file and a rename, an object in one
    upload (a reader, or a kill, sees the old content or the new, never a part)."""
    if not is_remote(location):
        path = Path(location)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not leave a half-written temporary file behind
            raise
        return
    fs, path = storage_fs(location)
    with fs.open_output_stream(path) as f:
        f.write(text.encode())


def upload(local: Path, location: str) -> None:
    """Copy a local folder's content into the folder `location`, or a local file to the file `location`, on any
    storage (the folders above it made as needed)."""
    fs, path = storage_fs(location)
    fs.create_dir(path if local.is_dir() else path.rsplit("/", 1)[0], recursive=True)
    pyarrow.fs.copy_files(str(local), path, source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs)


def remove(location: str) -> None:
    """Delete a file if it exists."""
    fs, path = storage_fs(location)
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass


def remove_folder(location: str) -> bool:
    """Delete a folder and what it holds, if it exists; False when it could not be deleted (best effort: called
    on the way out of a failure, which it must not hide)."""
    fs, path = storage_fs(location)
    try:
        fs.delete_dir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def subfolders(location: str) -> list[str]:
    """Names of the folders directly under `location` ([] when it does not exist)."""
    fs, path = storage_fs(location)
    return [info.base_name for info in fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
            if info.type == pyarrow.fs.FileType.Directory]


def files_under(location: str) -> list[tuple[str, int, int]]:
    """(path relative to `location`, size, mtime in ns) of every file below it, at any depth ([] without it)."""
    fs, path = storage_fs(location)
    selector = pyarrow.fs.FileSelector(path, allow_not_found=True, recursive=True)
    return sorted((info.path[len(path):].lstrip("/"), info.size or 0, info.mtime_ns or 0)
                  for info in fs.get_file_info(selector) if info.type == pyarrow.fs.FileType.File)


def read_json(location: str) -> Any:
    """The JSON document at `location`, or None when there is none (or only a cut-short one)."""
    text = read_text(location)
    try:
        return None if text is None else json.loads(text)
    except ValueError:
        return None


def write_json(location: str, document: Any) -> None:
    """Write a JSON document whole (`write_text`: a kill leaves the old document or the new one)."""
    write_text(location, json.dumps(document, indent=2))
