"""What one request costs the server's CPU, part by part, beside the unmatched route.

The real app (``server.app.create_app``, its lifespan run) on a fresh database, driven
in-process through ASGI, one request at a time: no sockets, no HTTP parsing, no other load,
so the figures are the app's own and move little from run to run (bench/load.py measures
the whole server under load). Each case runs ``--requests`` times after a warm-up; CPU is
this thread's (``time.thread_time``: the app, asyncpg's client side, the event loop), and
Postgres's is that of the backends serving the bench's database (``/proc``).

- whole requests: the unmatched route (every middleware, the router's search, the 404
  handler: the floor any request pays), ``GET /healthz``, a heartbeat, a heartbeat that
  takes the route (a content type FastAPI accepts and the fast lane leaves to it), a join
  that renews its lease and one that hands out a new lease;
- each middleware of ``server.http`` (and the heartbeat's lane) alone, around an app that
  answers 204 at once, minus that app alone;
- the heartbeat's SQL alone: the pool's acquire and release, and its statement(s) as
  ``server.rounds`` sends them.

Run it on another checkout to compare (``PYTHONPATH=OTHER python bench/request_path.py``):
a part the other code lacks is left out.

    python bench/request_path.py [--requests 2000] [--database-url postgresql://...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from load_support import ADMIN, API, fresh_database, make_corpus, plain_dsn
from procstat import proc_cpu_s

Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        + [(b"host", b"127.0.0.1"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    return scope, body


async def call(app: Asgi, scope: dict[str, Any], body: bytes, app_of: Any) -> int:
    """One request through ``app``; its status."""
    sent = False
    never = asyncio.Event()
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # a client that stays: nothing more comes
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app({**scope, "app": app_of, "headers": list(scope["headers"])}, receive, send)
    return status


class Postgres:
    """CPU of the backends serving one database (their pids from pg_stat_activity)."""

    def __init__(self, conn: Any, dbname: str) -> None:
        self.conn, self.dbname = conn, dbname

    async def cpu_s(self) -> float:
        rows = await self.conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            self.dbname,
        )
        total = 0.0
        for row in rows:
            with contextlib.suppress(OSError, IndexError):
                total += proc_cpu_s(row["pid"])
        return total


async def measure(n: int, one: Callable[[], Awaitable[Any]], pg: Postgres) -> dict[str, float]:
    for _ in range(max(50, n // 10)):  # warm-up: caches, prepared statements, pools
        await one()
    pg0, t0, w0 = await pg.cpu_s(), time.thread_time(), time.perf_counter()
    for _ in range(n):
        await one()
    t1, w1 = time.thread_time(), time.perf_counter()
    pg1 = await pg.cpu_s()
    return {"cpu_us": (t1 - t0) / n * 1e6, "wall_us": (w1 - w0) / n * 1e6,
            "pg_us": max(0.0, pg1 - pg0) / n * 1e6}  # fmt: skip


async def setup(app: Any) -> dict[str, Any]:
    """A run, a contributor and its lease, through the app itself."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
        config = {
            "name": "request-path",
            "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
            "data": {"path": "corpus.txt"},
            "rounds": {"quorum": 2},
        }
        r = await http.post(
            f"{API}/runs",
            data={"config": json.dumps(config)},
            files={"data": ("corpus.txt", make_corpus(100_000))},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        r.raise_for_status()
        run = r.json()
        r = await http.post(f"{API}/contributors", json={"name": "bench"})
        r.raise_for_status()
        token = r.json()["token"]
        r = await http.post(
            f"{API}/runs/{run['id']}/join", headers={"Authorization": f"Bearer {token}"}
        )
        r.raise_for_status()
        return {"run": run, "token": token, "lease": r.json()}


async def new_leases(app: Any, s: dict[str, Any], n: int, pg: Postgres) -> dict[str, float]:
    """n joins that each hand out a new lease: n contributors registered first, each
    joining once (no warm-up beyond the renewals measured before)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
        tokens = []
        for i in range(n):
            r = await http.post(f"{API}/contributors", json={"name": f"joiner-{i}"})
            r.raise_for_status()
            tokens.append(r.json()["token"])
    path = f"{API}/runs/{s['run']['id']}/join"
    joins = iter([request("POST", path, {"Authorization": f"Bearer {t}"}) for t in tokens])

    async def one() -> None:
        scope, body = next(joins)
        assert await call(app, scope, body, app) == 200

    pg0, t0 = await pg.cpu_s(), time.thread_time()
    for _ in range(n):
        await one()
    t1, pg1 = time.thread_time(), await pg.cpu_s()
    return {"cpu_us": (t1 - t0) / n * 1e6, "pg_us": max(0.0, pg1 - pg0) / n * 1e6}


def middlewares() -> list[tuple[str, Any, dict[str, Any]]]:
    """(name, class, keyword arguments) of each middleware this checkout has."""
    found = []
    for name, module, cls, kwargs in (
        ("RequestMetrics", "server.metrics", "RequestMetrics", {}),
        ("RequestId", "server.http.request_id", "RequestId", {}),
        ("HealthCheck (passing on)", "server.http.health", "HealthCheck", {"route": None}),
        ("BodyTimeout", "server.http.body_timeout", "BodyTimeout", {"idle_timeout_s": 30.0}),
        ("BodyLimit", "server.http.body_limit", "BodyLimit", {}),
        ("HeartbeatLane (passing on)", "server.rounds.lane", "HeartbeatLane", {"route": None}),
    ):
        try:
            found.append((name, getattr(importlib.import_module(module), cls), kwargs))
        except (ImportError, AttributeError):
            continue
    return found


async def answer_204(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def bench(args: argparse.Namespace, url: str, dbname: str) -> list[tuple[str, dict]]:
    import asyncpg

    from server.app import create_app
    from server.settings import Settings

    tmp = Path(tempfile.mkdtemp(prefix="diloco-path-"))
    # the API alone: no round work in the background (a server's sweeper runs once a
    # second whatever the load; bench/load.py counts it)
    settings = Settings(data_dir=tmp, database_url=url, rate_register="", role="api")
    app = create_app(settings, admin_token=ADMIN)
    rows: list[tuple[str, dict]] = []
    admin = await asyncpg.connect(plain_dsn(args.database_url))
    pg = Postgres(admin, dbname)
    try:
        async with app.router.lifespan_context(app):
            s = await setup(app)
            auth = {"Authorization": f"Bearer {s['token']}"}
            lease = s["lease"]
            hb_path = f"{API}/runs/{s['run']['id']}/rounds/{lease['round']}/heartbeat"
            hb_body = json.dumps({"lease_id": lease["lease_id"], "step": 3, "loss": 2.5}).encode()
            json_ct = {**auth, "Content-Type": "application/json"}
            # a content type FastAPI accepts and the heartbeat's lane leaves to the route
            via_route = {**auth, "Content-Type": "application/json; charset=utf-8"}
            cases = {
                "unmatched route (404)": request("GET", f"{API}/no-such-endpoint", {}),
                "GET /healthz": request("GET", "/healthz", {}),
                "heartbeat": request("POST", hb_path, json_ct, hb_body),
                "heartbeat through the route": request("POST", hb_path, via_route, hb_body),
            }
            cases["join, the lease renewed"] = request(
                "POST", f"{API}/runs/{s['run']['id']}/join", auth
            )
            for name, (scope, body) in cases.items():
                status = await call(app, scope, body, app)
                assert status in (200, 404), f"{name}: {status}"
                rows.append((name, await measure(
                    args.requests, lambda s=scope, b=body: call(app, s, b, app), pg
                )))  # fmt: skip
            rows.append(("join, a new lease", await new_leases(app, s, args.requests // 4, pg)))
            bare_scope, _ = request("POST", "/x", json_ct, hb_body)
            bare = await measure(
                args.requests, lambda: call(answer_204, bare_scope, hb_body, app), pg
            )
            for name, cls, kwargs in middlewares():
                wrapped = cls(answer_204, **kwargs)
                m = await measure(
                    args.requests, lambda w=wrapped: call(w, bare_scope, hb_body, app), pg
                )
                rows.append((f"middleware {name}", {"cpu_us": m["cpu_us"] - bare["cpu_us"]}))
            rows += await sql_parts(args, app, s, pg)
    finally:
        await admin.close()
    return rows


async def sql_parts(args: argparse.Namespace, app: Any, s: dict, pg: Postgres) -> list:
    """The pool's acquire/release and the heartbeat's statement(s) as this checkout sends them."""
    from datetime import UTC, datetime, timedelta

    from server.auth import hash_token

    pool = app.state.fast_pool
    lease, run_id = s["lease"], s["run"]["id"]
    token_hash = hash_token(s["token"])

    async def acquire() -> None:
        async with pool.acquire():
            pass

    out = [("asyncpg pool acquire + release", await measure(args.requests, acquire, pg))]
    try:  # this checkout: one statement
        from server.rounds.heartbeats import HEARTBEAT

        async def one() -> None:
            now = datetime.now(UTC)
            async with pool.acquire() as conn:
                expires = now + timedelta(seconds=30)
                await conn.fetchrow(HEARTBEAT, token_hash, now, run_id, lease["round"],
                                    lease["lease_id"], expires, 3, 2.5)  # fmt: skip

        out.append(("heartbeat SQL: the one statement (with acquire)",
                    await measure(args.requests, one, pg)))  # fmt: skip
    except ImportError:  # an older checkout: facts, then the renewal
        from server.rounds.leases import HEARTBEAT_FACTS, RENEW

        async def two() -> None:
            now = datetime.now(UTC)
            async with pool.acquire() as conn:
                await conn.fetchrow(HEARTBEAT_FACTS, token_hash, now, run_id, lease["round"],
                                    lease["lease_id"])  # fmt: skip
                await conn.execute(RENEW, lease["lease_id"], now, now + timedelta(seconds=30),
                                   3, 2.5)  # fmt: skip

        out.append(("heartbeat SQL: facts + renewal (with acquire)",
                    await measure(args.requests, two, pg)))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="per case, after a warm-up")
    ap.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("DILOCO_TORCH_THREADS", "1")
    with fresh_database(args.database_url) as (dbname, url):
        from server import migrate
        from server.settings import Settings

        migrate.upgrade(Settings(database_url=url).database_url)
        try:
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                rows = runner.run(bench(args, url, dbname))
        except ImportError:
            rows = asyncio.run(bench(args, url, dbname))
    floor = dict(rows)["unmatched route (404)"]["cpu_us"]
    print(f"{'part':<52s} {'CPU µs':>8s} {'x unmatched':>12s} {'Postgres µs':>12s}")
    for name, m in rows:
        pg = f"{m['pg_us']:12.0f}" if "pg_us" in m else f"{'':12s}"
        print(f"{name:<52s} {m['cpu_us']:8.1f} {m['cpu_us'] / floor:12.2f} {pg}")
    print(f"(each case {args.requests} requests, one at a time, after a warm-up; CPU of the "
          "bench's thread, which runs the app)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(rows), indent=1))


if __name__ == "__main__":
    main()
