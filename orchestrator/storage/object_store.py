"""Reaching an object store: the S3 filesystem every reader and writer of s3:// storage shares, the check that a
bucket answers before any trial starts, and the conditional writes the name lock stands on.

Where the store is comes from the standard AWS settings, so that pyarrow (checkpoints, the launcher's files),
boto3 (the lock) and MLflow (artifacts) all find the same store: the endpoint from AWS_ENDPOINT_URL_S3 (or
AWS_ENDPOINT_URL; a spec's run.storage_endpoint sets it, see `use_storage`), the region from AWS_REGION /
AWS_DEFAULT_REGION or the profile, and credentials only from the environment (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), AWS_PROFILE and ~/.aws/credentials, or the machine's IAM role.
Credentials are never spec fields, so they never reach MLflow params or tags, checkpoints or Ray's pickles
(a pyarrow S3FileSystem built without keys pickles without them: each process reads its own)."""

from __future__ import annotations

import functools
import os
import uuid
from typing import Any

import pyarrow.fs

ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""The AWS SDKs' endpoint variables, service-specific first (pyarrow's C++ SDK and boto3 read both)."""
REGION_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")
ATTEMPTS = 5
"""Attempts of one S3 request (AWS standard retries: exponential backoff): rides out a dropped connection or a
throttled burst; a store that stays down fails the request in seconds, and the run stops and says so."""
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 60.0


class StorageError(RuntimeError):
    """The object store cannot be used for this run; the message names the field and the fix."""


def is_s3(location: str) -> bool:
    return location.startswith("s3://")


def bucket_and_key(location: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b")."""
    bucket, _, key = location.removeprefix("s3://").partition("/")
    return bucket, key.strip("/")


def use_storage(endpoint: str | None, region: str | None) -> None:
    """Make a spec's run.storage_endpoint / run.storage_region this process's AWS settings, so that pyarrow,
    boto3 and MLflow's S3 client, which each read them from the environment, reach the same store; and the
    processes this one starts (a local Ray's raylet passes its environment to every worker) inherit them.
    Called where a spec enters a process: the launcher, each trial driver, each Train worker."""
    if endpoint:
        os.environ[ENDPOINT_VARS[0]] = endpoint
    if region:
        os.environ[REGION_VARS[0]] = region


def storage_env() -> dict[str, str]:
    """The endpoint and region variables set here (what a joined cluster's workers get in their runtime env;
    credentials stay with each node: its IAM role or its own environment)."""
    return {name: os.environ[name] for name in (*ENDPOINT_VARS, *REGION_VARS) if os.environ.get(name)}


def endpoint() -> str | None:
    return next((os.environ[name] for name in ENDPOINT_VARS if os.environ.get(name)), None)


def region() -> str | None:
    return next((os.environ[name] for name in REGION_VARS if os.environ.get(name)), None)


def s3_filesystem() -> pyarrow.fs.S3FileSystem:
    """The S3 filesystem of the current settings (one per endpoint and region in a process)."""
    return _s3(endpoint(), region())


@functools.lru_cache(maxsize=8)
def _s3(endpoint_url: str | None, region_name: str | None) -> pyarrow.fs.S3FileSystem:
    kwargs: dict[str, Any] = {}
    if endpoint_url:
        kwargs["endpoint_override"] = endpoint_url
        kwargs["scheme"] = "http" if endpoint_url.startswith("http://") else "https"
    if region_name:
        kwargs["region"] = region_name
    return pyarrow.fs.S3FileSystem(retry_strategy=pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=ATTEMPTS),
                                   connect_timeout=CONNECT_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S, **kwargs)


def s3_client() -> Any:
    """A boto3 S3 client of the current settings: the conditional writes pyarrow does not expose."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": ATTEMPTS, "mode": "standard"}, connect_timeout=CONNECT_TIMEOUT_S,
                    read_timeout=REQUEST_TIMEOUT_S)
    # A session of its own: boto3's default session keeps the credentials it first resolved.
    return boto3.session.Session().client("s3", endpoint_url=endpoint(), region_name=region(), config=config)


def error_code(err: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("PreconditionFailed", "NoSuchKey", ...), else ""."""
    response = getattr(err, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def check_s3_storage(location: str, field: str = "run.storage_path") -> None:
    """The bucket of `location` answers, takes a write, and honours conditional writes (If-None-Match, which the
    name lock stands on): a probe object is written twice and deleted. StorageError naming `field` and the fix."""
    bucket, key = bucket_and_key(location)
    probe = "/".join(filter(None, (key, f".orchestrator-probe-{uuid.uuid4().hex}")))
    where = f"{field}={location!r} (endpoint {endpoint() or 'AWS S3'})"
    client = s3_client()
    try:
        client.head_bucket(Bucket=bucket)  # some stores answer a write to a missing bucket with a bare 500
        client.put_object(Bucket=bucket, Key=probe, Body=b"probe", IfNoneMatch="*")
    except Exception as err:  # noqa: BLE001 - every failure becomes one message with the fix
        raise StorageError(f"{where} cannot be written: {_explain(err, bucket)}") from None
    try:
        client.put_object(Bucket=bucket, Key=probe, Body=b"again", IfNoneMatch="*")
    except Exception as err:  # noqa: BLE001
        if error_code(err) not in ("PreconditionFailed", "ConditionalRequestConflict"):
            raise StorageError(f"{where}: a conditional write failed: {_explain(err, bucket)}") from None
    else:
        raise StorageError(f"{where}: the store ignores conditional writes (If-None-Match), which the run's name "
                           "lock needs; use a store that honours them (AWS S3, MinIO, SeaweedFS, Cloudflare R2)")
    finally:
        try:
            client.delete_object(Bucket=bucket, Key=probe)
        except Exception:  # noqa: BLE001 - a leftover probe object is harmless
            pass


def _explain(err: BaseException, bucket: str) -> str:
    code = error_code(err)
    text = f"{type(err).__name__}: {str(err)[:200]}"
    if code in ("NoSuchBucket", "404"):
        return f"{text}; create the bucket {bucket!r} first, or fix the bucket name"
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403") or "credentials" in text:
        return (f"{text}; give credentials that may write to the bucket: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE, ~/.aws/credentials, an IAM role), never spec fields")
    return (f"{text}; check that the store runs and that run.storage_endpoint (or AWS_ENDPOINT_URL_S3) is its URL, "
            "e.g. http://<host>:9000 for MinIO, unset for AWS S3")
