"""Load benchmark of the volunteer-facing API: N simulated volunteers against one real server.

For each N (``--volunteers 100,500,1000``) the bench creates a fresh database, starts a real
``diloco serve`` on 127.0.0.1, creates a run (a ~10M-parameter model, a generated corpus,
``quorum = target = K``), registers N contributors and has each join. Then, in one asyncio
process (aiohttp, one ClientSession):

1. idle: every volunteer heartbeats at the interval the server advises, as the client does
   (``diloco.protocol.heartbeats``: the lease's, then each answer's; ``--interval`` is the
   run's own ``[rounds] heartbeat_interval_s``, the shortest the server may advise), first
   heartbeats spread evenly over each lease's interval, each on its own schedule (a
   warm-up first, not counted: until every volunteer follows an answer's advice and one
   longest interval more); a load balancer's ``GET /healthz`` every ``--healthz-every``
   s meanwhile, from a process of its own (bench/health_probe.py);
2. close: heartbeats go on while K volunteers upload real int8 contributions (~10 MB each),
   which closes the round (aggregate, outer step, eval, checkpoint write). Volunteers do
   what the client does (``diloco.protocol.volunteer``): a heartbeat answered ``409
   round_closed`` or ``no_lease`` means join again, and a join answered ``409
   round_closing`` / ``already_contributed`` waits ``retry_after_s``.
   Requests are tagged by send time: ``upload`` (uploads in flight), ``close`` (from the
   last upload's answer to the round's ``closed_at``), ``after`` (rejoined, next round);
3. limits at the idle phase's offered rate, volunteers stopped: an unmatched route (every
   middleware, the router, the 404 handler; no database), ``GET /healthz`` (the pulse's
   last probe, no database), and, closed loop over 10 connections, one indexed one-row
   ``UPDATE`` straight through asyncpg.

Printed per N and phase: latency percentiles, protocol answers and errors by status, the
intervals the server advised, served vs offered rate (offered: the heartbeats a second the
volunteers' advised intervals ask for), server CPU (/proc, all threads) and peak RSS,
Postgres backend CPU of our database, transactions (pg_stat_database), the load
generator's own CPU; then the goals, met or not. Every phase is bounded in time and every
process is stopped by its PID. The bench's own server takes registrations without the
hub's rate limit (``DILOCO_RATE_REGISTER=``): its volunteers all come from 127.0.0.1.

    python bench/load.py [--volunteers 1000,5000] [--phase-s 20] [--interval 2]
                         [--uploaders 4] [--database-url postgresql://...] [--json out.json]
                         [--py-spy DIR] [--instrument] [--small-model]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_crowd import Crowd, warm_up
from load_limits import (
    lag_quantiles,
    limits,
    loop_lag,
    probe_health,
    start_profilers,
    stop_profilers,
)
from load_report import print_goals, print_one
from load_support import (
    API,
    Monitor,
    Recorder,
    contribution_bodies,
    fresh_database,
    http_session,
    server,
    summarize,
)
from load_support import create_run as post_run

from diloco.protocol.messages import ErrorCode
from diloco.protocol.volunteer import (
    RETRY_JOIN_CODES,
)

# one server process, its volunteers heartbeating as the server advises
GOAL = {"volunteers": 5000, "p99_ms": 250.0, "healthz_p99_ms": 100.0}
# answers the protocol gives on purpose around a close; counted apart from errors
PROTOCOL = {(409, ErrorCode.ROUND_CLOSED), *((409, code) for code in RETRY_JOIN_CODES)}
MODEL = {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 128}  # ~10.8M parameters
SMALL_MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}


# ---------------------------------------------------------------- one N: setup and phases


async def bench_one(
    args: argparse.Namespace, n: int, base: str, pid: int, db: tuple[str, str]
) -> dict[str, Any]:
    dbname, db_url = db
    rec = Recorder()
    out: dict[str, Any] = {"volunteers": n, "interval_s": args.interval, "phase_s": args.phase_s}
    limit = n + args.uploaders + 32
    async with http_session(base, limit) as http, Monitor(args.database_url, dbname, pid) as mon:
        crowd, lives, run_id, bodies = await setup(args, n, http, rec, out)
        idle = await idle_phase(args, n, (base, pid), http, rec, mon, crowd, out)
        await close_phase(args, http, rec, mon, (crowd, lives, run_id, bodies), idle, out)
        # phase 3: the limits at the idle phase's offered rate, volunteers stopped
        out["limits"] = await limits(args, http, mon, n, db_url, out["offered_per_s"])
    return out


async def setup(
    args: argparse.Namespace, n: int, http: aiohttp.ClientSession, rec: Recorder, out: dict
) -> tuple[Crowd, list[asyncio.Task[None]], str, list[bytes]]:
    """The run, N contributors, N joins (each heartbeating from then on), the uploads'
    bodies: (the crowd, its heartbeat loops, the run id, the bodies)."""
    run = await create_run(http, rec, args, n)
    out["n_params"] = run["n_params"]
    crowd = Crowd(http, rec, run["id"])
    started = time.time()
    lives = await crowd.enlist(n, concurrency=args.join_concurrency)
    out["setup"] = {
        "seconds": time.time() - started,
        "concurrency": args.join_concurrency,
        "register": summarize([s for s in rec.samples if s.kind == "register"], PROTOCOL),
        "join": summarize([s for s in rec.samples if s.kind == "join"], PROTOCOL),
    }
    lease = crowd.volunteers[0].lease
    assert lease is not None
    bodies = await asyncio.to_thread(contribution_bodies, lease, args.uploaders)
    out["upload_bytes"] = len(bodies[0])
    return crowd, lives, run["id"], bodies


async def idle_phase(
    args: argparse.Namespace,
    n: int,
    where: tuple[str, int],
    http: aiohttp.ClientSession,
    rec: Recorder,
    mon: Monitor,
    crowd: Crowd,
    out: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Phase 1: idle heartbeats, after a warm-up (until every volunteer follows a heartbeat
    answer's advice, then one longest interval more: their new phases); the load
    balancer's probes meanwhile. Returns the monitor's marks at its start and end."""
    base, pid = where
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out["warmed_up"] = await warm_up(crowd, limit_s=args.warm_up_limit_s)
    out["warm_up_s"] = loop.time() - t0
    profiling = await start_profilers(args, http, pid, n)
    crowd.lags.clear()
    rec.samples.clear()
    offered = [crowd.offered_per_s()]
    lag_before = await loop_lag(http)
    start = await mon.mark()
    probing = asyncio.create_task(probe_health(base, rec, args.healthz_every, args.phase_s))
    await asyncio.sleep(args.phase_s)
    end = await mon.mark()
    await probing
    out["server_loop_lag"] = lag_quantiles(lag_before, await loop_lag(http))
    offered.append(crowd.offered_per_s())
    out["offered_per_s"] = sum(offered) / 2  # at the idle phase's start and end
    out["offered_range_per_s"] = offered
    out["advised_s"] = crowd.intervals()
    lags = sorted(crowd.lags)
    out["lag_p99_ms"] = lags[int(0.99 * (len(lags) - 1))] * 1000 if lags else 0.0
    out["profile"] = await stop_profilers(profiling, http)
    return start, end


