"""The parts of bench/load.py beside its main phases: the capacity limits measured at the
same request rate (for context), what watches the idle phase (a load balancer's health
probe, the server's event-loop lag) and its optional profilers."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from load_support import API, Monitor, Recorder, Sample, summarize


async def paced(n: int, interval: float, seconds: float, fn: Any) -> None:
    """n clients calling ``fn()`` every interval, start times spread evenly, for seconds."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    end = start + seconds

    async def one(i: int) -> None:
        due = start + interval * i / n
        while due < end:
            await asyncio.sleep(max(0.0, due - loop.time()))
            await fn()
            due = max(due + interval, loop.time())

    await asyncio.gather(*(one(i) for i in range(n)))


# ---------------------------------------------------------------- limits for context


async def limits(
    args: argparse.Namespace,
    http: aiohttp.ClientSession,
    mon: Monitor,
    n: int,
    db_url: str,
    rate: float,
) -> dict[str, Any]:
    """At ``rate`` requests a second (n clients): the unmatched route and /healthz; then a
    closed loop of one-row UPDATEs."""
    seconds = max(1.0, args.phase_s / 2)
    out: dict[str, Any] = {}
    for name, path in (("floor", f"{API}/no-such-endpoint"), ("healthz", "/healthz")):
        rec = Recorder()
        a = await mon.mark()
        await paced(n, n / rate, seconds, lambda p=path, k=name, r=rec: r.call(http, "GET", p, k))
        b = await mon.mark()
        res = mon.between(a, b)
        stats = summarize(rec.samples, {(404, "not_found")})
        out[name] = (
            stats | res | {"per_server_cpu_s": stats["count"] / max(res["server_cpu_s"], 1e-9)}
        )

    # one indexed one-row UPDATE per statement, closed loop, as fast as asyncpg and Postgres go
    pool = await asyncpg.create_pool(db_url, min_size=10, max_size=10)
    try:
        ids = [r["id"] for r in await pool.fetch("SELECT id FROM leases LIMIT 1000")]
        done = 0
        end = time.monotonic() + seconds

        async def worker(offset: int) -> None:
            nonlocal done
            async with pool.acquire() as conn:
                i = offset
                while time.monotonic() < end:
                    await conn.execute(
                        "UPDATE leases SET last_heartbeat = now() WHERE id = $1", ids[i % len(ids)]
                    )
                    done, i = done + 1, i + 10

        a = await mon.mark()
        await asyncio.gather(*(worker(i) for i in range(10)))
        b = await mon.mark()
        res = mon.between(a, b)
        out["asyncpg_update"] = res | {"count": done, "per_s": done / res["seconds"]}
    finally:
        await pool.close()
    return out


# ---------------------------------------------------------------- watching the idle phase


async def loop_lag(http: aiohttp.ClientSession) -> dict[float, float]:
    """The server's ``diloco_event_loop_lag_seconds`` histogram: upper bound -> count."""
    async with http.get("/metrics") as r:
        text = await r.text()
    found = re.findall(r'^diloco_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)
    return {float(le): float(count) for le, count in found}


def lag_quantiles(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """How late the server's event loop ran its timers between two scrapes: the samples,
    and the bucket bound under which 50%, 99% and all of them fell."""
    delta = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = delta.get(math.inf, 0.0)

    def bound(q: float) -> float:
        return next((le for le, n in delta.items() if total and n >= q * total), math.nan)

    return {
        "samples": total,
        "p50_le_s": bound(0.5),
        "p99_le_s": bound(0.99),
        "max_le_s": bound(1.0),
    }


async def probe_health(base: str, rec: Recorder, every: float, seconds: float) -> None:
    """A load balancer's ``GET /healthz`` every ``every`` seconds for ``seconds``, from a
    process of its own (bench/health_probe.py); its probes are recorded as ``healthz``."""
    probe = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).with_name("health_probe.py")),
        base,
        str(every),
        str(seconds),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await probe.communicate()
    for line in out.decode().splitlines():
        sent, latency, status = json.loads(line)
        rec.samples.append(Sample("healthz", sent, latency, status))


# ---------------------------------------------------------------- optional profilers


async def start_profilers(
    args: argparse.Namespace, http: aiohttp.ClientSession, pid: int, n: int
) -> tuple[subprocess.Popen[bytes] | None, bool]:
    spy = None
    if args.py_spy:
        args.py_spy.mkdir(parents=True, exist_ok=True)
        out = args.py_spy / f"heartbeat-N{n}.txt"
        cmd = [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(args.phase_s)),
            "--rate",
            "100",
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(out),
        ]
        exe = Path(sys.executable).with_name("py-spy")
        cmd[0] = str(exe) if exe.exists() else "py-spy"
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if args.instrument:
        async with http.post("/__profile/reset") as r:
            r.raise_for_status()
    return spy, args.instrument


async def stop_profilers(profiling: Any, http: aiohttp.ClientSession) -> dict[str, Any] | None:
    spy, instrumented = profiling
    if spy is not None:
        try:
            spy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait(timeout=10)
    if not instrumented:
        return None
    async with http.get("/__profile") as r:
        return dict(await r.json())
