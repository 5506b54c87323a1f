"""A fresh, Alembic-migrated Postgres database per test (which tests the migrations too).

``DILOCO_TEST_DATABASE_URL`` names a server to create databases on (CI uses the system
Postgres); without it, one embedded Postgres is started for the session under a temp dir.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from server import migrate


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def _asyncpg_dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def _admin(url: str, sql: str) -> None:
    conn = await asyncpg.connect(_asyncpg_dsn(url))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def server_url(tmp_root: Path) -> str:
    """The admin URL (its default database) of the server tests create databases on."""
    url = os.environ.get("DILOCO_TEST_DATABASE_URL")
    if url:
        return url.replace("postgresql://", "postgresql+asyncpg://", 1)
    from server import embedded_pg

    embedded, _handle = embedded_pg.start(tmp_root)
    _KEEP.append(_handle)  # keep the embedded server up for the whole session
    return embedded


_KEEP: list[object] = []


@contextmanager
def fresh_database(admin_url: str, *, migrated: bool = True) -> Iterator[str]:
    name = f"diloco_test_{secrets.token_hex(5)}"
    asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
    url = _with_database(admin_url, name)
    try:
        if migrated:
            migrate.upgrade(url)
        yield url
    finally:
        asyncio.run(_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