async def close_phase(
    args: argparse.Namespace,
    http: aiohttp.ClientSession,
    rec: Recorder,
    mon: Monitor,
    work: tuple[Crowd, list[asyncio.Task[None]], str, list[bytes]],
    idle: tuple[dict[str, Any], dict[str, Any]],
    out: dict[str, Any],
) -> None:
    """Phase 2: K uploads close the round while heartbeats go on; then the next round,
    until everyone has had two intervals in it. Every phase's figures go into ``out``."""
    crowd, lives, run_id, bodies = work
    idle_start, idle_end = idle
    uploaders = crowd.volunteers[: args.uploaders]
    upload_start = time.time()
    await asyncio.gather(*(crowd.upload(v, b) for v, b in zip(uploaders, bodies, strict=True)))
    last_upload = max(s.sent + s.latency for s in rec.samples if s.kind == "upload")
    closed_at, seen_closing = await wait_for_close(http, rec, run_id, args.close_timeout_s)
    close_mark = await mon.mark()
    longest = max(v.interval for v in crowd.volunteers)
    if closed_at is not None:
        await asyncio.sleep(max(0.0, closed_at + 2 * longest + 3 - time.time()))
    crowd.stop_at = asyncio.get_running_loop().time()
    end_mark = await mon.mark()
    await asyncio.wait(lives, timeout=longest + 35)
    for task in lives:
        task.cancel()
    out["round_closed"] = closed_at is not None
    out["close_seconds"] = (closed_at - last_upload) if closed_at else None
    out["closing_seen"] = seen_closing
    out["phases"] = tag_phases(
        rec,
        {
            "idle": (idle_start["t"], idle_end["t"]),
            "upload": (upload_start, last_upload),
            "close": (last_upload, closed_at or close_mark["t"]),
            "after": (closed_at or close_mark["t"], end_mark["t"]),
        },
    )
    out["client_errors"] = dict(rec.failures.most_common(5))
    out["idle_resources"] = mon.between(idle_start, idle_end)
    out["close_resources"] = mon.between(idle_end, close_mark)
    out["served_per_s"] = out["phases"]["idle"]["heartbeat"]["ok"] / args.phase_s


