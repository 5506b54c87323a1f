"""Helpers of bench/load.py: a fresh database, a real server, /proc readers, request records,
a generated corpus, a run on it and contribution bodies. Nothing here knows about phases
or goals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
from procstat import proc_cpu_s, rss_mib, self_cpu_s, total_cpu_s

REPO = Path(__file__).resolve().parents[1]
API = "/api/v1"
ADMIN = "adm_loadbench"


# ---------------------------------------------------------------- database and server


def plain_dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


@contextlib.contextmanager
def fresh_database(admin_url: str) -> Iterator[tuple[str, str]]:
    """(name, URL) of a new empty database on the server of ``admin_url``; dropped after."""
    admin = plain_dsn(admin_url)
    name = f"diloco_load_{secrets.token_hex(4)}"

    async def sql(statement: str) -> None:
        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(sql(f'CREATE DATABASE "{name}"'))
    try:
        yield name, urlunsplit(urlsplit(admin)._replace(path=f"/{name}"))
    finally:
        asyncio.run(sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(
    data_dir: Path, database_url: str, *, env: dict[str, str], instrumented: bool = False
) -> Iterator[tuple[str, int]]:
    """A real server on 127.0.0.1: ``diloco serve``, or the same app with per-part CPU
    accounting (bench/heartbeat_profile.py serve). Yields (base URL, pid); stopped by PID."""
    port = free_port()
    if instrumented:
        cmd = [sys.executable, str(REPO / "bench/heartbeat_profile.py"), "serve"]
    else:
        cmd = [sys.executable, "-m", "client.cli", "serve"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)]
    cmd += ["--database-url", database_url]
    data_dir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "DILOCO_ADMIN_TOKEN": ADMIN, **env}
    with open(data_dir / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (data_dir / "server.log").read_text(errors="replace")[-2000:]
                    raise SystemExit(f"the server did not start:\n{tail}")
                time.sleep(0.2)
            yield url, proc.pid
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


# ---------------------------------------------------------------- CPU and memory


class Monitor:
    """Samples, every ``every`` seconds: the server's RSS, and the CPU of the Postgres
    backends serving our database (found in pg_stat_activity, read from /proc), plus that
    database's transaction count. ``mark()`` returns a snapshot; ``between(a, b)`` the deltas."""

    def __init__(self, admin_url: str, dbname: str, server_pid: int, every: float = 0.5) -> None:
        self.admin, self.dbname = plain_dsn(admin_url), dbname
        self.pid, self.every = server_pid, every
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()  # one connection: the timer and mark() take turns

    async def __aenter__(self) -> Monitor:
        self._conn = await asyncpg.connect(self.admin)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None and self._conn is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._conn.close()

    async def _run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.every)

    async def sample(self) -> dict[str, Any]:
        async with self._lock:
            return await self._sample()

    async def _sample(self) -> dict[str, Any]:
        assert self._conn is not None
        rows = await self._conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1", self.dbname
        )
        xacts = await self._conn.fetchval(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1",
            self.dbname,
        )
        backends = {}
        for row in rows:
            # a backend that just exited, or a Postgres on another machine (then: nan)
            with contextlib.suppress(OSError, IndexError):
                backends[row["pid"]] = proc_cpu_s(row["pid"])
        s = {
            "t": time.time(),
            "server_cpu": total_cpu_s(self.pid),  # with its fold process
            "rss": rss_mib(self.pid),
            "backends": backends,
            "xacts": int(xacts or 0),
            "gen_cpu": self_cpu_s(),
        }
        self.samples.append(s)
        return s

    async def mark(self) -> dict[str, Any]:
        return await self.sample()

    def between(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
        inside = [s for s in self.samples if a["t"] <= s["t"] <= b["t"]]
        pg = 0.0
        for pid in {p for s in inside for p in s["backends"]}:
            seen = [s["backends"][pid] for s in inside if pid in s["backends"]]
            pg += seen[-1] - a["backends"].get(pid, 0.0)
        if not any(s["backends"] for s in inside):
            pg = float("nan")  # no backend of ours could be read from /proc
        return {
            "seconds": b["t"] - a["t"],
            "server_cpu_s": b["server_cpu"] - a["server_cpu"],
            "postgres_cpu_s": pg,
            "generator_cpu_s": b["gen_cpu"] - a["gen_cpu"],
            "rss_peak_mib": max(s["rss"] for s in inside),
            "transactions": b["xacts"] - a["xacts"],
        }


# ---------------------------------------------------------------- requests and their records


@dataclass(slots=True)
class Sample:
    kind: str  # join, heartbeat, upload, register, floor, healthz, poll
    sent: float  # wall clock (time.time()) when the request was sent
    latency: float  # seconds until the whole answer was read
    status: int | str  # HTTP status, or the exception's class name
    code: str | None = None  # the answer's "error" field, if any


@dataclass
class Recorder:
    samples: list[Sample] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)  # connection errors, by message

    async def call(
        self, http: aiohttp.ClientSession, method: str, url: str, kind: str, **kw: Any
    ) -> tuple[int | str, Any]:
        """One request, recorded; (status, parsed JSON body or None). Never raises on
        HTTP or connection errors: they are data here."""
        sent, start = time.time(), time.perf_counter()
        body: Any = None
        try:
            async with http.request(method, url, **kw) as r:
                raw = await r.read()
                status: int | str = r.status
                with contextlib.suppress(ValueError):  # a heartbeat's 200 advises the interval
                    body = json.loads(raw) if raw else None
        except TimeoutError:
            status = "timeout"
        except aiohttp.ClientError as err:
            status = type(err).__name__
            self.failures[f"{status}: {err}"[:160]] += 1
        code = body.get("error") if isinstance(body, dict) else None
        self.samples.append(Sample(kind, sent, time.perf_counter() - start, status, code))
        return status, body


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def summarize(samples: list[Sample], expected: AbstractSet[tuple[int, str]]) -> dict[str, Any]:
    """Count, latency percentiles (ms), 2xx, expected protocol answers and errors by kind."""
    lat = sorted(s.latency * 1000 for s in samples)
    ok = sum(1 for s in samples if isinstance(s.status, int) and s.status < 300)
    protocol: dict[str, int] = {}
    errors: dict[str, int] = {}
    for s in samples:
        if isinstance(s.status, int) and s.status < 300:
            continue
        key = f"{s.status} {s.code}" if s.code else str(s.status)
        bucket = protocol if (s.status, s.code or "") in expected else errors
        bucket[key] = bucket.get(key, 0) + 1
    return {
        "count": len(samples),
        "ok": ok,
        "p50_ms": percentile(lat, 50),
        "p95_ms": percentile(lat, 95),
        "p99_ms": percentile(lat, 99),
        "max_ms": lat[-1] if lat else float("nan"),
        "protocol_409s": protocol,
        "errors": errors,
        "n_errors": sum(errors.values()),
    }


