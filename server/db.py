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
    (heartbeats, joins: ``server.rounds.leases``): fixed SQL, prepared once per connection,
    no ORM and no transaction. Everything else goes through SQLAlchemy."""
    return await asyncpg.create_pool(
        asyncpg_dsn(database_url),
        min_size=1,
        max_size=10,
        command_timeout=30,
        reset=_nothing_to_reset,
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
