"""The FastAPI application: routers, error handling, API docs, the sweeper's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from importlib.metadata import version as pkg_version

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from diloco.faults import FaultInjector
from server.accounts.router import hub_router as accounts_hub_router
from server.accounts.router import router as accounts_router
from server.audits.router import router as audits_router
from server.checkpoints.router import router as checkpoints_router
from server.contributions.router import router as contributions_router
from server.contributors.router import router as contributors_router
from server.datasets.router import router as datasets_router
from server.db import make_engine, make_fast_pool, make_sessionmaker
from server.downloads.router import router as downloads_router
from server.http import apidocs, handlers, health, openapi
from server.http.body_limit import BodyLimit
from server.http.body_timeout import BodyTimeout
from server.http.health import HealthCheck
from server.http.ratelimit import RateLimits
from server.http.request_id import RequestId
from server.lifecycle.router import router as lifecycle_router
from server.metrics import RUN_GAUGES, RequestMetrics, watch_loop_lag
from server.pulse import Pulse
from server.rounds.lane import HeartbeatLane, heartbeat_route
from server.rounds.notify import Listener
from server.rounds.router import router as rounds_router
from server.rounds.slots import UploadSlots
from server.rounds.sweeper import Sweeper
from server.runs.config_router import router as config_router
from server.runs.router import router as runs_router
from server.settings import Role, Settings
from server.speedtest import router as speedtest_router
from server.storage.base import open_storage
from server.storage.staging import sweep_stale
from server.upkeep import memory
from server.upkeep.janitor import Janitor
from server.web import router as web
from server.webhooks.delivery import Deliverer
from server.webhooks.router import router as webhooks_router

log = logging.getLogger("diloco.server")


def create_app(settings: Settings, *, admin_token: str) -> FastAPI:
    """The app for the process's role: the API and dashboard (``all``, ``api``) and the
    round worker (``all``, ``worker``); a worker serves only /healthz and /metrics."""
    if not settings.database_url:
        raise ValueError("database_url: create_app needs a resolved database URL")
    serves_api = settings.role in (Role.ALL, Role.API)
    works_rounds = settings.role in (Role.ALL, Role.WORKER)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.database_url)
        app.state.engine = engine
        app.state.sessions = make_sessionmaker(engine)
        # heartbeats and joins: fixed SQL on a small asyncpg pool (server.rounds.leases)
        app.state.fast_pool = await make_fast_pool(settings.database_url) if serves_api else None
        app.state.storage = open_storage(
            settings.storage,
            settings.data_dir / "blobs",
            scratch_dir=settings.scratch_dir,
            scratch_cache_bytes=settings.scratch_cache_bytes,
            public_endpoint=settings.storage_public_endpoint,
        )
        faults = FaultInjector.parse(settings.faults)
        app.state.sweeper = Sweeper(app.state.sessions, app.state.storage, settings, faults)
        # the live leases (heartbeat advice) and the database's liveness (/healthz)
        pulse = Pulse(settings)
        await pulse.probe()
        app.state.pulse = pulse
        tasks = [
            asyncio.create_task(watch_loop_lag(), name="loop-lag"),
            asyncio.create_task(pulse.run(), name="pulse"),
            asyncio.create_task(memory.keep_settled(), name="keep-settled"),
        ]
        if works_rounds:  # the background work: rounds, and collecting what crashes left
            sweep_stale(settings.scratch_dir, max_age_s=settings.temp_max_age_s, now=time.time())
            janitor = Janitor(app.state.sessions, app.state.storage, settings)
            tasks.append(asyncio.create_task(janitor.run(), name="janitor"))
            listener = Listener(settings.database_url, app.state.sweeper.wake)
            tasks.append(asyncio.create_task(app.state.sweeper.run(), name="round-sweeper"))
            tasks.append(asyncio.create_task(listener.run(), name="round-notifications"))
            deliverer = Deliverer(app.state.sessions, settings)
            tasks.append(asyncio.create_task(deliverer.run(), name="webhooks"))
        memory.settle()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if app.state.fast_pool is not None:
                await app.state.fast_pool.close()
            await engine.dispose()

    app = FastAPI(
        title="DiLoCo Hub",
        version=pkg_version("diloco-hub"),
        description="Volunteer-compute DiLoCo training. docs/api.md is the full contract.",
        lifespan=lifespan,
        docs_url=None,  # served by server.http.apidocs, from our own files
        redoc_url=None,  # ReDoc would need a CDN
        # no OpenTelemetry: the hub's metrics are Prometheus's (/metrics), and FastAPI's
        # check for a configured provider cost every request ~10 µs (bench/request_path.py)
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    app.state.settings = settings
    app.state.admin_token = admin_token
    app.state.rate_limits = RateLimits(settings)
    app.state.upload_slots = UploadSlots(
        total=settings.max_uploads_in_flight, per_contributor=settings.max_uploads_per_contributor
    )
    handlers.install(app)

    @app.get("/healthz", tags=["service"])
    async def healthz(request: Request) -> Response:
        """The process serves and its database answered lately (server.http.health, which
        answers GET /healthz before this route is reached)."""
        return health.answer(request.app)

    health_route = app.router.routes[-1]
    if serves_api:  # a well-formed heartbeat skips the router and FastAPI (server.rounds.lane)
        app.add_middleware(HeartbeatLane, route=heartbeat_route(rounds_router))
    app.add_middleware(BodyLimit)  # a JSON body declared over 1 MiB: 413 before it is read
    # a body that stops arriving is dropped (408); inside RequestId, so it has an id too
    app.add_middleware(BodyTimeout, idle_timeout_s=settings.body_idle_timeout_s)
    # GET /healthz from the pulse's last probe, ahead of the body timeout and the routes
    app.add_middleware(HealthCheck, route=health_route)
    app.add_middleware(RequestId)  # answers what escapes the routes: 500, or 503 when no database
    app.add_middleware(RequestMetrics)  # outermost: counts the status that was sent
    routers = (
        lifecycle_router,
        runs_router,
        config_router,
        rounds_router,
        checkpoints_router,
        contributors_router,
        contributions_router,
        datasets_router,
        audits_router,
        webhooks_router,
        accounts_router,
        accounts_hub_router,
        speedtest_router,
        downloads_router,
        web.router,
    )
    for router in routers if serves_api else ():
        app.include_router(router)

    @app.get("/metrics", tags=["service"])
    async def metrics(request: Request) -> Response:
        await RUN_GAUGES.refresh(request.app.state.sessions)  # the per-run gauges, if stale
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    if serves_api:
        app.mount("/web", web.static_files(), name="web")
        apidocs.install(app)
    openapi.install(app)
    return app
