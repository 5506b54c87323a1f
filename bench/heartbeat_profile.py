"""Where a heartbeat's time goes: three tools for bench/load.py and a person profiling it.

``serve``  the real app (server.app.create_app) under uvicorn, as ``diloco serve`` runs it,
           with CPU accounting per request part: each part (the auth dependency, the round
           lookup, the lease UPDATE, commits, FastAPI's dependency solving, serialization,
           the middleware, the sweeper) is wrapped so that every step of its coroutine adds
           the event-loop thread's CPU time (``time.thread_time_ns``) to the part, minus
           what nested parts took. ``POST /__profile/reset`` starts a window, ``GET
           /__profile`` reports it. Used by ``bench/load.py --instrument``.
``sql``    the SQL one heartbeat sends: a real ``diloco serve`` talks to Postgres through a
           small proxy that reads the client's protocol messages (Query, Parse, Bind,
           Execute, Sync), so every statement, transaction and round trip is counted
           (bench/heartbeat_sql.py).
``spy``    summarise a ``py-spy record --format raw`` file (bench/load.py --py-spy) by the
           library of the innermost frame and by the request part found on the stack.

    python bench/heartbeat_profile.py sql [--database-url URL] [--heartbeats 20]
    python bench/heartbeat_profile.py spy /tmp/spy/heartbeat-N1000.txt
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from heartbeat_sql import sql

# ---------------------------------------------------------------- serve: CPU per request part

_stack: list[list[Any]] = []  # [path, start_ns, child_ns] of the part steps running now
_totals: dict[tuple[str, ...], list[int]] = defaultdict(lambda: [0, 0])  # path -> [ns, steps]
_calls: Counter[tuple[str, ...]] = Counter()
_clock = time.thread_time_ns


class _Metered:
    """Awaiting this drives ``coro`` step by step, charging each step's CPU to ``name``."""

    __slots__ = ("coro", "name")

    def __init__(self, coro: Any, name: str) -> None:
        self.coro, self.name = coro, name

    def __await__(self) -> Any:
        coro, value, error = self.coro, None, None
        path = (_stack[-1][0] if _stack else ()) + (self.name,)
        _calls[path] += 1
        while True:
            _stack.append([path, _clock(), 0])
            try:
                out = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                _leave()
                return stop.value
            except BaseException:
                _leave()
                raise
            _leave()
            try:
                value, error = (yield out), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown into the awaiting task: pass it down
                value, error = None, exc


def _leave() -> None:
    path, start, child = _stack.pop()
    elapsed = _clock() - start
    total = _totals[path]
    total[0] += elapsed - child
    total[1] += 1
    if _stack:
        _stack[-1][2] += elapsed


def _meter(owner: Any, attr: str, name: str) -> None:
    original = getattr(owner, attr)

    async def metered(*args: Any, **kwargs: Any) -> Any:
        return await _Metered(original(*args, **kwargs), name)

    setattr(owner, attr, metered)


