"""``GET /healthz``, answered ahead of the work.

A load balancer asks often and wants its answer at once, whatever the process is busy
with. So the answer reads what the process's pulse last found (``server.pulse``: one
statement every ``pulse_interval_s`` on a connection of its own) and is sent from here,
before the body timeout, the routing and FastAPI: it never waits for a pooled connection,
the database, or the requests queued behind them.

- ``200 {"status": "ok", "database": "ok", "database_checked_s_ago", "version", "role"}``:
  this process serves, and its database answered the pulse's last probe, at most
  ``2 × pulse_interval_s + 5`` s ago.
- ``503 unavailable``: the last probe failed (the detail names how: ``database
  unreachable: ConnectionRefusedError``), or none answered for that long.

The app's ``/healthz`` route (``server.app``) answers with the same :func:`answer`; it is
there for the API's schema and for the other methods' ``405``. Inside ``RequestMetrics``
and ``RequestId``: counted under the route, and the answer carries its request id.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.handlers import error_response


def answer(app: Any) -> Response:
    """``/healthz``'s answer for ``app`` (its ``state.pulse``, its version and role)."""
    pulse = getattr(app.state, "pulse", None)
    if pulse is None:
        return error_response(503, "unavailable", "the server is starting")
    health = pulse.health()
    if not health.ok:
        return error_response(503, "unavailable", health.detail)
    return JSONResponse(
        {
            "status": "ok",
            "database": "ok",
            "database_checked_s_ago": round(health.age_s, 3),
            "version": app.version,
            "role": app.state.settings.role,
        },
        headers={"Cache-Control": "no-store"},
    )


class HealthCheck:
    """Answers ``GET /healthz`` itself; everything else goes on to the app."""

    def __init__(self, app: ASGIApp, *, route: Any) -> None:
        self.app = app
        self.route = route  # the app's /healthz route: the metrics label it counts under

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/healthz" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        scope["route"] = self.route
        await answer(scope["app"])(scope, receive, send)
