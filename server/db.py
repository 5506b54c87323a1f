"""Database plumbing: the declarative base, the engine and the session dependency.

One dependency owns the transaction (Polar's ``get_db_session``): a request's session
commits when the route returns and rolls back when it raises; services never commit.
Background work (the sweeper, closing a round) opens its own ``begin()`` blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any, ClassVar

import asyncpg
from fastapi import Depends, Request
from sqlalchemy import DateTime, MetaData
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase

# Postgres constraint names that migrations can refer to (and that read well in errors)
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: DateTime(timezone=True)}


def make_engine(url: str) -> AsyncEngine:
    return create_async_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10)


def asyncpg_dsn(database_url: str) -> str:
    """The libpq form of our SQLAlchemy URL, for asyncpg itself."""
    return database_url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def make_fast_pool(database_url: str) -> asyncpg.Pool:
    """A small asyncpg pool for the requests every volunteer makes every few seconds
    (heartbeats, joins: ``server.rounds.leases``, ``server.rounds.heartbeats``): fixed SQL,
    prepared once per connection, no ORM and no transaction. Everything else goes through
    SQLAlchemy.

    Its commits do not wait for the WAL to reach the disk (``synchronous_commit = off``):
    what it writes is a lease handed out or renewed, a contributor's ``last_seen_at``, a
    round's lease counter and a data unit's issue count, and what a database *host* crash
    can lose of them (the last fraction of a second; never a corruption) the protocol
    recovers: a volunteer whose lease was lost is answered ``no_lease`` and joins again.
    Waiting for the disk held every join's update of its round's lease counter (one row,
    which every volunteer rejoining after a close updates) until a WAL flush: 1,000 joins,
    64 at a time, found the busy backends waiting on the WAL (589 samples of 1,159) and on
    that row's lock (425), 646 joins a second; without the wait, 873 a second and 14 such
    samples of 123 (here, 2026-11-28). Uploads, closes and everything else commit as
    usual."""
    return await asyncpg.create_pool(
        asyncpg_dsn(database_url),
        min_size=1,
        max_size=10,
        command_timeout=30,
        reset=_nothing_to_reset,
        server_settings={"synchronous_commit": "off"},
    )


async def _nothing_to_reset(conn: asyncpg.Connection) -> None:
    """The fast pool's statements leave no session state behind (no SET, LISTEN, advisory
    lock or open transaction), so a connection goes back to the pool as it is: asyncpg's
    default reset would cost one more round trip per request."""


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with sessions() as session:
        try:
            yield session
            await session.commit()
        except BaseException:
            await session.rollback()
            raise


# scope="function": the commit happens when the route returns, before the response is sent,
# so a 2xx always means committed
SessionDep = Annotated[AsyncSession, Depends(get_session, scope="function")]
