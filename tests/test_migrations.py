"""The Alembic migrations on a real Postgres: they upgrade, downgrade and upgrade again,
and the migrated schema is exactly what the SQLAlchemy models declare."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import create_async_engine

from server import migrate
from server import models as _models  # noqa: F401 - registers the tables
from server.db import Base
from tests.support.pg import fresh_database

REPO = Path(__file__).resolve().parents[1]
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


def test_alembic_upgrade_head_from_the_repository_root_creates_the_database(pg_admin_url):
    # what alembic.ini and the README say: the URL from DILOCO_DATABASE_URL, libpq form
    with fresh_database(pg_admin_url, migrated=False) as url:
        plain = url.replace("postgresql+asyncpg://", "postgresql://", 1)
        proc = subprocess.run(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env={**os.environ, "DILOCO_DATABASE_URL": plain},
        )  # fmt: skip

        assert proc.returncode == 0, proc.stderr[-3000:]
        tables, diff = asyncio.run(_schema(url))
        assert tables >= TABLES and diff == [], diff
