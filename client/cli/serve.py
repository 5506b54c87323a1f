"""``diloco serve``: the hub itself, where the server extra is installed.

The volunteer wheel (``GET /downloads/``) holds no ``server`` package and a volunteer's
install lacks the server's dependencies, so the command imports the server only when it
runs: there it says in one sentence how to install the server extra (exit 2), and ``diloco
--help`` lists it only where it could start (``installed``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated

import typer

from client.cli.support import ExitStatus, fail

# what `diloco --help` looks for before it lists the command: the server package and the
# first of its dependencies it imports (a missing other one is still told when serve runs)
SERVER_MODULES = ("server", "fastapi", "sqlalchemy", "uvicorn")


def missing_server_sentence(missing: str) -> str:
    return (
        f"diloco serve needs the server extra, which this install lacks ({missing} is "
        "missing): in a checkout of diloco-hub, pip install '.[server]'"
    )


def installed() -> bool:
    """Whether the server and its main dependencies can be found (nothing is imported)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in SERVER_MODULES)
    except (ImportError, ValueError):  # a parent that fails to import, a module set to None
        return False


def _check_options(role: str, storage: str | None) -> None:
    """Exit 2 on a bad ``--role`` or ``--storage``: a typo fails in a blink, not after the
    server's imports."""
    from server.storage.base import parse_storage_url

    if role not in ("all", "api", "worker"):
        fail(f"--role must be all, api or worker, not {role!r}", ExitStatus.USAGE)
    if storage:
        try:
            parse_storage_url(storage)
        except ValueError as err:
            fail(f"--storage: {err}", ExitStatus.USAGE)


def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.", envvar="DILOCO_HOST")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port to listen on.", envvar="DILOCO_PORT")] = 8000,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Checkpoints, uploads, embedded database (default: $XDG_DATA_HOME/diloco).",
            envvar="DILOCO_DATA_DIR",
        ),
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(
            help="Postgres URL (default: an embedded Postgres under the data dir).",
            envvar="DILOCO_DATABASE_URL",
            show_default=False,
        ),
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(
            help="Where checkpoints, uploads and shards live: file:///dir or "
            "s3://bucket/prefix (credentials and endpoint from AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL; volunteers then transfer "
            "straight to the bucket). Default: blobs/ under the data dir.",
            envvar="DILOCO_STORAGE",
            show_default=False,
        ),
    ] = None,
    role: Annotated[
        str,
        typer.Option(
            help="all: API, dashboard and round work; api: the API and dashboard only; "
            "worker: decide and close rounds only (serves /healthz and /metrics). Several "
            "processes may share one database.",
            envvar="DILOCO_ROLE",
        ),
    ] = "all",
) -> None:
    """Run the server: REST API, dashboard and the background round work."""
    from client.credentials import default_data_dir

    try:
        _check_options(role, storage)  # before the server (and torch) load
        from server.main import serve as serve_app
    except ModuleNotFoundError as err:
        fail(missing_server_sentence(err.name or "a module"), ExitStatus.USAGE)
    status = serve_app(
        host=host,
        port=port,
        data_dir=data_dir or default_data_dir(),
        database_url=database_url,
        role=role,
        storage=storage,
    )
    if status:
        raise typer.Exit(status)  # 128 + the signal that stopped it
