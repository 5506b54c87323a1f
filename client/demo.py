"""``diloco demo``: the whole platform on one machine.

Starts ``diloco serve`` with its embedded Postgres under a data dir, creates a run from a
config, starts local volunteers (``diloco join``, each with its own config dir, so each
registers as its own contributor), prints the dashboard URL and one line per closed round,
and stops every process it started, by PID, when the run completes or on Ctrl+C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any


class DemoError(RuntimeError):
    pass


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def _wait_ready(url: str, server: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise DemoError(f"the server exited ({server.returncode}); its log: {log}")
        try:
            if _get(f"{url}/healthz").get("status") == "ok":
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise DemoError(f"the server did not answer /healthz within {timeout:.0f} s; log: {log}")


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def run_demo(
    *, config: Path, data_dir: Path, port: int, volunteers: int, threads: int, timeout_s: float
) -> int:
    """Returns the exit status: 0 when the run completed."""
    data_dir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    me = [sys.executable, "-m", "client.cli"]
    logs: list[IO[bytes]] = []
    procs: list[subprocess.Popen[bytes]] = []

    def start(args: list[str], log_name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(data_dir / log_name, "ab")  # noqa: SIM115 - closed below
        logs.append(log)
        proc = subprocess.Popen(
            me + args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
        procs.append(proc)
        return proc

    try:
        server = start(
            ["serve", "--port", str(port), "--data-dir", str(data_dir / "server")],
            "server.log",
            {"DILOCO_DATABASE_URL": ""},
        )
        print(f"starting the server (embedded Postgres) on {url} ...", file=sys.stderr)
        _wait_ready(url, server, data_dir / "server.log", timeout=180)
        token = (data_dir / "server" / "admin-token").read_text().strip()
        created = subprocess.run(
            [*me, "run", "create", str(config), "--server", url, "--admin-token", token, "--json"],
            capture_output=True,
            text=True,
            check=False,
        )
        if created.returncode != 0:
            raise DemoError(f"run create failed: {created.stderr.strip()}")
        run = json.loads(created.stdout)
        run_id = run["id"]
        max_rounds = run["config"]["rounds"]["max_rounds"]
        print(f"run {run_id}: {run['n_params']:,} parameters, {max_rounds} rounds", file=sys.stderr)
        for i in range(volunteers):
            start(
                ["join", url, "--run", run_id, "--name", f"demo-volunteer-{i + 1}", "--quiet",
                 "--threads", str(threads)],
                f"volunteer-{i + 1}.log",
                {"DILOCO_CONFIG_DIR": str(data_dir / f"volunteer-{i + 1}" / "config"),
                 "DILOCO_CACHE_DIR": str(data_dir / f"volunteer-{i + 1}" / "cache")},
            )  # fmt: skip
        print(f"\n  dashboard: {url}/   API: {url}/docs\n", file=sys.stderr, flush=True)
        return _follow(url, run_id, max_rounds, timeout_s)
    finally:
        for proc in reversed(procs):  # volunteers first, the server last
            _stop(proc)
        for log in logs:
            log.close()
        print(f"stopped; logs and data are in {data_dir}", file=sys.stderr)


EVAL_GRACE_S = 60.0  # how long the demo waits for the last versions' eval losses


def _follow(url: str, run_id: str, max_rounds: int, timeout_s: float) -> int:
    """Print each round once it is closed and its eval loss is in (a version is published
    first and evaluated afterwards), in order; return when the run ends and every closed
    round is printed (or ``EVAL_GRACE_S`` after it ends)."""
    seen = 0
    deadline = time.monotonic() + timeout_s
    ended: tuple[str, float] | None = None  # the run's final status, and when we saw it
    while time.monotonic() < deadline:
        rounds = _get(f"{url}/api/v1/runs/{run_id}/rounds")["rounds"]
        for r in rounds:
            if r["index"] != seen + 1 or r["state"] != "closed" or r["eval_loss"] is None:
                continue
            seen = r["index"]
            print(
                f"round {r['index']:3d}/{max_rounds}  accepted {r['accepted']}  "
                f"train {r['train_loss']:.3f}  eval {r['eval_loss']:.3f}  ({r['close_code']})",
                file=sys.stderr,
                flush=True,
            )
        if ended is None and (status := _get(f"{url}/api/v1/runs/{run_id}")["status"]) != "active":
            ended = (status, time.monotonic())
        closed = sum(r["state"] == "closed" for r in rounds)
        if ended is not None and (seen >= closed or time.monotonic() > ended[1] + EVAL_GRACE_S):
            print(f"run {run_id} is {ended[0]}", file=sys.stderr)
            return 0 if ended[0] == "completed" else 1
        time.sleep(1.0)
    print(f"the run did not complete within {timeout_s:.0f} s", file=sys.stderr)
    return 1
