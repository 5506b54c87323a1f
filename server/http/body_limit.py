"""A JSON body declared too large is refused before it is read: ``413 body_too_large``.

FastAPI reads a route's JSON body (its pydantic model: a heartbeat, a registration, a
join) whole into memory before the route runs, and no route of ours takes a JSON body of
more than a few KiB. So a request that declares a ``Content-Length`` over
``MAX_JSON_BYTES`` to such a route gets the 413 as soon as FastAPI asks for the body's
first bytes, with not one of them read (a declared 50 GB heartbeat would otherwise wait
for its body until the body timeout).

The route is known by then (FastAPI puts it in the scope before it reads a body), so
nothing is matched here. As in ``server.http.body_timeout``, the refusal is raised where the
body is read, and whatever the app then answers (FastAPI turns an error while reading a
JSON body into a 400) is replaced by the 413, with ``Connection: close``.

Routes that stream their body (an upload, run creation, a dataset's files, the speed
test) take no body model; each checks its own limit against the declared size
(``server.http.inputs.declared_length``) and counts the bytes as they stream.
"""

from __future__ import annotations

from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.errors import BodyTooLarge
from server.http.handlers import AnswerInstead

MAX_JSON_BYTES = 1 << 20


class BodyLimit:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = _declared(scope) if scope["type"] == "http" else 0
        if declared <= MAX_JSON_BYTES:  # the frequent small requests: one header lookup
            await self.app(scope, receive, send)
            return
        out = AnswerInstead(scope, receive, send)

        async def checked_receive() -> Message:
            route = scope.get("route")
            if isinstance(route, APIRoute) and route.body_field is not None:
                out.error = BodyTooLarge(
                    f"{declared} bytes is over the {MAX_JSON_BYTES}-byte limit of a JSON body"
                )
                raise out.error
            return await receive()

        await self.app(scope, checked_receive, out.send)


def _declared(scope: Scope) -> int:
    """The declared Content-Length; 0 when absent or not digits (the route refuses it)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
