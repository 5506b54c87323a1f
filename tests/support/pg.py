"""Fresh Postgres databases for tests: each one a copy of a template migrated once per
session (``CREATE DATABASE … TEMPLATE``), which is far cheaper than running every Alembic
migration again. tests/test_migrations.py still migrates an empty database from scratch.

``DILOCO_TEST_DATABASE_URL`` names a server to create databases on (CI uses the system
Postgres); without it, one embedded Postgres is started for the session under a temp dir
(one per pytest-xdist worker, each under its own basetemp).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import secrets
import threading
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


def _unique_name(kind: str) -> str:
    """Unique on a server shared by several sessions and pytest-xdist workers at once."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return f"diloco_{kind}_{worker}_{secrets.token_hex(5)}"


# ------------------------------------------------------------------ the migrated template

_templates: dict[str, str] = {}  # admin URL -> this process's migrated template database
_template_lock = threading.Lock()


def migrated_template(admin_url: str) -> str:
    """The name of a database migrated to head, made on first use in this process (one per
    session and worker); fresh databases are copies of it. Dropped when the process ends."""
    with _template_lock:
        name = _templates.get(admin_url)
        if name is None:
            name = _unique_name("template")
            asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
            try:
                migrate.upgrade(_with_database(admin_url, name))
            except BaseException:
                _drop(admin_url, name)
                raise
            _templates[admin_url] = name
        return name


def drop_templates() -> None:
    """Drop this process's templates (at the end of the session; atexit as a fallback)."""
    with _template_lock:
        while _templates:
            admin_url, name = _templates.popitem()
            # the server may be gone already (the embedded one stops with the session)
            with contextlib.suppress(OSError, asyncpg.PostgresError):
                _drop(admin_url, name)


atexit.register(drop_templates)


def _drop(admin_url: str, name: str) -> None:
    asyncio.run(_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def fresh_database(admin_url: str, *, migrated: bool = True) -> Iterator[str]:
    """A new database on ``admin_url``'s server, dropped on exit: migrated to head (a copy
    of the session's template), or empty with ``migrated=False``. Yields its URL."""
    name = _unique_name("test")
    if migrated:
        template = migrated_template(admin_url)
        asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
    else:
        asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
    try:
        yield _with_database(admin_url, name)
    finally:
        _drop(admin_url, name)


def rows(url: str, query: str, *args: object) -> list[dict]:
    """The rows ``query`` returns on the database at ``url``, as dicts."""

    async def go() -> list[dict]:
        conn = await asyncpg.connect(url.replace("+asyncpg", ""))
        try:
            return [dict(r) for r in await conn.fetch(query, *args)]
        finally:
            await conn.close()

    return asyncio.run(go())
