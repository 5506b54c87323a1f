"""Direct transfers on a live server whose blobs live in a real S3 API server (SeaweedFS):
the lease's signed URLs, the upload PUT to the bucket and its commit, every refusal of a
stored body (and the nothing it leaves behind), and blob routes answering 307."""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from client.api import DOWNLOAD_URL_REFUSED, UPLOAD_TARGET_REFUSED, ApiError, ServerAPI
from diloco.protocol.messages import UploadTarget
from server.settings import Settings
from server.storage.base import LocalStorage
from server.storage.files import read_url
from server.storage.s3 import S3Storage
from tests.conftest import server_run_config
from tests.support.contribute import API, auth, create_run, register, train
from tests.support.live import ServerProcess
from tests.support.pg import fresh_database


class Hub:
    def __init__(self, proc: ServerProcess, s3: Any, bucket: str, prefix: str) -> None:
        self.proc, self.s3, self.bucket, self.prefix = proc, s3, bucket, prefix

    def keys(self, run_id: str) -> list[str]:
        full = f"{self.prefix}/runs/{run_id}/"
        listed = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=full).get("Contents", [])
        return sorted(o["Key"].removeprefix(full) for o in listed)

    def read(self, run_id: str, key: str) -> bytes:
        got = self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/runs/{run_id}/{key}")
        return bytes(got["Body"].read())


@pytest.fixture(scope="module")
def hub(s3_server, pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:  # type: ignore[no-untyped-def]
    prefix = f"direct-{secrets.token_hex(4)}"
    with pytest.MonkeyPatch.context() as env, fresh_database(pg_admin_url) as url:
        for name, value in s3_server.env().items():
            env.setenv(name, value)
        proc = ServerProcess(
            data_dir=tmp_path_factory.mktemp("direct"),
            database_url=url,
            storage=f"s3://{s3_server.bucket}/{prefix}",
            scratch_dir=tmp_path_factory.mktemp("scratch"),  # not the system's temp dir
        )
        try:
            yield Hub(proc.wait_ready(), s3_server.client(), s3_server.bucket, prefix)
        finally:
            proc.stop()


@pytest.fixture
def http(hub: Hub) -> Iterator[httpx.Client]:
    with hub.proc.client() as client:
        yield client


def _run(http: httpx.Client) -> str:
    # two uploads needed: the round stays open while a test uploads again
    return str(create_run(http, server_run_config(rounds={"quorum": 2, "target": 2}))["id"])


def _commit(http: httpx.Client, token: str, lease: dict) -> httpx.Response:
    return http.post(lease["upload"]["commit_url"], headers=auth(token))


def _contributions(http: httpx.Client, run_id: str) -> dict:
    return dict(http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json())


def test_a_direct_upload_is_accepted_at_its_commit_and_cannot_be_replaced_after(
    hub: Hub, http: httpx.Client
) -> None:
    run_id, token = _run(http), register(http, "direct-1")
    work = train(http, token, run_id, steps=2)  # downloads through the lease's signed URLs
    lease, body = work.lease, work.body()
    assert lease["checkpoint"]["url"].startswith(hub.s3.meta.endpoint_url)
    assert lease["shard"]["url"].startswith(hub.s3.meta.endpoint_url)
    target = lease["upload"]
    assert target["method"] == "PUT" and "/incoming/1/" in target["url"]

    # the PUT puts bytes in the bucket and accepts nothing
    assert httpx.put(target["url"], content=body).status_code == 200
    assert _contributions(http, run_id)["contributions"] == []
    # the commit checks the stored body, moves it where volunteers cannot write, accepts it
    r = _commit(http, token, lease)
    assert r.status_code == 201, r.text
    receipt = r.json()
    assert receipt["sha256"] == hashlib.sha256(body).hexdigest()
    keys = hub.keys(run_id)
    accepted = [k for k in keys if k.startswith("rounds/1/")]
    assert len(accepted) == 1 and not [k for k in keys if k.startswith("incoming/")]
    assert hub.read(run_id, accepted[0]) == body
    listed = _contributions(http, run_id)["contributions"]
    assert [c["id"] for c in listed] == [receipt["contribution_id"]]

    # the upload URL still works until it expires: another body through it changes nothing
    other = work.body(loss=1.0)
    assert httpx.put(target["url"], content=other).status_code == 200
    r = _commit(http, token, lease)
    assert r.status_code == 409 and r.json()["error"] == "duplicate_contribution", r.text
    assert hub.read(run_id, accepted[0]) == body
    # the very same body again is an idempotent retry
    assert httpx.put(target["url"], content=body).status_code == 200
    r = _commit(http, token, lease)
    assert r.status_code == 200 and r.json() == receipt
    assert not [k for k in hub.keys(run_id) if k.startswith("incoming/")]


def test_a_commit_with_nothing_put_is_404(hub: Hub, http: httpx.Client) -> None:
    run_id, token = _run(http), register(http, "direct-2")
    lease = http.post(f"{API}/runs/{run_id}/join", headers=auth(token)).json()
    r = _commit(http, token, lease)
    assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
    assert "PUT the body" in r.json()["detail"]
    assert not [k for k in hub.keys(run_id) if k.startswith(("rounds/", "incoming/"))]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"not a contribution at all", 400, "malformed_upload"),
        (None, 413, "upload_too_large"),  # one byte over the lease's limit
    ],
)
def test_a_refused_stored_body_is_deleted_and_leaves_no_contribution(
    hub: Hub, http: httpx.Client, body: bytes | None, status: int, code: str
) -> None:
    run_id, token = _run(http), register(http, f"direct-{code}")
    lease = http.post(f"{API}/runs/{run_id}/join", headers=auth(token)).json()
    if body is None:
        body = b"\0" * (lease["max_upload_bytes"] + 1)
    assert httpx.put(lease["upload"]["url"], content=body).status_code == 200
    r = _commit(http, token, lease)
    assert r.status_code == status and r.json()["error"] == code, r.text
    assert not [k for k in hub.keys(run_id) if k.startswith(("rounds/", "incoming/"))]
    seen = _contributions(http, run_id)
    assert seen["contributions"] == []
    assert [x["error"] for x in seen["rejections"]] == [code]


