"""The Alembic migrations on a real Postgres: they upgrade, downgrade and upgrade again,
and the migrated schema is exactly what the SQLAlchemy models declare."""

from __future__ import annotations

import asyncio

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import create_async_engine

from server import migrate
from server import models as _models  # noqa: F401 - registers the tables
from server.db import Base
from tests.support.pg import fresh_database

TABLES = {"runs", "contributors", "rounds", "leases", "contributions", "checkpoints"}


async def _schema(url: str) -> tuple[set[str], list]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            tables = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
            diff = await conn.run_sync(
                lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata)
            )
    finally:
        await engine.dispose()
    return tables, diff


def test_migrations_upgrade_downgrade_and_match_the_models(pg_admin_url):
    with fresh_database(pg_admin_url, migrated=False) as url:
        migrate.upgrade(url)
        tables, diff = asyncio.run(_schema(url))
        assert tables >= TABLES
        assert diff == [], diff

        migrate.downgrade(url)
        tables, _ = asyncio.run(_schema(url))
        assert not (TABLES & tables)

        migrate.upgrade(url)
        assert asyncio.run(_schema(url))[0] >= TABLES
