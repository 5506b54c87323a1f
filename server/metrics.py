"""Prometheus metrics, served at /metrics in the text format."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("diloco.metrics")

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
FOLD_SECONDS = Histogram(
    "diloco_fold_seconds",
    "Time of one fold: arrived uploads (one or more, diloco_folded_uploads_total) added to "
    "their round's running sum in one pass over it, off the close's critical path",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
)
FOLDED_UPLOADS = Counter(
    "diloco_folded_uploads_total",
    "Arrived uploads folded into their round's running sum (server.rounds.folding)",
)
CLOSE_FOLDED = Counter(
    "diloco_close_folded_uploads_total",
    "Uploads a published step summed as they arrived (server.rounds.folding): the close "
    "did not read them again",
)
SCORE_SECONDS = Histogram(
    "diloco_arrival_score_seconds",
    "Time to score one upload by the loss as it arrives (off the close's critical path)",
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


# ------------------------------------------------------------------------ per-run gauges

RUN_STATUSES = ("active", "paused", "completed", "cancelled")
# which runs have series: every run not ended (active, paused) and the runs that ended in the
# last hour, so that the end shows on a graph, newest first and at most this many in all
RUN_GAUGES_ENDED_S = 3600.0
RUN_GAUGES_MAX_RUNS = 100
# a scrape reads the database at most this often (more scrapes, of this process or of
# several Prometheus servers, share a snapshot); one that takes longer is given up
RUN_GAUGES_REFRESH_S = 2.0
RUN_GAUGES_QUERY_TIMEOUT_S = 5.0
# leases counted as active volunteers: live ones on the run's newest rounds (a volunteer
# finishing late work for a closed round, rounds.max_staleness <= 10 back, included)
LEASE_ROUNDS_BACK = 11

RUN_GAUGES_FAILURES = Counter(
    "diloco_run_gauges_refresh_failures_total",
    "Scrapes whose read of the per-run gauges failed or timed out (the previous snapshot "
    "was served)",
)

# One statement for every run shown: each LATERAL reads one row of a primary key's index
# (the newest round, the newest closed round, the newest evaluated version); the leases
# and the open round's contributions are read through (run_id, round, ...) indexes.
RUN_GAUGES_SQL = text(
    """
    WITH shown AS (
        SELECT id, name, status, created_at FROM runs
        WHERE status IN ('active', 'paused') OR updated_at > :ended_after
        ORDER BY created_at DESC, id
        LIMIT :max_runs
    )
    SELECT s.id, s.name, s.status, EXTRACT(EPOCH FROM s.created_at) AS created,
        cur."index" AS round, cur.state AS round_state,
        EXTRACT(EPOCH FROM done.closed_at) AS last_close,
        ev.version AS eval_version, ev.eval_loss,
        (SELECT count(DISTINCT l.contributor_id) FROM leases l
            WHERE l.run_id = s.id AND l.expires_at > :now
              AND l.round_index > cur."index" - :rounds_back) AS volunteers,
        (SELECT count(*) FROM contributions c
            WHERE c.run_id = s.id AND c.merged_into_round = cur."index"
              AND c.excluded_code IS NULL AND cur.state <> 'closed') AS open_accepted
    FROM shown s
    LEFT JOIN LATERAL (
        SELECT r."index", r.state FROM rounds r
        WHERE r.run_id = s.id ORDER BY r."index" DESC LIMIT 1
    ) cur ON true
    LEFT JOIN LATERAL (
        SELECT r.closed_at FROM rounds r
        WHERE r.run_id = s.id AND r.state = 'closed' ORDER BY r."index" DESC LIMIT 1
    ) done ON true
    LEFT JOIN LATERAL (
        SELECT k.version, k.eval_loss FROM checkpoints k
        WHERE k.run_id = s.id AND k.eval_loss IS NOT NULL ORDER BY k.version DESC LIMIT 1
    ) ev ON true
    ORDER BY s.created_at DESC, s.id
    """
)


@dataclass(frozen=True)
class RunGauge:
    """One run as a refresh read it (times as Unix seconds)."""

    run_id: str
    name: str
    status: str
    created: float
    round: int | None  # the newest round's index (open, closing, or the last closed)
    round_open: bool  # that round is not closed yet
    last_close: float | None
    eval_version: int | None  # the newest version whose eval loss is known
    eval_loss: float | None  # its loss (NaN when it was not finite)
    volunteers: int
    open_accepted: int


class RunGauges(Collector):
    """Per-run gauges at /metrics (``diloco_run_*``), labelled ``run`` (the id) and
    ``name``: the runs not ended and those ended within ``RUN_GAUGES_ENDED_S``, at most
    ``RUN_GAUGES_MAX_RUNS`` (newest first), so the series stay bounded however many runs a
    hub has had.

    The /metrics route calls ``refresh`` before it renders: one SQL statement, at most every
    ``RUN_GAUGES_REFRESH_S`` (scrapes in between share the snapshot), from whatever process
    serves the request, API or round worker alike. ``collect`` renders the snapshot, with
    the seconds since the last close taken at that moment. A failed or slow read leaves the
    previous snapshot (counted in ``diloco_run_gauges_refresh_failures_total``); /metrics
    answers all the same."""

    def __init__(self) -> None:
        self.runs: tuple[RunGauge, ...] = ()
        self.read_at = -math.inf  # time.monotonic() of the last refresh attempt
        # one lock per event loop (an app in a test may run on another loop than the last)
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    def _loop_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        return self._lock[1]

    async def refresh(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        async with self._loop_lock():  # a scrape arriving during a refresh shares its result
            if time.monotonic() - self.read_at < RUN_GAUGES_REFRESH_S:
                return
            self.read_at = time.monotonic()
            try:
                self.runs = await asyncio.wait_for(
                    self._read(sessions), timeout=RUN_GAUGES_QUERY_TIMEOUT_S
                )
            except (OSError, DBAPIError, TimeoutError) as err:
                RUN_GAUGES_FAILURES.inc()
                log.warning("per-run gauges not refreshed: %s: %s", type(err).__name__, err)

    async def _read(self, sessions: async_sessionmaker[AsyncSession]) -> tuple[RunGauge, ...]:
        now = datetime.now(UTC)
        params = {
            "now": now,
            "ended_after": datetime.fromtimestamp(now.timestamp() - RUN_GAUGES_ENDED_S, UTC),
            "max_runs": RUN_GAUGES_MAX_RUNS,
            "rounds_back": LEASE_ROUNDS_BACK,
        }
        async with sessions() as session:
            rows = (await session.execute(RUN_GAUGES_SQL, params)).mappings().all()
        return tuple(
            RunGauge(
                run_id=r["id"],
                name=r["name"],
                status=r["status"],
                created=float(r["created"]),
                round=r["round"],
                round_open=r["round_state"] is not None and r["round_state"] != "closed",
                last_close=None if r["last_close"] is None else float(r["last_close"]),
                eval_version=r["eval_version"],
                eval_loss=None if r["eval_loss"] is None else float(r["eval_loss"]),
                volunteers=int(r["volunteers"] or 0),
                open_accepted=int(r["open_accepted"] or 0),
            )
            for r in rows
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families(()))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families(self.runs))

    @staticmethod
    def _families(runs: tuple[RunGauge, ...]) -> list[GaugeMetricFamily]:
        labels = ["run", "name"]
        status = GaugeMetricFamily(
            "diloco_run_status",
            "1 for the run's status, 0 for the others (active, paused, completed, cancelled)",
            labels=[*labels, "status"],
        )
        rnd = GaugeMetricFamily(
            "diloco_run_round",
            "Index of the run's newest round: the open one, or the last closed",
            labels=labels,
        )
        accepted = GaugeMetricFamily(
            "diloco_run_open_round_accepted",
            "Contributions taking part in the open round's step so far, late work included "
            "(0 when no round is open)",
            labels=labels,
        )
        volunteers = GaugeMetricFamily(
            "diloco_run_active_volunteers",
            "Contributors holding a live lease on the run (its newest rounds)",
            labels=labels,
        )
        eval_loss = GaugeMetricFamily(
            "diloco_run_eval_loss",
            "Eval loss of the newest version whose eval is known (NaN: it was not finite)",
            labels=labels,
        )
        eval_version = GaugeMetricFamily(
            "diloco_run_eval_version",
            "The version diloco_run_eval_loss is of",
            labels=labels,
        )
        since = GaugeMetricFamily(
            "diloco_run_seconds_since_close",
            "Seconds since the run's last round closed (before its first close: since the "
            "run was created)",
            labels=labels,
        )
        now = time.time()
        for g in runs:
            ids = [g.run_id, g.name]
            for s in RUN_STATUSES:
                status.add_metric([*ids, s], 1.0 if g.status == s else 0.0)
            if g.round is not None:
                rnd.add_metric(ids, g.round)
            accepted.add_metric(ids, g.open_accepted if g.round_open else 0)
            volunteers.add_metric(ids, g.volunteers)
            if g.eval_version is not None:
                eval_loss.add_metric(ids, math.nan if g.eval_loss is None else g.eval_loss)
                eval_version.add_metric(ids, g.eval_version)
            since.add_metric(ids, max(0.0, now - (g.last_close or g.created)))
        return [status, rnd, accepted, volunteers, eval_loss, eval_version, since]


RUN_GAUGES = RunGauges()
REGISTRY.register(RUN_GAUGES)
