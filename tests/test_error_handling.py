"""The error handling of server.http.handlers and server.http.request_id, on a tiny app built here
around real Postgres errors (no server route can be made to fail on purpose, and no
production switch exists for it): a value the database refuses is our bug, 500 internal,
logged with its traceback under the request id the answer names; a refused, lost or
exhausted connection is 503 unavailable; nothing else is 503."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from server.http import handlers
from server.http.errors import InvalidRequest, InvalidTransition
from server.http.request_id import RequestId
from tests.support.live import free_port

pytestmark = pytest.mark.asyncio


def tiny_app(database_url: str) -> FastAPI:
    """Routes that each fail as one real request could, wrapped as create_app wraps its own."""
    app = FastAPI()
    handlers.install(app)
    app.add_middleware(RequestId)
    unreachable_url = f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/postgres"

    async def run(url: str, sql: str, **params: object) -> None:
        engine = create_async_engine(url, pool_size=1, max_overflow=0, pool_timeout=0.2)
        try:
            async with engine.connect() as conn:
                await conn.execute(text(sql), params)
        finally:
            await engine.dispose()

    @app.get("/int32-overflow")
    async def int32_overflow() -> None:  # what the fuzzer's round 2^31 did
        await run(database_url, "SELECT CAST(:v AS integer)", v=1 << 31)

    @app.get("/nul-in-text")
    async def nul_in_text() -> None:  # what the fuzzer's NUL run id did
        await run(database_url, "SELECT CAST(:v AS text)", v="run_\x00")

    @app.get("/refused")
    async def refused() -> None:
        await run(unreachable_url, "SELECT 1")

    @app.get("/terminated")
    async def terminated() -> None:  # the database ends our connection mid-request
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        finally:
            await engine.dispose()

    @app.get("/pool-exhausted")
    async def pool_exhausted() -> None:
        engine = create_async_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
        try:
            async with engine.connect(), engine.connect():
                pass
        finally:
            await engine.dispose()

    @app.get("/bug")
    async def bug() -> None:
        raise ZeroDivisionError("a plain bug")

    @app.get("/transition")
    async def transition() -> None:
        raise InvalidTransition("cannot pause a paused run", status="paused")

    @app.get("/surrogate")
    async def surrogate() -> None:
        raise InvalidRequest("name: '\ud800' is not text")

    @app.get("/cut-stream")
    async def cut_stream() -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b"first part"
            raise RuntimeError("the file vanished halfway")

        return StreamingResponse(body(), media_type="application/octet-stream")

    return app


@pytest.fixture
def client(pg_admin_url: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=tiny_app(pg_admin_url))
    return httpx.AsyncClient(transport=transport, base_url="http://tiny")


@pytest.mark.parametrize("route", ["/int32-overflow", "/nul-in-text", "/bug"])
async def test_a_refused_value_or_a_bug_is_500_internal_never_503(client, route, caplog):
    with caplog.at_level(logging.ERROR, logger="diloco.server"):
        r = await client.get(route, headers={"X-Request-ID": "probe-1"})

    assert r.status_code == 500, r.text
    assert r.json()["error"] == "internal"
    assert "request id probe-1" in r.json()["detail"]
    assert r.headers["x-request-id"] == "probe-1"
    (record,) = [rec for rec in caplog.records if "probe-1" in rec.getMessage()]
    assert record.exc_info is not None and route in record.getMessage()


@pytest.mark.parametrize("route", ["/refused", "/terminated", "/pool-exhausted"])
async def test_an_unreachable_database_is_503_unavailable(client, route):
    r = await client.get(route)

    assert r.status_code == 503, r.text
    assert r.json() == {
        "error": "unavailable",
        "detail": "the database is unreachable; retry with backoff",
    }
    assert r.headers["x-request-id"].startswith("req_")


async def test_a_domain_error_keeps_extras_named_like_the_answer_itself(client):
    r = await client.get("/transition")

    assert r.status_code == 409
    assert r.json() == {
        "error": "invalid_transition",
        "detail": "cannot pause a paused run",
        "status": "paused",
    }


async def test_an_error_quoting_a_lone_surrogate_still_renders_as_json(client):
    r = await client.get("/surrogate")

    assert r.status_code == 422
    assert r.content.isascii()
    assert r.json()["detail"] == "name: '\ud800' is not text"


async def test_a_failure_after_the_answer_started_is_logged_not_answered_twice(client, caplog):
    with (
        caplog.at_level(logging.ERROR, logger="diloco.server"),
        pytest.raises(RuntimeError, match="halfway"),
    ):
        await client.get("/cut-stream")

    assert any("failed mid-answer" in rec.getMessage() for rec in caplog.records)


async def test_unreachable_looks_through_sqlalchemys_wrapper_only_for_connection_errors():
    from sqlalchemy.exc import DBAPIError

    refused = DBAPIError("SELECT 1", {}, ConnectionRefusedError(111, "refused"))
    refused_value = DBAPIError("SELECT 1", {}, ValueError("out of int32 range"))
    lost = DBAPIError("SELECT 1", {}, ValueError("?"), connection_invalidated=True)

    assert handlers.unreachable(refused)
    assert not handlers.unreachable(refused_value)
    assert handlers.unreachable(lost)
    assert not handlers.unreachable(FileNotFoundError("a checkpoint file is missing"))
