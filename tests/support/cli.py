"""``diloco`` as a volunteer runs it: a child process with its own config and cache dirs;
and, for usage errors, run in the test's own process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

Diloco = Callable[..., subprocess.CompletedProcess[str]]


def volunteer_cli(home: Path, *, timeout: float = 180) -> Diloco:
    """A function running ``diloco ARGS...`` with its config under ``home/config`` and its
    cache under ``home/cache`` (never the user's), bounded by ``timeout`` seconds."""
    env = {
        **os.environ,
        "DILOCO_CONFIG_DIR": str(home / "config"),
        "DILOCO_CACHE_DIR": str(home / "cache"),
    }
    env.pop("DILOCO_HOME", None)

    def diloco(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "client.cli", *args],
            capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
        )  # fmt: skip

    return diloco


def in_process(*args: str) -> subprocess.CompletedProcess:
    """``diloco ARGS`` run by this process (typer's runner), for commands that stop on
    their arguments before any work: the same exit status and stderr as ``diloco``'s,
    without a new interpreter's imports (about 3 s each here)."""
    from typer.testing import CliRunner

    from client.cli.main import app

    result = CliRunner().invoke(app, list(args))
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)
