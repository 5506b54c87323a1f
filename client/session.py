"""One server, one token, one ``aiohttp.ClientSession``: the plumbing every call of
``client.api.ServerAPI`` shares (URLs, headers, timeouts, retries, JSON calls)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Self, TypeVar

import aiohttp

from client.credentials import normalize_server_url
from client.http import CHUNK, RetryPolicy, Timeouts, error_from, json_object, with_retries

API_PREFIX = "/api/v1"
T = TypeVar("T")


class ApiSession:
    """The session is opened on first use and closed by ``close`` (or ``async with``)."""

    def __init__(
        self,
        server_url: str,
        *,
        token: str | None = None,
        retry: RetryPolicy | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.server_url = normalize_server_url(server_url)
        self.token = token
        self.retry = retry or RetryPolicy()
        self.timeouts = timeouts or Timeouts()
        self._session: aiohttp.ClientSession | None = None
        t = self.timeouts
        self._call_timeout = aiohttp.ClientTimeout(total=t.call_s, sock_connect=t.connect_s)
        self._transfer_timeout = aiohttp.ClientTimeout(
            total=t.transfer_s, sock_connect=t.connect_s, sock_read=t.transfer_read_s
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, path: str) -> str:
        """An absolute URL for an API path (``/runs``) or a server path from a lease."""
        if path.startswith(("http://", "https://")):
            return path
        if not path.startswith(API_PREFIX):
            path = API_PREFIX + path
        return self.server_url + path

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers | dict(extra or {})

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(raise_for_status=False)
        return self._session

    async def _with_retries(
        self,
        what: str,
        attempt_once: Callable[[], Awaitable[T]],
        *,
        idempotent: bool = True,
        retry: RetryPolicy | None = None,
    ) -> T:
        return await with_retries(
            what,
            attempt_once,
            policy=retry or self.retry,
            server_url=self.server_url,
            idempotent=idempotent,
        )

    async def _json(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        idempotent: bool = True,
        retry: RetryPolicy | None = None,
    ) -> dict[str, Any]:
        url = self.url(path)

        async def once() -> dict[str, Any]:
            async with self._http().request(
                method, url, json=body, headers=self._headers(), timeout=self._call_timeout
            ) as resp:
                if resp.status >= 400:
                    raise await error_from(resp)
                if resp.status == 204:  # done, nothing to say (a DELETE)
                    return {}
                return await json_object(resp)

        return await self._with_retries(
            f"{method} {path}", once, idempotent=idempotent, retry=retry
        )

    async def _put_file(
        self, path: str, file: Path, what: str, on_bytes: Callable[[int], None] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """PUT a file's bytes to ``path``, streamed with its Content-Length; the status and
        the JSON answer. A retry after a cut sends the file again from its start."""
        url, size = self.url(path), file.stat().st_size

        async def body() -> AsyncIterator[bytes]:
            with open(file, "rb") as f:
                while block := f.read(CHUNK):
                    if on_bytes is not None:
                        on_bytes(len(block))
                    yield block

        async def once() -> tuple[int, dict[str, Any]]:
            headers = self._headers(
                {"Content-Length": str(size), "Content-Type": "application/octet-stream"}
            )
            async with self._http().put(
                url, data=body(), headers=headers, timeout=self._transfer_timeout
            ) as resp:
                if resp.status >= 400:
                    raise await error_from(resp)
                return resp.status, await json_object(resp)

        return await self._with_retries(what, once)