async def create_run(
    http: aiohttp.ClientSession, rec: Recorder, args: argparse.Namespace, n: int
) -> dict[str, Any]:
    """A run that closes its round at K accepted contributions, on a generated corpus."""
    rounds = {
        "quorum": args.uploaders,
        "target": args.uploaders,
        "timeout_s": 3600,  # never the reason to close here
        "max_rounds": 10,
        "heartbeat_interval_s": args.interval,  # what the leases tell the volunteers
        "lease_ttl_s": max(30.0, 3 * args.interval),
    }
    model = SMALL_MODEL if args.small_model else MODEL
    return await post_run(http, rec, f"load-{n}", model, rounds)


async def wait_for_close(
    http: aiohttp.ClientSession, rec: Recorder, run_id: str, timeout: float
) -> tuple[float | None, float | None]:
    """Poll the rounds list until round 1 is closed; (its closed_at as a timestamp or None,
    the time a poll first saw it closing)."""
    seen_closing = None
    deadline = time.time() + timeout
    while time.time() < deadline:
        await asyncio.sleep(0.5)
        status, body = await rec.call(http, "GET", f"{API}/runs/{run_id}/rounds", "poll")
        if status != 200:
            continue
        first = body["rounds"][0]
        if first["state"] == "closing" and seen_closing is None:
            seen_closing = time.time()
        if first["state"] == "closed":
            return datetime.fromisoformat(first["closed_at"]).timestamp(), seen_closing
    return None, seen_closing


def tag_phases(rec: Recorder, windows: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Summaries by phase (the window the request was sent in) and kind."""
    out: dict[str, Any] = {}
    for phase, (lo, hi) in windows.items():
        inside = [s for s in rec.samples if lo <= s.sent < hi]
        kinds = sorted({s.kind for s in inside} | {"heartbeat", "healthz"})
        out[phase] = {"seconds": hi - lo} | {
            k: summarize([s for s in inside if s.kind == k], PROTOCOL) for k in kinds
        }
        volunteer = [s for s in inside if s.kind in ("heartbeat", "join")]
        out[phase]["volunteer requests"] = summarize(volunteer, PROTOCOL)
    return out


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--volunteers", default="1000,5000", help="comma-separated Ns")
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds of the idle phase")
    ap.add_argument(
        "--interval",
        type=float,
        default=2.0,
        help="the run's [rounds] heartbeat_interval_s: the shortest the server may advise",
    )
    ap.add_argument(
        "--healthz-every", type=float, default=0.1, help="GET /healthz every this, idle phase"
    )
    ap.add_argument(
        "--warm-up-limit-s", type=float, default=60.0, help="longest warm-up before the idle phase"
    )
    ap.add_argument("--uploaders", type=int, default=4, help="K: uploads that close the round")
    ap.add_argument("--join-concurrency", type=int, default=32)
    ap.add_argument("--close-timeout-s", type=float, default=180.0, help="after the uploads")
    ap.add_argument(
        "--database-url",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="a Postgres server to create (and drop) a database per N on",
    )
    ap.add_argument("--small-model", action="store_true", help="a tiny model (smoke tests)")
    ap.add_argument("--torch-threads", type=int, default=0, help="server's; 0: torch default")
    ap.add_argument(
        "--py-spy",
        type=Path,
        help="record the idle phase with py-spy into DIR (pip install py-spy)",
    )
    ap.add_argument(
        "--instrument",
        action="store_true",
        help="serve through bench/heartbeat_profile.py (CPU per request part)",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()

    results = []
    for n in [int(x) for x in args.volunteers.split(",")]:
        # the bench's volunteers all register from 127.0.0.1: its own server takes them
        # without the hub's registration limit (a setting, DILOCO_RATE_REGISTER; empty: none)
        env = {"DILOCO_TORCH_THREADS": str(args.torch_threads), "DILOCO_RATE_REGISTER": ""}
        with (
            tempfile.TemporaryDirectory(prefix="diloco-load-") as tmp,
            fresh_database(args.database_url) as db,
            server(Path(tmp) / "srv", db[1], env=env, instrumented=args.instrument) as (
                base,
                pid,
            ),
        ):
            result = run_async(bench_one(args, n, base, pid, db))
            result["server_errors"] = server_errors(Path(tmp) / "srv" / "server.log")
        print_one(result, GOAL)
        results.append(result)
        if args.json:  # after every N, so that a cut-off run keeps what it measured
            args.json.write_text(json.dumps({"goal": GOAL, "results": results}, indent=1))
    print_goals(results, GOAL)


def server_errors(log: Path) -> dict[str, int]:
    """The exception lines of the server's tracebacks (what its 5xx answers were), counted."""
    pattern = re.compile(r"^([\w.]+(?:Error|Exception|Timeout)\b.*)$", re.M)
    found = pattern.findall(log.read_text(errors="replace"))
    return dict(Counter(line[:160] for line in found).most_common(5))


def run_async(coro: Any) -> Any:
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except ImportError:
        return asyncio.run(coro)


if __name__ == "__main__":
    main()
