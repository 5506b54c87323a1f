"""Alembic environment: runs migrations over the async engine, under an advisory lock so
that two servers starting at once on one database do not migrate it twice. The database is
``sqlalchemy.url`` (``server.migrate`` sets it), else ``DILOCO_DATABASE_URL``: so
``alembic upgrade head`` from the repository root works as the server's own start does."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from server import models  # noqa: F401 - registers every table on Base.metadata
from server.db import Base

MIGRATION_LOCK = 0x0D110C0  # pg_advisory_lock key, held while migrating

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
    try:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    finally:
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
        connection.commit()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
    finally:
        await engine.dispose()


def database_url_from_environment() -> str:
    """``DILOCO_DATABASE_URL`` in the driver form the server uses (postgresql:// accepted)."""
    from server.settings import Settings

    url = os.environ.get("DILOCO_DATABASE_URL", "")
    return Settings(database_url=url).database_url if url else ""


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url") or database_url_from_environment()
    if not url:
        raise RuntimeError("no database: set DILOCO_DATABASE_URL (or sqlalchemy.url)")
    asyncio.run(_run_async(url))


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