def test_a_commit_needs_the_contributor_token(hub: Hub, http: httpx.Client) -> None:
    run_id = _run(http)
    r = http.post(f"{API}/runs/{run_id}/rounds/1/contribution/commit")
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"


def test_blob_routes_redirect_to_the_bucket_and_serve_no_byte(hub: Hub, http: httpx.Client) -> None:
    run_id = _run(http)
    run = http.get(f"{API}/runs/{run_id}").json()
    for path in ("checkpoints/0", "checkpoints/latest", "shards/0"):
        r = http.get(f"{API}/runs/{run_id}/{path}")
        assert r.status_code == 307, (path, r.text)
        assert r.headers["location"].startswith(hub.s3.meta.endpoint_url)
        assert r.headers["etag"].startswith('"')
        got = httpx.get(r.headers["location"])
        assert got.status_code == 200
        assert f'"{hashlib.sha256(got.content).hexdigest()}"' == r.headers["etag"]
    assert run["checkpoint_version"] == 0
    metrics = http.get("/metrics").text
    for kind in ("checkpoint", "delta", "shard"):
        served = re.search(rf'^diloco_served_bytes_total\{{kind="{kind}"\}} (\S+)$', metrics, re.M)
        assert served is not None and float(served.group(1)) == 0.0
    redirects = re.search(r'^diloco_redirects_total\{kind="checkpoint"\} (\S+)$', metrics, re.M)
    assert redirects is not None and float(redirects.group(1)) >= 2


def test_a_commit_to_a_server_on_local_disk_is_404(server, http_local: httpx.Client) -> None:  # type: ignore[no-untyped-def]
    run_id, token = _run(http_local), register(http_local, "local-1")
    lease = http_local.post(f"{API}/runs/{run_id}/join", headers=auth(token)).json()
    assert lease["upload"] is None
    assert lease["checkpoint"]["url"] == f"{API}/runs/{run_id}/checkpoints/0"
    r = http_local.post(f"{API}/runs/{run_id}/rounds/1/contribution/commit", headers=auth(token))
    assert r.status_code == 404 and "through the server" in r.json()["detail"]


@pytest.fixture
def http_local(server) -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    with server.client() as client:
        yield client


def test_read_urls_are_server_paths_signed_gets_or_the_cdn(
    s3_env: dict[str, str], s3_server, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    key = "runs/r1/checkpoints/3.safetensors"
    path = "/api/v1/runs/r1/checkpoints/3"
    local = LocalStorage(tmp_path / "blobs")
    assert read_url(Settings(), local, key, path) == path
    s3 = S3Storage(s3_server.bucket, f"p{secrets.token_hex(4)}")
    signed = read_url(Settings(signed_url_ttl_s=120), s3, key, path)
    assert signed.startswith(f"{s3_server.endpoint}/{s3_server.bucket}/{s3.prefix}{key}?")
    assert "X-Amz-Expires=120" in signed
    # every volunteer reading the blob gets the same URL while half its life is left
    assert read_url(Settings(signed_url_ttl_s=120), s3, key, path) == signed
    other = read_url(Settings(signed_url_ttl_s=120), s3, "runs/r1/shards/0.bin", path)
    assert other != signed and "/runs/r1/shards/0.bin?" in other
    cdn = Settings(public_read_url="https://cdn.example.org/hub/")
    assert read_url(cdn, s3, key, path) == f"https://cdn.example.org/hub/{key}"


def test_an_expired_signed_url_is_a_refusal_the_volunteer_recovers_from(
    s3_env: dict[str, str], s3_server, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The client turns the store's 403 into codes its loop answers by joining again (fresh
    URLs), never into the fatal 401/403 of the hub itself."""
    s3 = S3Storage(s3_server.bucket, f"expired-{secrets.token_hex(4)}")
    with s3.writer("runs/r1/checkpoints/0.safetensors") as w:
        w.write(b"params")
        w.commit()
    get = s3.signed_url("runs/r1/checkpoints/0.safetensors", "GET", 1)
    put = s3.signed_url("runs/r1/incoming/1/c.bin", "PUT", 1)
    time.sleep(2.5)
    target = UploadTarget(
        url=put,
        expires_at=datetime.now(UTC),
        commit_url="/api/v1/runs/r1/rounds/1/contribution/commit",
    )

    async def attempt() -> tuple[ApiError, ApiError]:
        async with ServerAPI("http://127.0.0.1:9", token="ctr_secret") as api:
            with pytest.raises(ApiError) as download:
                await api.download(
                    get, tmp_path / "ck.safetensors", hashlib.sha256(b"params").hexdigest()
                )
            with pytest.raises(ApiError) as upload:
                await api.upload("r1", 1, lambda: [b"body"], 4, target)
        return download.value, upload.value

    download, upload = asyncio.run(attempt())
    assert download.code == DOWNLOAD_URL_REFUSED and download.status == 409
    assert upload.code == UPLOAD_TARGET_REFUSED and upload.status == 409
    assert not s3.exists("runs/r1/incoming/1/c.bin")
