"""A request id on every request, in the log and in the answer's ``X-Request-ID`` header.

A caller (or a proxy in front of us) may send its own ``X-Request-ID``; a sane one (1 to 64
of ``A-Z a-z 0-9 . _ : -``) is kept so that logs on both sides line up, anything else is
replaced by a fresh one. Routes read it as ``request.state.request_id``.

An exception that escapes the app before its answer started is answered here
(``server.http.handlers.unexpected``: 503 when the database is unreachable, else 500 naming the
request id); a client that leaves in the middle of sending its body is only logged, at
info (it is not the server's failure, and no one is left to answer). Once an answer has
started (a streamed download failing halfway) there is nothing left to say but to log it
and cut the connection. A pure ASGI middleware: response bodies pass through untouched,
streamed or not.
"""

from __future__ import annotations

import logging
import re
import secrets

from starlette.datastructures import MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.handlers import unexpected

log = logging.getLogger("diloco.server")

HEADER = "X-Request-ID"
_SANE = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def new_request_id() -> str:
    return f"req_{secrets.token_hex(8)}"


def incoming_or_new(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _SANE.fullmatch(text) else new_request_id()
    return new_request_id()


def _what(scope: Scope) -> tuple[str, str]:
    return scope["method"], scope["path"]


class RequestId:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = incoming_or_new(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:  # the client left while sending its body: no one to answer
            log.info("request %s: %s %r: the client went away", request_id, *_what(scope))
        except Exception as exc:
            method, path = scope["method"], scope["path"]
            if started:
                log.error("request %s: %s %r failed mid-answer", request_id, method, path)
                raise
            answer = unexpected(exc, request_id=request_id, method=method, path=path)
            await answer(scope, receive, send_with_id)
