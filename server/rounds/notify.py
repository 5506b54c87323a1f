"""Waking the round workers of every process: Postgres ``NOTIFY`` on one channel.

An accepted upload or a released lease may let a round close now (its target reached, or
no live lease left), so the transaction that stores it also notifies ``diloco_rounds``;
Postgres delivers the notification on commit, to every process that listens, whatever its
role. A worker that misses one (it was reconnecting) loses nothing: it also sweeps every
``sweep_interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import asyncpg
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from server.db import asyncpg_dsn

log = logging.getLogger("diloco.rounds")

CHANNEL = "diloco_rounds"


async def rounds_changed(session: AsyncSession, run_id: str) -> None:
    """Notify the round workers when the current transaction commits."""
    await session.execute(select(func.pg_notify(CHANNEL, run_id)))


class Listener:
    """Calls ``on_notify`` for every notification on the channel, over its own connection,
    reconnecting with backoff when the connection drops."""

    def __init__(self, database_url: str, on_notify: Callable[[], None]) -> None:
        self.dsn = asyncpg_dsn(database_url)
        self.on_notify = on_notify

    def _callback(self, *_: Any) -> None:
        self.on_notify()

    async def run(self) -> None:
        delay = 0.5
        while True:
            try:
                conn = await asyncpg.connect(self.dsn)
            except (OSError, asyncpg.PostgresError, TimeoutError) as err:
                log.warning(
                    "round notifications: cannot connect (%s); retrying in %.1f s", err, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            delay = 0.5
            lost = asyncio.Event()
            conn.add_termination_listener(lambda _conn, lost=lost: lost.set())
            try:
                await conn.add_listener(CHANNEL, self._callback)
                self.on_notify()  # whatever happened while we were not listening
                await lost.wait()
                log.warning("round notifications: connection lost; reconnecting")
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as err:
                log.warning("round notifications: %s; reconnecting", err)
            finally:
                with contextlib.suppress(
                    OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError
                ):
                    await asyncio.wait_for(conn.close(), timeout=5)