def instrument() -> None:
    """Wrap the parts of a request, before the app is created (some are bound then)."""
    import asyncpg.connection
    import asyncpg.pool
    import fastapi.routing
    from sqlalchemy.ext.asyncio import AsyncSession, AsyncSessionTransaction

    import server.auth
    import server.rounds.heartbeats
    import server.rounds.leases
    import server.rounds.sweeper
    from server.http.body_limit import BodyLimit
    from server.http.body_timeout import BodyTimeout
    from server.http.health import HealthCheck
    from server.http.request_id import RequestId
    from server.metrics import RequestMetrics
    from server.rounds.lane import HeartbeatLane

    _meter(RequestMetrics, "__call__", "middleware RequestMetrics")
    _meter(RequestId, "__call__", "middleware RequestId")
    _meter(BodyTimeout, "__call__", "middleware BodyTimeout")
    _meter(BodyLimit, "__call__", "middleware BodyLimit")
    _meter(HealthCheck, "__call__", "middleware HealthCheck")
    _meter(HeartbeatLane, "__call__", "middleware HeartbeatLane (the heartbeat's answer)")
    _meter(asyncpg.pool.Pool, "_acquire", "asyncpg pool acquire")
    _meter(asyncpg.pool.Pool, "release", "asyncpg pool release")
    _meter(asyncpg.connection.Connection, "fetchrow", "asyncpg fetchrow (a statement)")
    _meter(asyncpg.connection.Connection, "fetchval", "asyncpg fetchval (a statement)")
    _meter(asyncpg.connection.Connection, "execute", "asyncpg execute (a statement)")
    _meter(fastapi.routing.APIRouter, "app", "router (match the route)")
    _meter(fastapi.routing.APIRoute, "handle", "endpoint (FastAPI request handler)")
    _meter(fastapi.routing, "solve_dependencies", "solve_dependencies (body, deps)")
    _meter(fastapi.routing, "run_endpoint_function", "route function")
    _meter(fastapi.routing, "serialize_response", "serialize_response (pydantic)")
    _meter(server.auth, "_find_contributor", "auth: ContributorAuth (own transaction)")
    _meter(server.rounds.heartbeats, "heartbeat", "heartbeats.heartbeat (one statement)")
    _meter(server.rounds.leases, "join", "leases.join (facts + lease)")
    _meter(server.rounds.sweeper.Sweeper, "sweep", "sweeper (decide_close every sweep)")
    _meter(AsyncSession, "scalar", "session.scalar (UPDATE ... RETURNING)")
    _meter(AsyncSession, "get", "session.get (SELECT round)")
    _meter(AsyncSession, "commit", "session.commit")
    _meter(AsyncSession, "close", "session.close")
    _meter(AsyncSessionTransaction, "__aenter__", "session.begin")
    _meter(AsyncSessionTransaction, "__aexit__", "commit of session.begin()")


