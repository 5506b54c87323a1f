"""Every error answer is ours: ``{"error": CODE, "detail": "a sentence", ...extra}``.

Domain errors (``server.http.errors``) carry their status and code; the framework's own errors
(no such route, wrong method, a malformed form) and request validation get theirs here.
Whatever else escapes a route is answered by ``server.http.request_id.RequestId`` through
``unexpected``: ``503 unavailable`` when the database cannot be reached (and only then, so
that clients retry only what a retry can fix), else ``500 internal``, a bug, logged with
its traceback under the request id that the answer names.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Mapping
from typing import Any

import asyncpg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException
from starlette.routing import Match, Mount
from starlette.types import Message, Receive, Scope, Send

from diloco.protocol.messages import ErrorCode
from server.http.errors import HubError, Internal, Unavailable
from server.http.inputs import error_message

log = logging.getLogger("diloco.server")

# the framework's statuses and the codes we answer them with; any other is "http_error"
HTTP_CODES = {
    400: ErrorCode.BAD_REQUEST,  # a body the framework could not parse (a broken multipart form)
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
}

# what says "the database cannot be reached" rather than "the database refused this"
_UNREACHABLE: tuple[type[BaseException], ...] = (
    ConnectionError,  # refused, reset, broken pipe
    TimeoutError,  # connecting timed out
    socket.gaierror,  # the database host's name does not resolve
    PoolTimeout,  # every pooled connection is busy: waiting longer is the cure
    asyncpg.PostgresConnectionError,  # SQLSTATE class 08: the connection failed or is gone
    asyncpg.CannotConnectNowError,  # the database is starting up or shutting down
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
)


class ErrorResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote hostile input (a
    lone surrogate from a JSON ``\\ud800``), and it must still render."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(
    status: int, code: str, detail: str, headers: Mapping[str, str] | None = None, /, **extra: Any
) -> Response:
    """The answer for an error; ``extra`` may hold any key (``status`` included)."""
    return ErrorResponse({"error": code, "detail": detail, **extra}, status, headers=headers)


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means the database cannot be reached, looking through SQLAlchemy's
    wrapper (``.orig``) and what it was raised from (``__cause__``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, _UNREACHABLE):
            return True
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return False


def unexpected(exc: BaseException, *, request_id: str, method: str, path: str) -> Response:
    """The answer to an exception no handler took, logged under the request id."""
    if unreachable(exc):
        log.warning("request %s: %s %r: database unreachable: %r", request_id, method, path, exc)
        err: HubError = Unavailable("the database is unreachable; retry with backoff")
    else:
        log.error("request %s: %s %r failed", request_id, method, path, exc_info=exc)
        err = Internal(
            "the server failed on this request; this is a bug, and the server log has its "
            f"details under request id {request_id}"
        )
    return error_response(err.status, err.code, err.detail, **err.extra)


async def _hub_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HubError)
    return error_response(exc.status, exc.code, exc.detail, exc.headers(), **exc.extra)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    parts = []
    for e in exc.errors():
        if e["type"] == "json_invalid":
            parts.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', '')}")
            continue
        loc = ".".join(str(p) for p in e["loc"] if p not in ("body", "query", "path"))
        msg = error_message(e)
        parts.append(f"{loc}: {msg}" if loc else msg)
    detail = "; ".join(parts) or "the request is invalid"
    return error_response(422, ErrorCode.INVALID_REQUEST, detail)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no such endpoint: {request.method} {request.url.path}; see /docs"
    headers = dict(exc.headers or {})
    if exc.status_code == 405 and detail == "Method Not Allowed":
        # the router names the methods of the first route on this path; there may be more
        headers["Allow"] = ", ".join(_methods_of(request)) or headers.get("Allow", "")
        detail = (
            f"{request.method} is not allowed on {request.url.path}; allowed: {headers['Allow']}"
        )
    code = HTTP_CODES.get(exc.status_code, ErrorCode.HTTP_ERROR)
    return error_response(exc.status_code, code, detail, headers)


def _methods_of(request: Request) -> list[str]:
    """The methods some route (not a mounted app) answers on this request's path."""
    allowed = []
    for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"):
        probe = {**request.scope, "method": method}
        routes = (r for r in request.app.router.routes if not isinstance(r, Mount))
        if any(route.matches(probe)[0] == Match.FULL for route in routes):
            allowed.append(method)
    return allowed


def install(app: FastAPI) -> None:
    app.add_exception_handler(HubError, _hub_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)


class AnswerInstead:
    """The answer of a middleware that raised ``error`` where the app reads its body
    (``server.http.body_timeout``, ``server.http.body_limit``): whatever the app then
    answers is replaced by the error's, with ``Connection: close``. Pass ``send`` to the
    app and set ``error`` before raising it."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.error: HubError | None = None
        self._scope, self._receive, self._send = scope, receive, send
        self._replaced = False

    async def send(self, message: Message) -> None:
        if self.error is None:
            await self._send(message)
        elif message["type"] == "http.response.start" and not self._replaced:
            self._replaced = True
            err = self.error
            answer = error_response(err.status, err.code, err.detail, {"Connection": "close"})
            await answer(self._scope, self._receive, self._send)
        # the replaced answer's own messages are dropped
