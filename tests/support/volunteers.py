"""Real ``diloco join`` volunteers for end-to-end tests: runs created with ``diloco run
create``, volunteers started as processes (each with its own config and cache dir), and a
run followed to its end."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.contribute import API
from tests.support.live import ADMIN_TOKEN, Proc, ServerProcess, wait_for


def create_run(server: ServerProcess, config: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "client.cli", "run", "create", str(config),
         "--server", server.url, "--admin-token", ADMIN_TOKEN],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    assert re.fullmatch(r"run_[0-9a-f]{12}", run_id), out.stdout
    return run_id


class Volunteers:
    def __init__(self, root: Path) -> None:
        self.root, self.procs = root, {}  # type: ignore[var-annotated]

    def start(
        self, name: str, server: ServerProcess | str, run_id: str, *, quiet: bool = True, **env: str
    ) -> Proc:
        """``server``: a server process, or a URL (a load balancer's); ``quiet`` False keeps
        the per-round lines in its log."""
        home = self.root / name
        home.mkdir(parents=True)
        url = server if isinstance(server, str) else server.url
        proc = Proc(
            [sys.executable, "-m", "client.cli", "join", url, "--run", run_id,
             "--name", name, "--threads", "1", *(["--quiet"] if quiet else [])],
            log=home / "join.log",
            env={"DILOCO_CONFIG_DIR": str(home / "config"),
                 "DILOCO_CACHE_DIR": str(home / "cache"), **env},
        )  # fmt: skip
        self.procs[name] = proc
        return proc

    def finish(self, http: httpx.Client, run_id: str, *, timeout: float = 400) -> None:
        """Wait for the run to complete, then for every volunteer to exit with status 0
        (each one stops when the run ends)."""
        wait_for(
            lambda: http.get(f"{API}/runs/{run_id}").json()["status"] == "completed",
            timeout=timeout,
            what="the run to complete",
            every=1.0,
        )
        self.wait_all_done()

    def wait_all_done(self, timeout: float = 60) -> None:
        """Every volunteer exits (the run ended), each with status 0."""
        for proc in self.procs.values():
            wait_for(lambda p=proc: not p.alive(), timeout=timeout, what="volunteers to exit")
            assert proc.popen.returncode == 0, proc.output()[-2000:]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.stop()


def evaluated_rounds(http: httpx.Client, run_id: str, *, timeout: float = 60) -> list[dict]:
    """``GET /runs/{id}/rounds`` once every round's version has its eval loss (measured
    after the version is published, so the last one's may still be pending)."""
    rounds: list[dict] = wait_for(
        lambda: (
            (rs := http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"])
            and all(r["eval_loss"] is not None for r in rs)
            and rs
        ),
        timeout=timeout,
        what="every round's eval loss",
    )
    return rounds


@dataclass(frozen=True)
class LiveRun:
    server: ServerProcess
    run_id: str
    volunteers: Volunteers
    http: httpx.Client


@contextmanager
def live_run(database_url: str, root: Path, config: Path) -> Iterator[LiveRun]:
    """A real ``diloco serve`` under ``root`` with the run of ``config`` created through
    the CLI, and a place for its volunteers; everything stopped on the way out."""
    server = ServerProcess(data_dir=root / "srv", database_url=database_url).wait_ready()
    volunteers = Volunteers(root / "volunteers")
    try:
        run_id = create_run(server, config)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            yield LiveRun(server, run_id, volunteers, http)
    finally:
        volunteers.stop_all()
        server.stop()