class ProfiledApp:
    """The outermost ASGI app: meters every HTTP request and serves /__profile."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.window = self._now()

    @staticmethod
    def _now() -> dict[str, float]:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        process = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return {"thread_ns": _clock(), "process_s": process, "wall": time.time()}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/__profile/reset":
            _totals.clear()
            _calls.clear()
            self.window = self._now()
            await _json(send, {"reset": True})
            return
        if scope["path"] == "/__profile":
            await _json(send, self.report())
            return
        kind = "heartbeat request" if scope["path"].endswith("/heartbeat") else "other request"

        async def metered_send(message: Any) -> None:
            await _Metered(send(message), "uvicorn send (response to socket)")

        await _Metered(self.app(scope, receive, metered_send), kind)

    def report(self) -> dict[str, Any]:
        now = self._now()
        loop_ns = now["thread_ns"] - self.window["thread_ns"]
        process_s = now["process_s"] - self.window["process_s"]
        heartbeats = _calls[("heartbeat request",)] or 1
        metered = sum(ns for ns, _ in _totals.values())
        steps = sum(n for _, n in _totals.values())
        cost = _clock_cost_ns()
        lines = [
            f"window {now['wall'] - self.window['wall']:.1f} s, {heartbeats} heartbeats; "
            f"process CPU {process_s:.2f} s, event-loop thread {loop_ns / 1e9:.2f} s "
            f"(other threads {process_s - loop_ns / 1e9:.2f} s); instrumentation: "
            f"{steps} steps, about {2 * steps * cost / 1e9:.3f} s of clock reads",
            f"{'part (exclusive CPU, nested parts indented)':<66s} "
            f"{'ms/hb':>7s} {'%':>6s} {'calls/hb':>9s}",
        ]
        rows = sorted(_totals.items())
        for path, (ns, _) in rows:
            name = "  " * (len(path) - 1) + path[-1]
            lines.append(
                f"{name:<66s} {ns / heartbeats / 1e6:7.3f} {100 * ns / loop_ns:6.1f} "
                f"{_calls[path] / heartbeats:9.2f}"
            )
        outside = loop_ns - metered
        lines.append(
            f"{'outside any part: uvicorn/httptools, asyncpg protocol, event loop':<66s} "
            f"{outside / heartbeats / 1e6:7.3f} {100 * outside / loop_ns:6.1f}"
        )
        raw = {" / ".join(p): {"ns": ns, "calls": _calls[p]} for p, (ns, _) in rows}
        return {
            "lines": lines,
            "loop_ns": loop_ns,
            "process_s": process_s,
            "heartbeats": heartbeats,
            "outside_ns": outside,
            "parts": raw,
        }


def _clock_cost_ns() -> float:
    start = time.perf_counter_ns()
    for _ in range(10_000):
        _clock()
    return (time.perf_counter_ns() - start) / 10_000


async def _json(send: Any, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def serve(args: argparse.Namespace) -> None:
    """What server.main.serve does (migrate, admin token, torch threads, uvicorn), with the
    parts metered."""
    import logging

    import uvicorn

    from server import migrate
    from server.app import create_app
    from server.http.connection import guarded
    from server.settings import Settings

    instrument()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(message)s")
    settings = Settings(data_dir=args.data_dir, database_url=args.database_url)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.database_url)
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    assert settings.admin_token is not None, "set DILOCO_ADMIN_TOKEN"
    app = create_app(settings, admin_token=settings.admin_token.get_secret_value())
    # the protocol diloco serve runs (server.main): httptools with the head's guards
    http = guarded(
        max_header_bytes=settings.max_header_bytes, header_timeout_s=settings.header_timeout_s
    )
    uvicorn.run(
        ProfiledApp(app),
        host=args.host,
        port=args.port,
        log_level="info",
        access_log=False,
        http=http,
    )


# ---------------------------------------------------------------- spy: py-spy raw summary

PARTS = [  # (part, a function name or file fragment on the stack), first match from the top
    ("sweeper", "sweep (server/rounds/sweeper.py"),
    ("auth dependency", "_find_contributor"),
    ("heartbeat: one statement (heartbeats.heartbeat)", "heartbeat (server/rounds/heartbeats.py"),
    ("heartbeat: the lane (parse, answer)", "server/rounds/lane.py"),
    ("join: facts + lease (leases.join)", "join (server/rounds/leases.py"),
    ("request commit (get_session)", "get_session"),
    ("serialize_response", "serialize_response"),
    ("solve_dependencies", "solve_dependencies"),
    ("RequestMetrics", "server/metrics.py"),
    ("uvicorn / httptools", "uvicorn/"),
    ("asyncpg protocol", "asyncpg/"),
]


def _library(frame: str) -> str:
    """``Connection.execute (asyncpg/connection.py:352)`` -> ``asyncpg``."""
    m = re.search(r"\((.*?)(?::\d+)?\)$", frame)
    path = (m.group(1) if m else frame).split("site-packages/")[-1]
    top = path.split("/")[0] if "/" in path else "python stdlib"
    if top in ("server", "diloco", "client"):
        return f"{top} (ours)"
    if top in ("asyncio", "concurrent", "<frozen runpy>", "json", "email", "http"):
        return "python stdlib"
    return top


def spy(args: argparse.Namespace) -> None:
    by_library: Counter[str] = Counter()
    by_part: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    total = 0
    for line in Path(args.file).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        inner = frames[-1]
        by_library[_library(inner)] += n
        by_function[re.sub(r":\d+\)", ")", inner)] += n
        if not frames[0].startswith("_run_module_as_main"):  # a greenlet's own stack
            part = "SQLAlchemy in a greenlet (its request part is not on the stack)"
        elif all(_library(f) in ("python stdlib", "uvicorn", "typer", "client (ours)",
                                 "server (ours)") for f in frames):  # fmt: skip
            part = "event loop (uvloop running C callbacks, no Python frame of a request)"
        else:
            part = next((name for name, key in PARTS if key in stack), "other")
        by_part[part] += n
    print(f"{total} samples (CPU while the GIL-holding thread ran Python)")
    for title, table in (("innermost frame's library", by_library), ("request part", by_part)):
        print(f"by {title}:")
        for name, n in table.most_common(14):
            print(f"  {100 * n / total:5.1f}%  {name}")
    print("top innermost functions:")
    for name, n in by_function.most_common(args.top):
        print(f"  {100 * n / total:5.1f}%  {name}")


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--data-dir", type=Path, required=True)
    s.add_argument("--database-url", required=True)
    q = sub.add_parser("sql")
    q.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    q.add_argument("--heartbeats", type=int, default=20)
    p = sub.add_parser("spy")
    p.add_argument("file")
    p.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    {"serve": serve, "sql": sql, "spy": spy}[args.command](args)


if __name__ == "__main__":
    main()
