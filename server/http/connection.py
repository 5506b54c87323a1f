"""What one connection may cost before its request is read: a deadline and a size for the
request line and headers.

uvicorn has neither for a request's head: its keep-alive timeout only runs between
requests, and httptools buffers a header of any size (one 96 MiB header held the event
loop for 12 s). ``GuardedHttpTools`` is uvicorn's httptools protocol with two guards:

- **size**: the bytes of a request's head (request line and headers, up to the blank line)
  are counted as they arrive, before the parser sees them; past ``max_header_bytes`` the
  answer is ``431 header_too_large`` and the connection is closed. A head pipelined behind
  another request is counted from the next read on (at most one read, 256 KiB, uncounted).
- **time**: a head must be complete ``header_timeout_s`` after the connection opens, or
  after the previous answer on it ends; else the connection is closed, with ``408
  request_timeout`` when part of a head had come (a client that opened a connection and
  went quiet, or drips a header a byte at a time, holds a file descriptor for that long at
  most; an idle keep-alive connection is closed silently, as uvicorn's keep-alive does).
  The unread rest of a body that was answered before it was read (an upload refused at
  once: 401, 409, 429) has the same deadline: uvicorn would read and drop it for ever.

A refusal here closes gently: the answer, then our end of the connection (FIN), then
whatever the client still sends is dropped for ``LINGER_S`` at most; closing at once with
its bytes unread would send a reset, and the client might never read the answer.

Bodies have their own deadline (``server.http.body_timeout``), in the app, where the upload's
temp blob is cleaned up. ``diloco serve`` always uses this protocol (``server.main``).
"""

from __future__ import annotations

import asyncio
import http
import json
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from server.http.errors import HeaderTooLarge, HubError, RequestTimeout

_END = b"\r\n\r\n"  # the blank line that ends a request's head
LINGER_S = 2.0  # after a refusal, how long the client's further bytes are read and dropped


def error_bytes(err: HubError) -> bytes:
    """A whole HTTP/1.1 answer for ``err`` in our error body, closing the connection."""
    body = json.dumps(err.body(), ensure_ascii=True, separators=(",", ":")).encode("ascii")
    head = (
        f"HTTP/1.1 {err.status} {http.HTTPStatus(err.status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a size cap and a deadline on each request's head."""

    max_header_bytes = 64 << 10  # set from the settings by ``guarded``
    header_timeout_s = 10.0

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._in_head = True  # the next bytes are a request's head
        self._in_body = False  # a request's body is arriving
        self._head_bytes = 0  # of the head so far
        self._tail = b""  # the last 3 bytes of the head so far (a blank line may straddle)
        self._deadline: asyncio.TimerHandle | None = None
        self._lingering: asyncio.TimerHandle | None = None  # refused: closing

    # -- the deadline, and refusing

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._lingering is not None:
            return
        if self._in_head and self._head_bytes:
            self._refuse(
                RequestTimeout(
                    f"the request line and headers did not arrive within "
                    f"{self.header_timeout_s:g} s"
                )
            )
        else:  # idle, or the rest of a body already answered: nothing to say
            self.transport.close()

    def _refuse(self, err: HubError) -> None:
        """Answer ``err`` (unless an answer is under way on this connection), then close:
        after our FIN, what the client still sends is read and dropped for LINGER_S at
        most, so that it reads our answer rather than a reset."""
        self._disarm()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.transport.write(error_bytes(err))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        # the client's EOF closes the connection sooner (uvicorn's eof_received)
        self._lingering = self.loop.call_later(LINGER_S, self.transport.close)

    # -- uvicorn's protocol, with the guards

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return  # refused: dropped unread
        if self._in_head and not self._count_head(data):
            return
        super().data_received(data)

    def _count_head(self, data: bytes) -> bool:
        """Count ``data``'s part of the head; False (and refused) when it is too long."""
        end = (self._tail + data).find(_END)
        counted = len(data) if end < 0 else end + len(_END) - len(self._tail)
        self._head_bytes += counted
        self._tail = (self._tail + data)[-(len(_END) - 1) :]
        if self._head_bytes > self.max_header_bytes:
            self._refuse(
                HeaderTooLarge(
                    f"the request line and headers are over {self.max_header_bytes} bytes"
                )
            )
            return False
        return True

    def on_headers_complete(self) -> None:
        self._in_head, self._in_body = False, True
        self._disarm()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        """A body piece the app has not asked for yet is kept as httptools made it: uvicorn
        would copy it into a bytearray, and its ``receive`` copy that into new bytes (for
        an upload, two copies of every byte on the event loop). Its ``receive`` hands out
        ``bytes(cycle.body)``, which for bytes is the object itself; a second piece before
        the app asked (rare: reading pauses past 64 KiB) takes uvicorn's way."""
        cycle = self.cycle
        if cycle.body or cycle.response_complete or self.parser.should_upgrade():
            if isinstance(cycle.body, bytes):
                cycle.body = bytearray(cycle.body)
            super().on_body(body)
            return
        cycle.body = body  # type: ignore[assignment]  # uvicorn's receive takes bytes too
        if len(body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        self._in_head, self._in_body = True, False  # the next bytes are the next request's
        self._head_bytes, self._tail = 0, b""
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self._in_head or self._in_body):
            # the next request's head, and the unread rest of a body answered before it
            # was read (an upload refused at once), have header_timeout_s from now
            self._arm()


def guarded(*, max_header_bytes: int, header_timeout_s: float) -> type[GuardedHttpTools]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``, with these limits."""
    return type(
        "GuardedHttpTools",
        (GuardedHttpTools,),
        {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s},
    )
