"""bench/load.py's simulated volunteers: N of them sharing one aiohttp session, each doing
what the client does (client/worker.py, client/heartbeating.py): join, heartbeat at the
interval the server advises (``diloco.protocol.heartbeats``), join again when the round
went on without it, upload with retries."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
from load_support import API, Recorder

from diloco.protocol.heartbeats import advised, next_heartbeat
from diloco.protocol.volunteer import (
    LOST_LEASE_CODES,
    RETRY_JOIN_CODES,
    heartbeat_every,
    join_wait,
)


@dataclass
class Volunteer:
    index: int
    auth: dict[str, str]
    lease: dict[str, Any] | None = None
    step: int = 0
    interval: float = 0.0  # the heartbeat interval it follows (the server's advice)
    told: bool = False  # a heartbeat's answer set it (not only a lease)

    def leased(self, lease: dict[str, Any]) -> None:
        self.lease = lease
        self.interval = heartbeat_every(lease["heartbeat_interval_s"])


class Crowd:
    """N volunteers sharing one session; each behaves as client/worker.py and
    client/heartbeating.py do."""

    def __init__(self, http: aiohttp.ClientSession, rec: Recorder, run_id: str):
        self.http, self.rec, self.run_id = http, rec, run_id
        self.volunteers: list[Volunteer] = []
        self.stop_at = math.inf  # loop time; every loop ends once it passes
        self.lags: list[float] = []  # how late each scheduled send went out (generator health)
        self.dice = random.Random(0)  # the volunteers' draws (next_heartbeat)

    def offered_per_s(self) -> float:
        """Heartbeats a second the volunteers' advised intervals ask for."""
        return sum(1 / v.interval for v in self.volunteers if v.lease is not None)

    def intervals(self) -> dict[str, int]:
        """How many volunteers follow each interval (seconds)."""
        return dict(sorted(Counter(f"{v.interval:g}" for v in self.volunteers).items()))

    async def enlist(self, n: int, concurrency: int) -> list[asyncio.Task[None]]:
        """Register and join n contributors, ``concurrency`` requests in flight; each starts
        heartbeating once it has its lease, as the client does (one interval after the
        join). Returns their heartbeat loops."""
        gate = asyncio.Semaphore(concurrency)
        loop = asyncio.get_running_loop()
        lives: list[asyncio.Task[None]] = []

        async def one(i: int) -> None:
            async with gate:
                status, body = await self.rec.call(
                    self.http, "POST", f"{API}/contributors", "register", json={"name": f"v{i}"}
                )
                if status != 201:
                    raise SystemExit(f"register answered {status}: {body}")
                v = Volunteer(i, {"Authorization": f"Bearer {body['token']}"})
                status, body = await self.rec.call(
                    self.http, "POST", f"{API}/runs/{self.run_id}/join", "join", headers=v.auth
                )
                if status != 200:
                    raise SystemExit(f"join answered {status}: {body}")
                v.leased(body)
                self.volunteers.append(v)
                lives.append(asyncio.create_task(self.live(v, loop.time() + v.interval)))

        await asyncio.gather(*(one(i) for i in range(n)))
        self.volunteers.sort(key=lambda v: v.index)
        return lives

    async def live(self, v: Volunteer, first_at: float) -> None:
        """Heartbeat on this volunteer's own schedule, at the interval the server advised
        (``next_heartbeat``, as client/heartbeating.py); join again when the round closed
        without us."""
        loop = asyncio.get_running_loop()
        due = first_at
        while due < self.stop_at:
            await asyncio.sleep(max(0.0, due - loop.time()))
            if loop.time() >= self.stop_at:
                return
            self.lags.append(loop.time() - due)
            wait = await self.heartbeat(v) if v.lease is not None else None
            if wait is None:  # no lease, or it was lost
                v.lease = None
                await self.rejoin(v)
                due = loop.time() + v.interval  # the client sleeps an interval first
                continue
            due += wait
            due = max(due, loop.time())  # fell behind: no burst to catch up

    async def heartbeat(self, v: Volunteer) -> float | None:
        """One heartbeat; seconds until the next, or None: the lease is lost."""
        assert v.lease is not None
        v.step += 1
        status, body = await self.rec.call(
            self.http,
            "POST",
            f"{API}/runs/{self.run_id}/rounds/{v.lease['round']}/heartbeat",
            "heartbeat",
            json={"lease_id": v.lease["lease_id"], "step": v.step, "loss": 3.0},
            headers=v.auth,
        )
        # the client's reaction (diloco.protocol.volunteer): these volunteers never train,
        # so no work is merged late: any lost-lease answer means join again
        lost = status == 409 and isinstance(body, dict) and body.get("error") in LOST_LEASE_CODES
        if lost:
            return None
        advice = advised(body) if status == 200 else None
        v.told = v.told or advice is not None
        v.interval, wait = next_heartbeat(v.interval, advice, self.dice.random())
        return wait

    async def rejoin(self, v: Volunteer) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < self.stop_at:
            status, body = await self.rec.call(
                self.http, "POST", f"{API}/runs/{self.run_id}/join", "join", headers=v.auth
            )
            if status == 200:
                v.leased(body)
                return
            wait = v.interval  # an error: try again later
            if isinstance(body, dict) and body.get("error") in RETRY_JOIN_CODES:
                wait = join_wait(body.get("retry_after_s"))  # as the client waits
            await asyncio.sleep(min(wait, max(0.0, self.stop_at - loop.time())))

    async def upload(self, v: Volunteer, body: bytes) -> None:
        """PUT the body; like the client, retry a 5xx or a connection error with backoff."""
        lease = v.lease
        if lease is None:
            return
        for attempt in range(4):
            status, _ = await self.rec.call(
                self.http,
                "PUT",
                f"{API}/runs/{self.run_id}/rounds/{lease['round']}/contribution",
                "upload",
                data=body,
                timeout=aiohttp.ClientTimeout(total=120, connect=10),
                headers={**v.auth, "Content-Type": "application/octet-stream"},
            )
            if status in (200, 201):
                v.lease = None  # done with this round: the client joins again
                return
            if isinstance(status, int) and status < 500:
                return  # refused: retrying would not help
            await asyncio.sleep(2**attempt)


async def warm_up(crowd: Crowd, *, limit_s: float) -> bool:
    """Until every volunteer heard a heartbeat's advice, then one longest interval more so
    that their new schedules are under way; False if ``limit_s`` passed first."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + limit_s
    while not all(v.told for v in crowd.volunteers):
        if loop.time() > give_up:
            return False
        await asyncio.sleep(0.2)
    longest = max(v.interval for v in crowd.volunteers)
    await asyncio.sleep(min(longest, max(0.0, give_up - loop.time())))
    return True
