"""The heartbeat's fast lane: ``POST /api/v1/runs/{run_id}/rounds/{index}/heartbeat``
answered without the router and FastAPI's request handler.

Every volunteer sends a heartbeat every few seconds, and the router's search through the
routes and FastAPI's handling around the route (the content type, the body, the dependency
solving, the answer's validation) cost more of the server's CPU than the heartbeat's own
statement (docs/benchmarks.md, "Volunteer API under load"). So a well-formed heartbeat is
answered here, from the route's own parts: the path parameters through the route's types
(``RunId``, ``RoundIndex``), the body as FastAPI parses it (``json.loads``, then
``HeartbeatIn``), the token as ``bearer_token`` reads it, ``server.rounds.heartbeats``, a
refusal as the app's handler answers it (``error_response``) and the answer serialized as
FastAPI serializes it. Anything else goes on to the route unchanged, the body it read
replayed: a content type other than ``application/json``, a body that is empty, not JSON or
not a valid ``HeartbeatIn``, a path parameter out of bounds; so every error answer stays
the route's. The route stays the definition the API's schema shows.

Installed innermost of the middlewares (``server.app``): the body is read through the body
timeout and the 1 MiB limit, and the answer carries the request id and is counted under
the route's template.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from diloco.protocol.messages import HeartbeatIn
from server.auth import bearer_of
from server.http.errors import HubError
from server.http.handlers import error_response
from server.http.inputs import RoundIndex, RunId
from server.rounds import heartbeats

PATH = re.compile(r"/api/v1/runs/([^/]+)/rounds/([^/]+)/heartbeat")  # the route's template
_RUN_ID: TypeAdapter[str] = TypeAdapter(RunId)
_INDEX: TypeAdapter[int] = TypeAdapter(RoundIndex)


def heartbeat_route(router: Any) -> Any:
    """The heartbeat's route among ``router``'s (``server.rounds.router``)."""
    (route,) = (r for r in router.routes if getattr(r, "name", None) == "heartbeat")
    return route


class HeartbeatLane:
    def __init__(self, app: ASGIApp, *, route: Any) -> None:
        self.app = app
        self.route = route  # the heartbeat's APIRoute: the body limit and the metrics read it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].endswith("/heartbeat")
            or (path := PATH.fullmatch(scope["path"])) is None
        ):
            await self.app(scope, receive, send)
            return
        scope["route"] = self.route
        try:
            body = await _body(receive)
            beat = _parsed(scope, path, body)
            if beat is None:  # the route answers it, with the body we read
                await self.app(scope, _replay(body, receive), send)
                return
            answer = await _answer(scope, *beat)
        except HubError as err:  # the token, or a refusal; or the body's limits
            answer = error_response(err.status, err.code, err.detail, err.headers(), **err.extra)
        await answer(scope, receive, send)


def _headers(scope: Scope) -> tuple[bytes, bytes]:
    """(content-type, authorization) as sent; empty when absent."""
    content_type = authorization = b""
    for name, value in scope["headers"]:
        if name == b"content-type":
            content_type = value
        elif name == b"authorization":
            authorization = value
    return content_type, authorization


def _parsed(
    scope: Scope, path: re.Match[str], body: bytes
) -> tuple[str, int, HeartbeatIn, bytes] | None:
    """(run id, round index, body, authorization), or None where the route would answer
    otherwise than the heartbeat's service does (its validation errors)."""
    content_type, authorization = _headers(scope)
    if content_type.lower() != b"application/json" or not body:
        return None
    try:
        run_id = _RUN_ID.validate_python(path.group(1))
        index = _INDEX.validate_python(path.group(2))
        beat = HeartbeatIn.model_validate(json.loads(body))
    except (ValidationError, ValueError):  # JSONDecodeError and UnicodeDecodeError too
        return None
    return run_id, index, beat, authorization


async def _answer(
    scope: Scope, run_id: str, index: int, beat: HeartbeatIn, auth: bytes
) -> Response:
    out = await heartbeats.answer(
        scope["app"].state,
        token=bearer_of(auth.decode("latin-1")),
        run_id=run_id,
        index=index,
        beat=beat,
    )
    return Response(out.model_dump_json(by_alias=True), media_type="application/json")


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives the body already read once, then waits as ``receive`` does."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
