"""``bench/heartbeat_profile.py sql``: the SQL one heartbeat sends. A real ``diloco serve``
talks to Postgres through a small proxy here that reads the client's protocol messages
(Query, Parse, Bind, Execute, Sync), so every statement, transaction and round trip is
counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

SSL_REQUEST, GSS_REQUEST = 80877103, 80877104

Log = list[tuple[int, str, str]]  # (connection, message type, SQL)


class PgProxy:
    """127.0.0.1 TCP proxy to Postgres that logs the client's protocol messages. It refuses
    TLS (answers 'N'), so that the messages can be read."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.log: Log = []
        self.connections = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        cid = self.connections = self.connections + 1
        ureader, uwriter = await asyncio.open_connection(*self.upstream)

        async def downstream() -> None:
            while data := await ureader.read(65536):
                cwriter.write(data)
                await cwriter.drain()
            cwriter.close()

        task = asyncio.create_task(downstream())
        statements: dict[str, str] = {}
        try:
            while True:  # startup: SSL/GSS requests are refused here, the rest forwarded
                head = await creader.readexactly(8)
                length, code = struct.unpack("!ii", head)
                rest = await creader.readexactly(length - 8)
                if code in (SSL_REQUEST, GSS_REQUEST):
                    cwriter.write(b"N")
                    await cwriter.drain()
                    continue
                uwriter.write(head + rest)
                break
            while True:
                head = await creader.readexactly(5)
                body = await creader.readexactly(int.from_bytes(head[1:], "big") - 4)
                uwriter.write(head + body)
                await uwriter.drain()
                self._record(cid, chr(head[0]), body, statements)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            uwriter.close()
            task.cancel()

    def _record(self, cid: int, kind: str, body: bytes, statements: dict[str, str]) -> None:
        parts = body.split(b"\0")
        if kind == "Q":
            self.log.append((cid, "Q", parts[0].decode()))
        elif kind == "P":
            statements[parts[0].decode()] = parts[1].decode()
            self.log.append((cid, "P", parts[1].decode()))
        elif kind == "B":
            self.log.append((cid, "B", statements.get(parts[1].decode(), "?")))
        elif kind in "ESDCH":
            self.log.append((cid, kind, ""))


def count_round_trips(log: Log) -> dict[str, Any]:
    """Statements executed (Bind or simple Query), transactions, round trips (each Sync or
    Query waits for ReadyForQuery), statement preparations, connections used."""
    executed = [sql for _, kind, sql in log if kind in "BQ"]
    control = re.compile(r"^\s*(BEGIN|COMMIT|ROLLBACK)", re.I)
    return {
        "round_trips": sum(1 for _, kind, _ in log if kind in "SQ"),
        "statements": [s for s in executed if not control.match(s)],
        "begin": sum(1 for s in executed if re.match(r"^\s*BEGIN", s, re.I)),
        "commit": sum(1 for s in executed if re.match(r"^\s*COMMIT", s, re.I)),
        "rollback": sum(1 for s in executed if re.match(r"^\s*ROLLBACK", s, re.I)),
        "prepares": sum(1 for _, kind, _ in log if kind == "P"),
        "connections": len({cid for cid, _, _ in log}),
    }


async def _join(http: aiohttp.ClientSession) -> tuple[dict[str, str], str, str]:
    """A run of one tiny model, and a volunteer's lease in it: the volunteer's auth header,
    its heartbeat URL and its lease id."""
    import aiohttp
    from load_support import ADMIN, API, make_corpus

    config = {
        "name": "sql-count",
        "data": {"path": "corpus.txt"},
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
        "rounds": {"quorum": 1, "timeout_s": 3600},
    }
    form = aiohttp.FormData()
    form.add_field("config", json.dumps(config))
    form.add_field("data", make_corpus(100_000), filename="corpus.txt")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with http.post(f"{API}/runs", data=form, headers=admin) as r:
        run = await r.json()
    async with http.post(f"{API}/contributors", json={"name": "sql"}) as r:
        auth = {"Authorization": f"Bearer {(await r.json())['token']}"}
    async with http.post(f"{API}/runs/{run['id']}/join", headers=auth) as r:
        lease = await r.json()
    url = f"{API}/runs/{run['id']}/rounds/{lease['round']}/heartbeat"
    return auth, url, lease["lease_id"]


async def _heartbeats(
    http: aiohttp.ClientSession, proxy: PgProxy, heartbeats: int
) -> list[tuple[dict[str, Any], Log]]:
    """Send ``heartbeats`` heartbeats of one lease; each one's counts and protocol log."""
    auth, url, lease_id = await _join(http)
    counts = []
    for i in range(heartbeats):
        await asyncio.sleep(0.05)
        proxy.log.clear()
        async with http.post(url, json={"lease_id": lease_id, "step": i}, headers=auth) as r:
            assert r.status == 200, await r.text()
        await asyncio.sleep(0.05)  # let the proxy log what followed (rollback)
        counts.append((count_round_trips(proxy.log), list(proxy.log)))
    return counts


async def _sql(args: argparse.Namespace, db_name: str, db_url: str) -> None:
    import aiohttp
    from load_support import server

    host, port = re.match(r".*@([^:/]+):?(\d+)?/", db_url).groups()  # type: ignore[union-attr]
    proxy = PgProxy(host, int(port or 5432))
    proxy_port = await proxy.start()
    via_proxy = re.sub(r"@[^/]+/", f"@127.0.0.1:{proxy_port}/", db_url)
    env = {"DILOCO_SWEEP_INTERVAL_S": "3600"}  # one sweep at start, then quiet
    with tempfile.TemporaryDirectory() as tmp:
        # the server runs in a thread-free child process; this loop must keep serving the proxy
        ctx = server(Path(tmp) / "srv", via_proxy, env=env)
        base, _ = await asyncio.to_thread(ctx.__enter__)
        try:
            async with aiohttp.ClientSession(base) as http:
                counts = await _heartbeats(http, proxy, args.heartbeats)
        finally:
            await asyncio.to_thread(ctx.__exit__, None, None, None)
    _print_counts(counts, args.heartbeats)


def _print_counts(counts: list[tuple[dict[str, Any], Log]], heartbeats: int) -> None:
    """The last heartbeat's messages and counts, and the round trips of all but the first."""
    last, log = counts[-1]
    print(
        f"one heartbeat (the last of {heartbeats}, pool and statement caches warm), "
        "client protocol messages in order (connection, type, SQL):"
    )
    for cid, kind, sql in log:
        print(f"  c{cid} {kind}  {' '.join(sql.split())[:110]}")
    print(
        f"statements: {len(last['statements'])} "
        f"({sum(1 for s in last['statements'] if s.strip() == ';')} of them ';' pool pings)"
    )
    print(
        f"transactions: BEGIN {last['begin']}, COMMIT {last['commit']}, "
        f"ROLLBACK {last['rollback']}; round trips {last['round_trips']}; prepares "
        f"{last['prepares']}; connections {last['connections']}"
    )
    per = [c["round_trips"] for c, _ in counts[1:]]
    print(
        f"round trips per heartbeat over heartbeats 2..{heartbeats}: min {min(per)}, max {max(per)}"
    )


def sql(args: argparse.Namespace) -> None:
    from load_support import fresh_database

    with fresh_database(args.database_url) as (name, url):
        asyncio.run(_sql(args, name, url))
