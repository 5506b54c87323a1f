"""Running ``diloco`` from a test."""

from __future__ import annotations

import subprocess


def in_process(*args: str) -> subprocess.CompletedProcess:
    """``diloco ARGS`` run by this process (typer's runner), for commands that stop on
    their arguments before any work: the same exit status and stderr as ``diloco``'s,
    without a new interpreter's imports (about 3 s each here)."""
    from typer.testing import CliRunner

    from client.cli.main import app

    result = CliRunner().invoke(app, list(args))
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)
