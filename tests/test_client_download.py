"""Checkpoint downloads that are cut halfway resume with a Range request and are verified.

A real `diloco serve` holds the checkpoint; between it and the client sits a small HTTP
proxy on 127.0.0.1 that forwards each request (Range and If-Range included), records what
it was asked and answered, and can end the body early by closing the connection, as a
flaky network does. The client is the real ``ServerAPI.download``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import pytest_asyncio

from client.api import ApiError, DownloadError, RetryPolicy, ServerAPI, ServerUnreachable
from client.download import part_path
from tests.conftest import server_run_config
from tests.support.contribute import API, auth, create_run, register

FAST = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05, total_s=30.0)
ONCE = RetryPolicy(attempts=1)
pytestmark = pytest.mark.asyncio


@dataclass
class Exchange:
    range: str | None
    if_range: str | None
    status: int
    body_bytes_sent: int


@dataclass
class CuttingProxy:
    """Forwards GETs to ``upstream``; the first ``cuts`` answers stop after ``cut_at``
    body bytes (the connection is closed), and ``corrupt`` flips a byte of every body."""

    upstream: str
    cut_at: int = 0
    cuts: int = 0
    corrupt: bool = False
    seen: list[Exchange] = field(default_factory=list)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            lines = head.decode("latin-1").split("\r\n")
            _, path, _ = lines[0].split(" ")
            headers = dict(line.split(": ", 1) for line in lines[1:] if line)
            forward = {k: v for k, v in headers.items() if k.lower() in ("range", "if-range")}
            async with (
                aiohttp.ClientSession() as session,
                session.get(self.upstream + path, headers=forward) as up,
            ):
                body = await up.read()
                status, reason = up.status, up.reason
                keep = ("Content-Type", "Content-Range", "ETag", "Accept-Ranges")
                out = {k: up.headers[k] for k in keep if k in up.headers}
            if self.corrupt and body:
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            sent = len(body)
            if self.cuts > 0:
                self.cuts -= 1
                sent = min(self.cut_at, len(body))
            self.seen.append(Exchange(headers.get("Range"), headers.get("If-Range"), status, sent))
            out |= {"Content-Length": str(len(body)), "Connection": "close"}
            writer.write(f"HTTP/1.1 {status} {reason}\r\n".encode())
            writer.write("".join(f"{k}: {v}\r\n" for k, v in out.items()).encode() + b"\r\n")
            writer.write(body[:sent])
            await writer.drain()
        finally:
            writer.close()  # after a cut: EOF before Content-Length bytes, as a dropped link


@pytest_asyncio.fixture
async def proxy(server) -> AsyncIterator[CuttingProxy]:  # type: ignore[no-untyped-def]
    cp = CuttingProxy(server.url)
    srv = await asyncio.start_server(cp.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    cp.url = f"http://127.0.0.1:{port}"
    try:
        yield cp
    finally:
        srv.close()
        await srv.wait_closed()


@pytest.fixture(scope="module")
def checkpoint(server) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """A run's checkpoint 0 as a lease announces it: url, sha256, nbytes."""
    config = server_run_config(model={"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32})
    with httpx.Client(base_url=server.url, timeout=60) as http:
        run = create_run(http, config)
        token = register(http, "downloader")
        lease = http.post(f"{API}/runs/{run['id']}/join", headers=auth(token))
        assert lease.status_code == 200, lease.text
        ck = lease.json()["checkpoint"]
        body = http.get(ck["url"]).content
    assert len(body) == ck["nbytes"] > 200_000 and hashlib.sha256(body).hexdigest() == ck["sha256"]
    return {**ck, "body": body}


async def test_a_cut_download_resumes_with_a_range_request_and_is_verified(
    proxy: CuttingProxy, checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    size, half = checkpoint["nbytes"], checkpoint["nbytes"] // 2
    proxy.cut_at, proxy.cuts = half, 1
    dest = tmp_path / "v0.safetensors"
    async with ServerAPI(proxy.url, retry=FAST) as api:
        fetched = await api.download(checkpoint["url"], dest, checkpoint["sha256"])
    assert [(e.range, e.status, e.body_bytes_sent) for e in proxy.seen] == [
        (None, 200, half),
        (f"bytes={half}-", 206, size - half),
    ]
    assert proxy.seen[1].if_range == f'"{checkpoint["sha256"]}"'
    assert (fetched.resumed_from, fetched.transferred, fetched.nbytes) == (half, size - half, size)
    assert dest.read_bytes() == checkpoint["body"]
    assert not part_path(dest).exists()


async def test_a_restarted_client_resumes_the_part_an_earlier_one_left(
    proxy: CuttingProxy, checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    size, cut = checkpoint["nbytes"], checkpoint["nbytes"] // 3
    proxy.cut_at, proxy.cuts = cut, 1
    dest = tmp_path / "v0.safetensors"
    async with ServerAPI(proxy.url, retry=ONCE) as api:  # gives up after the cut
        with pytest.raises(ServerUnreachable):
            await api.download(checkpoint["url"], dest, checkpoint["sha256"])
    assert not dest.exists()
    assert part_path(dest).read_bytes() == checkpoint["body"][:cut]
    async with ServerAPI(proxy.url, retry=ONCE) as api:  # a new process, the same cache
        fetched = await api.download(checkpoint["url"], dest, checkpoint["sha256"])
    assert [e.range for e in proxy.seen] == [None, f"bytes={cut}-"]
    assert proxy.seen[1].body_bytes_sent == size - cut
    assert fetched.resumed_from == cut
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == checkpoint["sha256"]


async def test_a_damaged_part_fails_the_sha256_check_and_the_retry_starts_over(
    proxy: CuttingProxy, checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    dest, cut = tmp_path / "v0.safetensors", 1000
    part_path(dest).write_bytes(b"\0" * cut)  # not the file's first bytes
    async with ServerAPI(proxy.url, retry=FAST) as api:
        fetched = await api.download(checkpoint["url"], dest, checkpoint["sha256"])
    assert [(e.range, e.status) for e in proxy.seen] == [(f"bytes={cut}-", 206), (None, 200)]
    assert fetched.resumed_from == 0
    assert dest.read_bytes() == checkpoint["body"]


async def test_a_body_that_never_matches_its_sha256_is_refused_and_nothing_is_kept(
    proxy: CuttingProxy, checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    proxy.corrupt = True
    dest = tmp_path / "v0.safetensors"
    async with ServerAPI(proxy.url, retry=FAST) as api:
        with pytest.raises(DownloadError, match="sha256"):
            await api.download(checkpoint["url"], dest, checkpoint["sha256"])
    assert len(proxy.seen) == FAST.attempts
    assert not dest.exists() and not part_path(dest).exists()


async def test_a_part_longer_than_the_file_is_dropped_and_fetched_whole(
    proxy: CuttingProxy, checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    dest = tmp_path / "v0.safetensors"
    part_path(dest).write_bytes(checkpoint["body"] + b"extra")
    async with ServerAPI(proxy.url, retry=FAST) as api:
        await api.download(checkpoint["url"], dest, checkpoint["sha256"])
    assert [(e.range, e.status) for e in proxy.seen][-1] == (None, 200)
    assert proxy.seen[0].status == 416
    assert dest.read_bytes() == checkpoint["body"]


async def test_a_missing_file_is_a_4xx_not_retried(
    proxy: CuttingProxy, checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    url = checkpoint["url"].rsplit("/", 1)[0] + "/999"
    async with ServerAPI(proxy.url, retry=FAST) as api:
        with pytest.raises(ApiError) as err:
            await api.download(url, tmp_path / "x", checkpoint["sha256"])
    assert err.value.status == 404 and len(proxy.seen) == 1
