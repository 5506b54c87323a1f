"""The server's REST API (``docs/api.md``) as typed async calls over one aiohttp session.

Every call has an explicit timeout: short for JSON calls, long (with a per-read timeout, so a
stalled transfer still fails) for checkpoint/shard downloads and contribution uploads.
Connection errors, timeouts and 5xx answers are retried with exponential backoff and jitter,
within a bounded number of attempts and a bounded total time; a 4xx is raised at once as an
:class:`ApiError` carrying the server's ``error`` code, but for 408 and 429, which the
server answers before acting (``client.http`` says when they are tried again).

Calls that are not idempotent (register, create a run, pause/resume/cancel, token rotation)
are retried only when the request cannot have taken effect: the connection could not be
opened, or the server answered 503 ``unavailable``, 408 or 429.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from client.audit_api import AuditAPI
from client.download import Fetched, fetch_once
from client.http import (
    CHUNK,
    ApiError,
    DownloadError,
    RetryPolicy,
    ServerUnreachable,
    Timeouts,
    backoff_delay,
    error_from,
    json_object,
)
from client.lease import Lease, ProtocolError, parse, parse_lease, require
from client.runs_api import RunsAPI
from diloco.protocol.messages import CatchUpPlan, HeartbeatIn, Receipt, UploadTarget
from diloco.protocol.volunteer import DOWNLOAD_URL_REFUSED, UPLOAD_TARGET_REFUSED

__all__ = [
    "DOWNLOAD_URL_REFUSED",
    "UPLOAD_TARGET_REFUSED",
    "ApiError",
    "DownloadError",
    "Fetched",
    "Lease",
    "ProtocolError",
    "RetryPolicy",
    "ServerAPI",
    "ServerUnreachable",
    "Timeouts",
    "UploadReceipt",
    "backoff_delay",
]


@dataclass(frozen=True)
class UploadReceipt:
    receipt: Receipt
    repeated: bool  # 200: the server already held this very body (an idempotent retry)


class ServerAPI(RunsAPI, AuditAPI):
    """The server's API, call by call (the plumbing is ``client.session.ApiSession``)."""

    # ---------------------------------------------------------------- contributors

    async def register(self, name: str) -> tuple[str, str]:
        """Create a contributor; returns ``(id, token)``. The token is shown only once."""
        data = await self._json("POST", "/contributors", body={"name": name}, idempotent=False)
        where = "the registration answer"
        return require(data, "id", str, where), require(data, "token", str, where)

    async def rotate_token(self) -> str:
        """A new token for this contributor; the current one stops working at once. Not
        retried once sent: a lost answer leaves only the new token, which we never saw."""
        data = await self._json("POST", "/contributors/me/token", idempotent=False)
        return require(data, "token", str, "the token rotation answer")

    async def me(self) -> dict[str, Any]:
        """``{"id", "name", "created_at"}`` for this token; 401 if the server does not know it."""
        return await self._json("GET", "/contributors/me")

    # ---------------------------------------------------------------- a volunteer's round

    async def join(self, run_id: str, tokens_per_s: float | None = None) -> Lease:
        """A lease on the open round; ``tokens_per_s`` (our measured training speed) lets
        the server size its ``inner_steps`` to finish before the deadline."""
        body = None if tokens_per_s is None else {"tokens_per_s": tokens_per_s}
        return parse_lease(await self._json("POST", f"/runs/{run_id}/join", body=body))

    async def heartbeat(
        self,
        run_id: str,
        round: int,
        lease_id: str,
        step: int | None = None,
        loss: float | None = None,
        *,
        retry: RetryPolicy | None = None,
    ) -> dict[str, Any]:
        """Keep the lease alive; 409 ``round_closed`` or ``no_lease`` means stop and join
        again (``diloco.protocol.volunteer``). A loss that is not finite is not sent."""
        if loss is not None and not math.isfinite(loss):
            loss = None
        beat = HeartbeatIn(lease_id=lease_id, step=step, loss=loss)
        body = beat.model_dump(mode="json", exclude_none=True)
        path = f"/runs/{run_id}/rounds/{round}/heartbeat"
        return await self._json("POST", path, body=body, retry=retry)

    async def upload(
        self,
        run_id: str,
        round: int,
        chunks_factory: Callable[[], Iterable[bytes]],
        nbytes: int,
        target: UploadTarget | None = None,
    ) -> UploadReceipt:
        """PUT a contribution body, streamed chunk by chunk; ``chunks_factory`` makes a fresh
        iterator for every try, so a retry re-sends the same bytes (the server is idempotent).
        With the lease's ``target`` (object storage) the body goes straight to the bucket and
        the server is asked to commit it; each try does both."""
        if target is not None:
            return await self._upload_direct(round, chunks_factory, nbytes, target)
        url = self.url(f"/runs/{run_id}/rounds/{round}/contribution")
        headers = self._headers(
            {"Content-Type": "application/octet-stream", "Content-Length": str(nbytes)}
        )

        async def once() -> UploadReceipt:
            async with self._http().put(
                url, data=_paced(chunks_factory), headers=headers, timeout=self._transfer_timeout
            ) as resp:
                return await _receipt(resp, "the upload answer")

        return await self._with_retries(f"upload of round {round}", once)

    async def _upload_direct(
        self,
        round: int,
        chunks_factory: Callable[[], Iterable[bytes]],
        nbytes: int,
        target: UploadTarget,
    ) -> UploadReceipt:
        """PUT to the signed URL (no token: the signature is the permission), then commit."""
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(nbytes)}

        async def once() -> UploadReceipt:
            async with self._http().put(
                target.url,
                data=_paced(chunks_factory),
                headers=headers,
                timeout=self._transfer_timeout,
            ) as resp:
                if resp.status >= 500:
                    raise await error_from(resp)  # the store's trouble: tried again
                if resp.status >= 400:  # expired or refused: a new lease brings a new URL
                    text = (await resp.text(errors="replace"))[:300]
                    raise ApiError(
                        409,
                        UPLOAD_TARGET_REFUSED,
                        f"the object store refused the upload ({resp.status}): {text}",
                        {},
                    )
            async with self._http().post(
                self.url(target.commit_url), headers=self._headers(), timeout=self._transfer_timeout
            ) as resp:
                return await _receipt(resp, "the commit answer")

        return await self._with_retries(f"direct upload of round {round}", once)

    async def download(self, url: str, dest: Path, expected_sha256: str) -> Fetched:
        """GET ``url`` into ``dest``, verified against ``expected_sha256``; an interrupted
        attempt is resumed with a Range request (``client.download``), also after a restart.
        A URL off this server (an object store's signed URL, a CDN) gets no token."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        full = self.url(url)
        ours = full.startswith(self.server_url + "/")
        headers = self._headers({"Accept": "*/*"}) if ours else {"Accept": "*/*"}

        async def once() -> Fetched:
            try:
                return await fetch_once(
                    self._http(),
                    full,
                    dest,
                    expected_sha256,
                    headers=headers,
                    timeout=self._transfer_timeout,
                    if_range=ours,
                )
            except ApiError as err:
                if ours or err.status not in (401, 403):
                    raise
                raise ApiError(
                    409,
                    DOWNLOAD_URL_REFUSED,
                    f"the object store refused {url.split('?')[0]} ({err.status}); join again "
                    "for fresh URLs",
                    {},
                ) from err

        return await self._with_retries(f"download of {url}", once)

    async def catch_up_plan(self, run_id: str, version: int, have: int) -> CatchUpPlan:
        """How to get checkpoint ``version`` holding ``have``: its deltas, or the full file."""
        path = f"/runs/{run_id}/checkpoints/{version}/catch-up?from={have}"
        return parse(CatchUpPlan, await self._json("GET", path), "the catch-up plan")

    async def release(self, run_id: str, round: int) -> None:
        """Give back this contributor's lease on ``round`` (we are leaving): the round need
        not wait for it. 409 ``no_lease`` means there was nothing to give back."""
        url = self.url(f"/runs/{run_id}/rounds/{round}/lease")

        async def once() -> None:
            async with self._http().delete(
                url, headers=self._headers(), timeout=self._call_timeout
            ) as resp:
                if resp.status >= 400:
                    raise await error_from(resp)

        quick = RetryPolicy(attempts=2, base_delay_s=0.5, max_delay_s=1.0, total_s=5.0)
        await self._with_retries(f"release of round {round}", once, retry=quick)

    async def update_me(self, hardware: Mapping[str, Any]) -> dict[str, Any]:
        """Report this machine's hardware summary on the contributor's profile."""
        return await self._json("PATCH", "/contributors/me", body={"hardware": dict(hardware)})

    async def healthz(self) -> dict[str, Any]:
        return await self._json("GET", self.server_url + "/healthz")

    async def speedtest_download(self, nbytes: int) -> tuple[int, float]:
        """Fetch ``nbytes`` from the server's speed test; ``(bytes received, seconds)``."""
        url = self.url(f"/speedtest?bytes={nbytes}")

        async def once() -> tuple[int, float]:
            started, got = time.perf_counter(), 0
            async with self._http().get(
                url, headers=self._headers({"Accept": "*/*"}), timeout=self._transfer_timeout
            ) as resp:
                if resp.status >= 400:
                    raise await error_from(resp)
                async for chunk in resp.content.iter_chunked(CHUNK):
                    got += len(chunk)
            return got, time.perf_counter() - started

        return await self._with_retries("download speed test", once)

    async def speedtest_upload(self, nbytes: int) -> tuple[int, float]:
        """Send ``nbytes`` to the server's speed test; ``(bytes it received, seconds)``."""
        url = self.url("/speedtest")
        block = os.urandom(min(CHUNK, nbytes))
        headers = self._headers(
            {"Content-Type": "application/octet-stream", "Content-Length": str(nbytes)}
        )

        async def body() -> AsyncIterator[bytes]:
            left = nbytes
            while left > 0:
                yield block[: min(left, len(block))]
                left -= min(left, len(block))

        async def once() -> tuple[int, float]:
            started = time.perf_counter()
            async with self._http().post(
                url, data=body(), headers=headers, timeout=self._transfer_timeout
            ) as resp:
                if resp.status >= 400:
                    raise await error_from(resp)
                data = await json_object(resp)
            return require(data, "bytes", int, "the speed test answer"), (
                time.perf_counter() - started
            )

        return await self._with_retries("upload speed test", once)


async def _paced(chunks_factory: Callable[[], Iterable[bytes]]) -> AsyncIterator[bytes]:
    """An upload body from a fresh iterator, letting heartbeats through between chunks."""
    for chunk in chunks_factory():
        yield chunk
        await asyncio.sleep(0)


async def _receipt(resp: aiohttp.ClientResponse, what: str) -> UploadReceipt:
    """An upload's (or a commit's) answer: 201 accepted, 200 an identical retry."""
    if resp.status >= 400:
        raise await error_from(resp)
    return UploadReceipt(parse(Receipt, await json_object(resp), what), resp.status == 200)
