"""HTTP plumbing the API client shares: errors, retry policy with jittered backoff, timeouts,
and reading the server's JSON and error answers.

A 4xx is raised at once as an :class:`ApiError` carrying the server's ``error`` code,
except 408 (``request_timeout``: the request stalled and the server dropped it) and 429
(``rate_limited``, ``too_many_uploads``): the server refused those before acting, so they
are tried again even when the call is not idempotent; a 429 only when the server said
when (``Retry-After``) and that fits in the retry policy's total time, and never sooner.
Connection errors, timeouts and 5xx answers are retried with exponential backoff and
jitter (``backoff_delay``), within a bounded number of attempts and total time, and never
sooner than a 5xx's ``Retry-After`` says (``503 checkpoint_pending`` sends one).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from client.lease import ProtocolError

CHUNK = 1 << 20
T = TypeVar("T")


class ApiError(Exception):
    """The server answered with an error status; ``code`` is its ``error`` field."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        body: Mapping[str, Any],
        *,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"server refused ({status} {code}): {detail}")
        self.status, self.code, self.detail, self.body = status, code, detail, dict(body)
        self._retry_after_header = retry_after_s  # a Retry-After header in seconds, if any

    @property
    def retry_after_s(self) -> float | None:
        """When the server said to come back (its ``Retry-After`` header, else the body's
        ``retry_after_s``), if it did."""
        if self._retry_after_header is not None:
            return self._retry_after_header
        after = self.body.get("retry_after_s")
        if isinstance(after, bool) or not isinstance(after, int | float) or not after >= 0:
            return None
        return float(after)


# refused before the server acted on it, to be tried again later: the request stalled
# (408), too many requests from this address or uploads at once (429)
TRY_AGAIN = frozenset({408, 429})


class ServerUnreachable(Exception):
    """No answer from the server (connection refused, DNS, timeout), after every retry."""


class DownloadError(Exception):
    """A downloaded file does not match the sha256 the server announced."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6  # tries in all, the first included
    base_delay_s: float = 0.5  # delay before the second try
    max_delay_s: float = 30.0  # cap on one delay
    total_s: float = 300.0  # no new try starts after this long since the first
    jitter: float = 0.5  # each delay is shortened by up to this fraction, at random

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"retry attempts must be at least 1, got {self.attempts}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"retry jitter must be in [0, 1], got {self.jitter}")


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 10.0
    call_s: float = 30.0  # a whole JSON call
    transfer_s: float = 3600.0  # a whole upload or download
    transfer_read_s: float = 120.0  # silence allowed between two reads of a transfer


def backoff_delay(attempt: int, policy: RetryPolicy, rand: float) -> float:
    """Seconds to wait after failed try ``attempt`` (1-based): base · 2^(attempt−1), capped
    at ``max_delay_s``, then shortened by ``jitter · rand`` of itself (``rand`` in [0, 1))."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    if not 0.0 <= rand < 1.0:
        raise ValueError(f"rand must be in [0, 1), got {rand}")
    delay = min(policy.max_delay_s, policy.base_delay_s * 2.0 ** (attempt - 1))
    return delay * (1.0 - policy.jitter * rand)


class RetryableError(Exception):
    """One try failed in a way worth another try; ``cause`` is what to raise at the end."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


def retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` in seconds (the form the hub sends); None for a date or garbage."""
    if value is None or not (value.isascii() and value.strip().isdigit()):
        return None
    return float(value.strip())


async def error_from(resp: aiohttp.ClientResponse) -> ApiError:
    text = await resp.text(errors="replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        body = None
    wait = retry_after(resp.headers.get("Retry-After"))
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        detail = str(body.get("detail", ""))
        return ApiError(resp.status, body["error"], detail, body, retry_after_s=wait)
    snippet = " ".join(text.split())[:200] or "(empty body)"
    detail = f"{resp.method} {resp.url} answered {resp.status} {resp.reason}: {snippet}"
    return ApiError(resp.status, "http_error", detail, {}, retry_after_s=wait)


async def json_object(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        data = await resp.json(content_type=None)
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict):
        raise ProtocolError(
            f"{resp.method} {resp.url} did not answer a JSON object; is this a DiLoCo Hub server?"
        )
    return data


async def with_retries(
    what: str,
    attempt_once: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    server_url: str,
    idempotent: bool = True,
) -> T:
    """Run ``attempt_once`` until it succeeds, raises a non-retryable error, or the
    policy's attempts or total time run out."""
    started = time.monotonic()
    for attempt in range(1, policy.attempts + 1):
        asked = None  # how long the server asked us to wait
        try:
            return await attempt_once()
        except ApiError as err:
            if err.status in TRY_AGAIN:  # refused before acting: safe to send again
                asked = err.retry_after_s
                if err.status == 429 and (
                    asked is None or time.monotonic() - started + asked > policy.total_s
                ):
                    raise  # the server did not say when, or not within our budget
            elif not (err.status == 503 or (idempotent and err.status >= 500)):
                raise
            else:  # a 503 may say when (checkpoint_pending does)
                asked = err.retry_after_s
            last: Exception = err
        except RetryableError as err:
            last = err.cause
        except aiohttp.ClientConnectorError as err:  # never reached the server
            last = ServerUnreachable(f"cannot connect to {server_url} ({what}): {err}")
        except (aiohttp.ClientError, TimeoutError) as err:
            reason = str(err) or type(err).__name__
            last = ServerUnreachable(f"{what} on {server_url} failed: {reason}")
            if not idempotent:  # the server may have acted on it: do not repeat it blindly
                raise ServerUnreachable(
                    f"{last}; it may or may not have taken effect, check before repeating it"
                ) from err
        delay = backoff_delay(attempt, policy, random.random())
        if asked is not None:  # never sooner than the server asked
            delay = max(delay, asked)
        if attempt == policy.attempts or time.monotonic() - started + delay > policy.total_s:
            break
        await asyncio.sleep(delay)
    if isinstance(last, ServerUnreachable):
        raise ServerUnreachable(
            f"{last} (gave up after {attempt} tries in {time.monotonic() - started:.0f} s); "
            "check the URL and that the server is running"
        )
    raise last
