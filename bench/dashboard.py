"""Dashboard benchmark: how fast the run page is ready with 200 rounds and 100 contributors.

Starts Postgres (embedded in a temp dir, or the server named by DILOCO_BENCH_DATABASE_URL,
where a fresh database is created and dropped), a real `diloco serve` on it, creates a run
through the API, then seeds its history straight into the database (bulk inserts through
the server's models: 200 closed rounds, every contributor in every round, the open round
with a lease per contributor) and opens the run page in headless Chromium (Debian's), cold,
``--repeat`` times. Prints the time from navigation start until the page marks itself
ready (its first full render, ``performance.mark("dashboard-ready")``), and the size and
time of every API answer the page asks for.

    python bench/dashboard.py [--rounds 200 --contributors 100 --repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from server.contributors.models import Contributor  # noqa: E402
from server.rounds.models import Contribution, Lease, Round  # noqa: E402
from server.runs.models import Run  # noqa: E402
from tests.support.live import ADMIN_TOKEN, ServerProcess  # noqa: E402

API = "/api/v1"
CHROMIUM = os.environ.get("DILOCO_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu",
    "--disable-background-networking", "--disable-component-update",
]  # fmt: skip
NAMES = "alice bob carol dave erin frank grace heidi ivan judy mallory niaj olivia peggy".split()


@contextlib.contextmanager
def database(tmp: Path) -> Iterator[str]:
    """An asyncpg URL of an empty database, removed afterwards."""
    url = os.environ.get("DILOCO_BENCH_DATABASE_URL")
    if not url:
        from server import embedded_pg

        embedded, handle = embedded_pg.start(tmp / "pg")
        try:
            yield embedded
        finally:
            embedded_pg.stop(handle)
        return
    import asyncpg

    admin = url.replace("postgresql+asyncpg://", "postgresql://", 1)
    name = f"diloco_bench_{secrets.token_hex(4)}"

    async def sql(statement: str) -> None:
        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(sql(f'CREATE DATABASE "{name}"'))
    try:
        yield admin.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://") + "/" + name
    finally:
        asyncio.run(sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextlib.contextmanager
def server(tmp: Path, database_url: str) -> Iterator[str]:
    """A real `diloco serve` on loopback (the tests' ``ServerProcess``); its base URL."""
    proc = ServerProcess(data_dir=tmp / "srv", database_url=database_url)
    try:
        yield proc.wait_ready(timeout=120).url
    finally:
        proc.stop()


def create_run(http: httpx.Client, *, contributors: int, max_rounds: int) -> dict:
    config = {
        "name": "shakespeare-small",
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
        "data": {"path": "shakespeare-excerpt.txt", "chunk_size": 4096},
        "inner": {"steps": 50},
        # the open round waits for every contributor: the sweeper leaves the seeded run alone
        "rounds": {"quorum": contributors, "timeout_s": 3600, "max_rounds": max_rounds},
    }
    data = (REPO / "examples/data/shakespeare-excerpt.txt").read_bytes()
    r = http.post(
        f"{API}/runs",
        data={"config": json.dumps(config)},
        files={"data": ("shakespeare-excerpt.txt", data, "text/plain")},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    r.raise_for_status()
    return dict(r.json())


async def _seed(url: str, run: dict, *, rounds: int, contributors: int) -> None:
    from sqlalchemy import delete, insert, update

    from server.db import make_engine

    rng = random.Random(0)
    now = datetime.now(UTC)
    start = now - timedelta(minutes=3 * rounds)
    tokens_each = 50 * 16 * 64
    ids = [f"ctr_{i:012x}" for i in range(contributors)]
    round_rows, lease_rows, contribution_rows = [], [], []
    for index in range(1, rounds + 2):
        opened = start + timedelta(minutes=3 * (index - 1))
        closed = index <= rounds
        members = ids if closed else ids[: contributors // 2]
        eval_loss = 1.5 + 4.0 * math.exp(-index / 40) + rng.uniform(-0.03, 0.03)
        round_rows.append(
            {"run_id": run["id"], "index": index, "state": "closed" if closed else "open",
             "base_version": index - 1, "opened_at": opened,
             "deadline": opened + timedelta(hours=1) if closed else now + timedelta(hours=1),
             "closed_at": opened + timedelta(seconds=170) if closed else None,
             "close_code": "target" if closed else None,
             "close_reason": f"target reached: {contributors} accepted" if closed else None,
             "accepted": len(members) if closed else 0,
             "tokens": len(members) * tokens_each if closed else 0,
             "train_loss": eval_loss + 0.05 if closed else None,
             "eval_loss": eval_loss if closed else None,
             "update_norm": 0.5 * math.exp(-index / 80) if closed else None}
        )  # fmt: skip
        for i, cid in enumerate(ids):
            lease_id = f"lease_{index:06d}{i:010x}"
            lease_rows.append(
                {"id": lease_id, "run_id": run["id"], "round_index": index,
                 "contributor_id": cid, "shard": i % 8, "seed": i, "issued_at": opened,
                 "last_heartbeat": now - timedelta(seconds=rng.uniform(0, 20)) if not closed
                 else opened, "expires_at": now + timedelta(seconds=30) if not closed
                 else opened + timedelta(seconds=30), "last_step": 25, "last_loss": eval_loss}
            )  # fmt: skip
            if cid in members:
                contribution_rows.append(
                    {"id": f"con_{index:06d}{i:010x}", "run_id": run["id"],
                     "round_index": index, "contributor_id": cid, "lease_id": lease_id,
                     "base_version": index - 1, "tokens": tokens_each, "inner_steps": 50,
                     "loss": eval_loss + rng.uniform(0, 0.2), "nbytes": 1, "sha256": "0" * 64,
                     "blob_key": "-", "created_at": opened + timedelta(seconds=120 + i),
                     "aggregated_at": opened + timedelta(seconds=170) if closed else None,
                     "credit": 6.0 * tokens_each * run["n_params"] if closed else 0.0}
                )  # fmt: skip
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:
            names = [f"{NAMES[i % len(NAMES)]}-{i}" for i in range(contributors)]
            await conn.execute(
                insert(Contributor),
                [{"id": cid, "name": name, "token_hash": secrets.token_hex(32),
                  "last_seen_at": now - timedelta(seconds=i), "hardware": {"device": "cuda"}}
                 for i, (cid, name) in enumerate(zip(ids, names, strict=True))],
            )  # fmt: skip
            await conn.execute(delete(Round).where(Round.run_id == run["id"]))
            for table, rows in ((Round, round_rows), (Lease, lease_rows),
                                (Contribution, contribution_rows)):  # fmt: skip
                for i in range(0, len(rows), 2000):
                    await conn.execute(insert(table), rows[i : i + 2000])
            await conn.execute(
                update(Run).where(Run.id == run["id"]).values(checkpoint_version=rounds)
            )
    finally:
        await engine.dispose()


def seed(url: str, run: dict, *, rounds: int, contributors: int) -> None:
    asyncio.run(_seed(url, run, rounds=rounds, contributors=contributors))


def api_figures(http: httpx.Client, run_id: str, current: int) -> list[tuple[str, int, float]]:
    """Each JSON answer the run page asks for: (path, bytes, median seconds of 5)."""
    paths = [f"/runs/{run_id}", f"/runs/{run_id}/rounds",
             f"/runs/{run_id}/rounds/{current}/contributions"]  # fmt: skip
    out = []
    for path in paths:
        times, size = [], 0
        for _ in range(5):
            t0 = time.perf_counter()
            r = http.get(API + path)
            times.append(time.perf_counter() - t0)
            r.raise_for_status()
            size = len(r.content)
        out.append((path, size, statistics.median(times)))
    return out


TRACE = """performance.getEntries().map(e => `${e.entryType} ${e.name.slice(-40)} `
  + `${e.startTime.toFixed(0)}..${(e.responseEnd || e.startTime + e.duration).toFixed(0)}`)
  .join("\\n")"""


def page_ready_seconds(url: str, fragment: str, repeat: int) -> list[float]:
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for _ in range(repeat):
                context = browser.new_context(viewport={"width": 1280, "height": 800})
                page = context.new_page()
                errors: list[str] = []
                page.on("console", lambda m, e=errors: m.type == "error" and e.append(m.text))
                page.goto(f"{url}/{fragment}")
                page.wait_for_selector("body[data-ready='1']", timeout=30_000)
                ms = page.evaluate("performance.getEntriesByName('dashboard-ready')[0].startTime")
                if errors:
                    raise SystemExit(f"console errors: {errors}")
                if os.environ.get("DILOCO_BENCH_TRACE"):
                    print(page.evaluate(TRACE))
                out.append(ms / 1000)
                context.close()
        finally:
            browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--contributors", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp_name:
        tmp = Path(tmp_name)
        with database(tmp) as db, server(tmp, db) as url, httpx.Client(base_url=url) as http:
            run = create_run(http, contributors=args.contributors, max_rounds=args.rounds + 100)
            t0 = time.perf_counter()
            seed(db, run, rounds=args.rounds, contributors=args.contributors)
            print(f"seeded {args.rounds} closed rounds x {args.contributors} contributors "
                  f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
            for path, size, seconds in api_figures(http, run["id"], args.rounds + 1):
                print(f"  GET {API}{path:<44} {size / 1024:8.1f} KiB {seconds * 1000:7.1f} ms")
            times = page_ready_seconds(url, f"#/runs/{run['id']}", args.repeat)
            print(f"run page ready: median {statistics.median(times):.3f} s, "
                  f"max {max(times):.3f} s over {len(times)} cold loads")  # fmt: skip


if __name__ == "__main__":
    main()
