"""Stopping a real ``diloco serve`` on its embedded Postgres (no database URL) with SIGTERM or
SIGINT: the Postgres it started stops too, unless another live server still uses it, and
the exit status is 128 + the signal."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.live import ServerProcess, wait_for

START_TIMEOUT = 120  # the first start runs initdb


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    """One data dir for the module, so that initdb runs once. Not under pytest's tmp root:
    run as root, pgserver runs Postgres as another user and opens the folders on the way
    for it, and a concurrent pytest session closes pytest's root again (pg_ctl then fails).
    A Postgres that a failed test left running is stopped by its PID at the end."""
    path = Path(tempfile.mkdtemp(prefix="diloco-serve-stop-"))
    try:
        yield path
    finally:
        pid = postmaster_pid(path)
        if pid is not None and running(pid):
            os.kill(pid, signal.SIGINT)  # Postgres's fast shutdown
            wait_for(lambda: not running(pid), timeout=60, what="the leftover Postgres to stop")
        shutil.rmtree(path)


def postmaster_pid(data_dir: Path) -> int | None:
    """The PID in the embedded Postgres's postmaster.pid, None when there is no such file."""
    try:
        return int((data_dir / "postgres" / "postmaster.pid").read_text().split()[0])
    except FileNotFoundError:
        return None


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start(data_dir: Path) -> ServerProcess:
    return ServerProcess(data_dir=data_dir, database_url=None).wait_ready(START_TIMEOUT)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_stops_the_embedded_postgres_and_exits_128_plus_the_signal(
    data_dir: Path, sig: int, status: int
):
    # Prepare
    server = start(data_dir)
    try:
        pg = postmaster_pid(data_dir)
        assert pg is not None and running(pg)

        # Execute
        code = server.stop(timeout=60, sig=sig)
    finally:
        server.stop()

    # Assert
    assert code == status, server.output()[-3000:]
    assert postmaster_pid(data_dir) is None
    wait_for(lambda: not running(pg), timeout=30, what=f"Postgres {pg} to exit")
    assert f"stopped by {signal.Signals(sig).name}" in server.output()


def test_the_embedded_postgres_keeps_running_while_another_server_uses_it(data_dir: Path):
    # Prepare: two servers on one data dir share its embedded Postgres
    first = start(data_dir)
    second = None
    try:
        second = start(data_dir)
        pg = postmaster_pid(data_dir)
        assert pg is not None

        # Execute: stop the first
        assert first.stop(timeout=60, sig=signal.SIGTERM) == 143, first.output()[-3000:]

        # Assert: the second still has its database
        assert postmaster_pid(data_dir) == pg and running(pg)
        assert httpx.get(f"{second.url}/healthz", timeout=10).status_code == 200

        # Execute: stop the last user
        assert second.stop(timeout=60, sig=signal.SIGINT) == 130, second.output()[-3000:]
    finally:
        first.stop()
        if second is not None:
            second.stop()

    # Assert: now it is down
    assert postmaster_pid(data_dir) is None
    wait_for(lambda: not running(pg), timeout=30, what=f"Postgres {pg} to exit")
