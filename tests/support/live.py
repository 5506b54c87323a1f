"""Real processes on 127.0.0.1: ``diloco serve`` and ``diloco join``, started and stopped by
PID, with every wait bounded in time."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

from tests.support import zygote
from tests.support.zygote import ForkedPopen

ADMIN_TOKEN = "adm_test_token"
CLI = [sys.executable, "-m", "client.cli"]


def _file_size_limit(size: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], Any], *, timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Proc:
    """A child process whose output goes to a log file; stopped by its PID only."""

    def __init__(
        self,
        args: list[str],
        *,
        log: Path,
        env: dict[str, str],
        max_file_bytes: int | None = None,
    ) -> None:
        """``args`` with ``env`` over this process's environment, output appended to
        ``log``; ``max_file_bytes``: it cannot write a file past this size (RLIMIT_FSIZE;
        Python ignores SIGXFSZ, so the write fails with EFBIG, as on a full disk). A
        ``python -m client.cli`` command is forked from the test zygote
        (tests/support/zygote.py)."""
        self.log_path = log
        self._log: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen: subprocess.Popen[bytes] | ForkedPopen
        if args[:3] == CLI and zygote.enabled():  # `diloco ...`: forked, imports done
            self.popen = zygote.Zygote.get().spawn(
                args[3:], env={**os.environ, **env}, log=log, max_file_bytes=max_file_bytes
            )
            return
        self.popen = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            preexec_fn=None if max_file_bytes is None else _file_size_limit(max_file_bytes),
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crash."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self, timeout: float = 20, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait for the exit (SIGKILL after ``timeout``); the exit status."""
        if self.alive():
            os.kill(self.pid, sig)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return int(self.popen.returncode)


def wait_healthy(proc: Proc, url: str, *, timeout: float = 120) -> None:
    """Wait until the server ``proc`` answers ``url``/healthz with 200 (it exiting first
    fails the test with its output)."""

    def ready() -> bool:
        if not proc.alive():
            raise AssertionError(f"server exited early:\n{proc.output()[-3000:]}")
        try:
            return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(ready, timeout=timeout, what=f"{url}/healthz")


class ServerProcess(Proc):
    def __init__(
        self,
        *,
        data_dir: Path,
        database_url: str | None,
        port: int | None = None,
        max_file_bytes: int | None = None,
        **settings: Any,
    ) -> None:
        """``database_url=None``: the embedded Postgres under ``data_dir``."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        env = {
            "DILOCO_ADMIN_TOKEN": ADMIN_TOKEN,
            # deadlines and expiries are seen within half a second (uploads and releases wake
            # the sweeper at once); 0.2 s cost an idle server 6% of a core, 0.5 s about 2%
            "DILOCO_SWEEP_INTERVAL_S": "0.5",
            "DILOCO_TORCH_THREADS": "1",
            # every test client is 127.0.0.1: no rate limit unless a test sets one
            "DILOCO_RATE_REGISTER": "",
            "DILOCO_RATE_SPEEDTEST": "",
            "DILOCO_RATE_UPLOAD": "",
            **{f"DILOCO_{k.upper()}": str(v) for k, v in settings.items()},
        }
        args = [sys.executable, "-m", "client.cli", "serve", "--host", "127.0.0.1"]
        args += ["--port", str(self.port), "--data-dir", str(data_dir)]
        if database_url is None:
            env["DILOCO_DATABASE_URL"] = ""  # whatever the caller's environment says
        else:
            args += ["--database-url", database_url]
        data_dir.mkdir(parents=True, exist_ok=True)
        log = data_dir / f"server-{self.port}.log"
        super().__init__(args, log=log, env=env, max_file_bytes=max_file_bytes)

    def wait_ready(self, timeout: float = 120) -> ServerProcess:
        """Wait for ``/healthz``; generous, as parallel test workers start servers at once."""
        wait_healthy(self, self.url, timeout=timeout)
        return self

    def client(self, timeout: float = 60, *, wait_pending: bool = True) -> httpx.Client:
        """A client of this server. ``wait_pending``: it waits out ``503 checkpoint_pending``
        (a version's parameters in the moments between its publishing and their commit:
        ``server.rounds.full_files``) as the volunteer client does, only sooner than its
        Retry-After; a test about that answer turns it off."""
        transport = _WaitsPending() if wait_pending else None
        return httpx.Client(base_url=self.url, timeout=timeout, transport=transport)


class _WaitsPending(httpx.HTTPTransport):
    """Asks again, every 50 ms for up to a minute, while the answer is ``503
    checkpoint_pending``."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        deadline = time.monotonic() + 60
        while True:
            response = super().handle_request(request)
            if response.status_code != 503 or time.monotonic() > deadline:
                return response
            response.read()
            if b'"checkpoint_pending"' not in response.content:
                return response
            response.close()
            time.sleep(0.05)


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}
