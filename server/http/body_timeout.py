"""A request body that stops arriving is dropped: ``408 request_timeout``, connection closed.

uvicorn waits for a body's next bytes forever, so 1,000 uploads that sent their headers
and 100 bytes held 2 file descriptors and a temp blob each for as long as their senders
liked. Here every wait of the app for body bytes (ASGI ``receive``) is bounded by
``body_idle_timeout_s``: a body may be slow, but it must keep moving. When a wait runs out,
``RequestTimeout`` is raised inside the app, where the reader was: the upload's temp blob
is removed on its way out (``server.rounds.ingest``: the ``BlobWriter`` aborts), the run
upload's temp file too. Whatever the app then answers is replaced by the 408 (FastAPI turns
an error while parsing a JSON body into a 400), with ``Connection: close`` so that uvicorn
closes the connection after it. Only the time the app waits for the client's body counts:
while the app itself is busy, nothing is read, and no deadline runs; once the body is all
in, a ``receive`` only waits for the client to leave (a streamed download listens for
that for as long as it lasts) and is not bounded.

The unread rest of a body answered before it was read (an upload refused at once) is the
connection's business: ``server.http.connection`` gives it ``header_timeout_s``.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.errors import RequestTimeout
from server.http.handlers import AnswerInstead


class BodyTimeout:
    def __init__(self, app: ASGIApp, *, idle_timeout_s: float) -> None:
        self.app = app
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        out = AnswerInstead(scope, receive, send)  # the app's answer, or the 408 instead
        body_done = False  # the last body message has arrived

        async def bounded_receive() -> Message:
            nonlocal body_done
            if body_done:  # now receive only waits for the client to leave (a streamed
                return await receive()  # answer listens for that): no deadline
            try:  # a deadline on this wait (no task per body piece, as wait_for made)
                async with asyncio.timeout(self.idle_timeout_s):
                    message = await receive()
            except TimeoutError:
                out.error = RequestTimeout(
                    f"the request body sent nothing for {self.idle_timeout_s:g} s; "
                    "it was dropped, send it again"
                )
                raise out.error from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, bounded_receive, out.send)