# ---------------------------------------------------------------- run inputs

WORDS = (
    "the of and to in is was that for it with as his on be at by had are but from or this "
    "which one were all we when there can an your so will each about how up out them then "
    "she many some would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back"
).split()


def make_corpus(n_bytes: int, seed: int = 0) -> bytes:
    """Pseudo-English sentences: enough structure for a byte-level model, no download."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < n_bytes:
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        line = " ".join(words).capitalize() + ".\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)[:n_bytes].encode()


def lease_frame(lease: dict[str, Any]) -> tuple[Any, dict[str, tuple[int, ...]], Any]:
    """What an upload for ``lease`` is framed by: the run's config, its model's parameter
    shapes, and the header a volunteer's client would send (its codec the run's; a replay
    record that says fresh: the benches' random Δs would fail a replay)."""
    import torch

    from diloco.config import parse_config
    from diloco.model.architectures import build_model
    from diloco.train import parameters_of
    from diloco.wire.contribution import ContributionMeta
    from diloco.wire.exchange import codec_for
    from diloco.wire.header import FRESH, ReplayRecord

    cfg = parse_config(lease["config"])
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in parameters_of(build_model(cfg.model)).items()}
    tokens = cfg.inner.batch_size * cfg.model.block_size * lease["inner_steps"]
    meta = ContributionMeta(
        lease["run_id"], lease["round"], lease["base_version"], tokens, lease["inner_steps"],
        3.0, codec_for(cfg.compression).describe(), ReplayRecord(FRESH, "fp32", 1),
    )  # fmt: skip
    return cfg, shapes, meta


def contribution_bodies(lease: dict[str, Any], k: int) -> list[bytes]:
    """K valid contribution bodies for the lease's round: random small Δs (finite values,
    the run's shapes) encoded with the run's codec, as a volunteer's client would send."""
    import torch

    from diloco.wire.contribution import encode_contribution
    from diloco.wire.exchange import encode_delta

    cfg, shapes, meta = lease_frame(lease)
    bodies = []
    for i in range(k):
        gen = torch.Generator().manual_seed(i)
        delta = {n: torch.randn(shape, generator=gen) * 1e-3 for n, shape in shapes.items()}
        encoded, _, _ = encode_delta(delta, cfg.compression)
        bodies.append(b"".join(encode_contribution(meta, encoded)))
    return bodies


async def create_run(
    http: aiohttp.ClientSession,
    rec: Recorder,
    name: str,
    model: dict,
    rounds: dict,
    extra: dict | None = None,
) -> dict[str, Any]:
    """A run of ``model`` with these ``[rounds]`` (and ``extra`` sections) on a generated
    corpus, its uploads neither scored nor audited (the benches' Δs are random: they lower
    no loss and would not replay); the run as the API answers it."""
    config = {
        "name": name,
        "model": model,
        "data": {"path": "corpus.txt"},
        "inner": {"steps": 10},
        "rounds": rounds,
        "aggregation": {"score_windows": 0},
        "audit": {"fraction": 0.0},
        **(extra or {}),
    }
    form = aiohttp.FormData()
    form.add_field("config", json.dumps(config))
    form.add_field("data", make_corpus(300_000), filename="corpus.txt")
    status, run = await rec.call(
        http, "POST", f"{API}/runs", "create", data=form,
        headers={"Authorization": f"Bearer {ADMIN}"}, timeout=aiohttp.ClientTimeout(total=300),
    )  # fmt: skip
    if status != 201:
        raise SystemExit(f"creating the run answered {status}: {run}")
    return dict(run)


@contextlib.asynccontextmanager
async def http_session(base_url: str, limit: int) -> AsyncIterator[aiohttp.ClientSession]:
    """The one client session: a pool big enough for every volunteer, explicit timeouts, and
    a keep-alive well under uvicorn's 5 s so that we never reuse a connection it closed:
    at 4 s, a generator running late (its event loop is on the same busy machine) sent
    heartbeats on connections the server had just closed (connection reset, cannot write
    request body)."""
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=30, connect=10)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as http:
        yield http
