"""Speed test for ``diloco doctor``: how fast can a volunteer download and upload here?

``GET`` streams N incompressible bytes (one random MiB, repeated: nothing of size N is
built in memory); ``POST`` reads a body and throws it away, answering how many bytes arrived
and how long reading them took on the server's side. No authentication: a volunteer checks
its link before it registers. Bodies are capped at ``MAX_BYTES`` both ways, and each
address may run it ``rate_speedtest`` times (``server.http.ratelimit``; both directions count).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from server.http import ratelimit
from server.http.errors import BodyTooLarge
from server.http.inputs import declared_length
from server.http.ratelimit import Action

MIB = 1 << 20
MAX_BYTES = 64 * MIB
DEFAULT_BYTES = 8 * MIB

router = APIRouter(prefix="/api/v1/speedtest", tags=["service"])


class SpeedtestResult(BaseModel):
    bytes: int  # body bytes received
    seconds: float  # reading the body took this long, measured on the server


@lru_cache(maxsize=1)
def _block() -> bytes:
    return os.urandom(MIB)  # random: a compressing proxy cannot shrink the test


async def _payload(nbytes: int) -> AsyncIterator[bytes]:
    block = _block()
    whole, rest = divmod(nbytes, len(block))
    for _ in range(whole):
        yield block
    if rest:
        yield block[:rest]


@router.get(
    "",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
    dependencies=ratelimit.depends(Action.SPEEDTEST),
)
async def download(
    nbytes: Annotated[int, Query(alias="bytes", ge=1, le=MAX_BYTES)] = DEFAULT_BYTES,
) -> StreamingResponse:
    """``bytes`` random-looking bytes as ``application/octet-stream`` (1 .. 64 MiB)."""
    return StreamingResponse(
        _payload(nbytes),
        media_type="application/octet-stream",
        headers={"Content-Length": str(nbytes), "Cache-Control": "no-store"},
    )


async def drain(stream: AsyncIterator[bytes], *, limit: int) -> int:
    """Read and drop a body; the number of bytes, or BodyTooLarge past ``limit``."""
    received = 0
    async for chunk in stream:
        received += len(chunk)
        if received > limit:
            raise BodyTooLarge(f"the speed test takes at most {limit} bytes")
    return received


@router.post("", dependencies=ratelimit.depends(Action.SPEEDTEST))
async def upload(request: Request) -> SpeedtestResult:
    """Read and discard the body (at most 64 MiB; with or without Content-Length)."""
    declared_length(request.headers.get("content-length"), limit=MAX_BYTES, what="the speed test")
    started = time.perf_counter()
    received = await drain(request.stream(), limit=MAX_BYTES)
    return SpeedtestResult(bytes=received, seconds=time.perf_counter() - started)
