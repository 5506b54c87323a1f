"""Prometheus metrics, served at /metrics in the text format."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UPLOADS = Counter("diloco_uploads_total", "Contribution uploads by outcome", ["outcome"])
UPLOAD_BYTES = Counter(
    "diloco_upload_bytes_total", "Bytes of accepted contribution bodies received by this server"
)
DIRECT_UPLOAD_BYTES = Counter(
    "diloco_direct_upload_bytes_total",
    "Bytes of accepted contributions put straight into the object store by volunteers "
    "(read back from the store to be checked, never sent to this server)",
)
ROUNDS_CLOSED = Counter("diloco_rounds_closed_total", "Rounds closed, by reason code", ["code"])
CLOSE_SECONDS = Histogram(
    "diloco_round_close_seconds",
    "Aggregation + outer step + eval + checkpoint write",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
CLOSE_FAILURES = Counter(
    "diloco_round_close_failures_total", "Failed attempts to close a round, by code", ["code"]
)
LOOP_LAG = Histogram(
    "diloco_event_loop_lag_seconds",
    "How late the event loop ran a timer: time every request waited behind something else",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
REQUESTS = Counter("diloco_http_requests_total", "HTTP requests", ["method", "route", "status"])
CLOSE_STAGE_SECONDS = Histogram(
    "diloco_round_close_stage_seconds",
    "Time per stage of closing a round",
    ["stage"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
EVAL_SECONDS = Histogram(
    "diloco_version_eval_seconds",
    "Time to measure a published version's eval loss (after publishing)",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
ServedKind = Literal["checkpoint", "delta", "shard", "wheel", "audit", "contribution"]
SERVED_KINDS: tuple[ServedKind, ...] = (
    "checkpoint", "delta", "shard", "wheel", "audit", "contribution",
)  # fmt: skip
SERVED_BYTES = Counter(
    "diloco_served_bytes_total",
    "File bytes streamed to clients, by kind (a range counts its bytes, a 304 none)",
    ["kind"],
)
for _served in SERVED_KINDS:
    SERVED_BYTES.labels(_served)  # every kind shows, at 0, from the start
REDIRECTS = Counter(
    "diloco_redirects_total",
    "Blob reads sent to the object store instead (a 307 to a signed or CDN URL), by kind",
    ["kind"],
)
for _served in SERVED_KINDS:
    REDIRECTS.labels(_served)
# crash leftovers (server.upkeep.janitor), then what retention deleted (server.upkeep.retention): a
# version's files, a contribution's blob, a file a retired row left behind
JANITOR_KINDS = (
    "temp_file",
    "orphan_blob",
    "orphan_run",
    "stale_upload",
    "retired_checkpoint",
    "retired_contribution",
    "retired_leftover",
)
JANITOR_REMOVED = Counter(
    "diloco_janitor_removed_total",
    "Leftovers the janitor removed, and what retention deleted, by kind",
    ["kind"],
)
JANITOR_ERRORS = Counter(
    "diloco_janitor_errors_total", "Leftovers the janitor failed to remove (retried next pass)"
)
JANITOR_PASSES = Counter("diloco_janitor_passes_total", "Janitor passes completed")
for _kind in JANITOR_KINDS:
    JANITOR_REMOVED.labels(_kind)  # every kind shows, at 0, from the start


class RequestMetrics:
    """Count every HTTP request in ``REQUESTS`` by method, route template and status.

    The label is the matched route's template (``/api/v1/runs/{run_id}/checkpoints/{version}``),
    which the router leaves in ``scope["route"]``, never the raw path: one series per
    endpoint, however many runs and versions there are. No match: ``unmatched``. A pure ASGI
    middleware, so streamed downloads pass through untouched; counted once the response ends
    (500 if the app raised before it started one).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            REQUESTS.labels(scope["method"], route, str(status)).inc()


async def watch_loop_lag(every_s: float = 0.25) -> None:
    """Observe ``LOOP_LAG`` for ever: sleep ``every_s`` and measure how late we woke. A
    blocked loop (a long garbage collection, synchronous work in a request) shows here."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(every_s)
        LOOP_LAG.observe(max(0.0, time.perf_counter() - asked - every_s))
