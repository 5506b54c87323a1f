"""Each process's pulse: every ``pulse_interval_s`` one statement, on a connection of its
own, counts the hub's live leases. Two things read what it found, and neither waits for
the database itself:

- the heartbeat advice (:meth:`Pulse.interval_for`, ``diloco.protocol.heartbeats``): how
  often a run's volunteers are asked to heartbeat, from the hub's live leases and
  ``heartbeat_budget_per_s``; every join and heartbeat answer names it;
- ``GET /healthz`` (``server.http.health``): healthy while the last probe answered and is
  at most ``stale_after_s`` old (:meth:`Pulse.health`).

Its own connection, not a pooled one: the probe says whether the database answers, and a
pool busy with requests (or a heartbeat load) neither delays it nor makes it fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from diloco.config import RoundsSection
from diloco.protocol.heartbeats import advise_interval
from server.db import asyncpg_dsn
from server.settings import Settings

log = logging.getLogger("diloco.server")

# leases not yet lapsed on rounds not closed, over every run of the hub (the rounds' partial
# index, then the leases of each such round by their unique index)
LIVE_LEASES = """
SELECT count(*) FROM leases l
JOIN rounds r ON r.run_id = l.run_id AND r.index = l.round_index
WHERE r.state <> 'closed' AND l.expires_at > now()
"""
PROBE_TIMEOUT_S = 5.0  # a probe that takes longer failed (the database is not answering)


@dataclass(frozen=True)
class Health:
    """What ``GET /healthz`` says: ``ok``, and ``detail`` (why not), as of ``age_s`` ago."""

    ok: bool
    detail: str
    age_s: float | None  # seconds since the last probe ended; None: none has yet


class Pulse:
    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.dsn = asyncpg_dsn(settings.database_url)
        self.every_s = settings.pulse_interval_s
        self.budget_per_s = settings.heartbeat_budget_per_s
        # a probe older than this is no proof: two probes missed and one timed out
        self.stale_after_s = 2 * self.every_s + PROBE_TIMEOUT_S
        self.clock = clock
        self.live_leases = 0  # the last count that came back
        self.checked_at: float | None = None  # clock() when the last probe ended
        self.error: str | None = None  # what the last probe failed with; None: it answered
        self._conn: asyncpg.Connection | None = None

    async def probe(self) -> None:
        """Count the live leases once (connecting first if need be); record what happened."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                if self._conn is None or self._conn.is_closed():
                    self._conn = await asyncpg.connect(self.dsn)
                self.live_leases = int(await self._conn.fetchval(LIVE_LEASES))
        except Exception as err:  # whatever it was, the database did not answer this probe
            if self.error is None:
                log.warning("pulse: the database did not answer: %r", err)
            self.error = type(err).__name__
            await self._drop()
        else:
            if self.error is not None:
                log.info("pulse: the database answers again")
            self.error = None
        self.checked_at = self.clock()

    async def run(self) -> None:
        """Probe every ``every_s`` until cancelled (the first probe: ``start``)."""
        try:
            while True:
                await asyncio.sleep(self.every_s)
                await self.probe()
        finally:
            await self._drop()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=2)

    def health(self) -> Health:
        if self.checked_at is None:
            return Health(False, "database not checked yet", None)
        age = self.clock() - self.checked_at
        if self.error is not None:
            return Health(False, f"database unreachable: {self.error}", age)
        if age > self.stale_after_s:
            return Health(False, f"database unreachable: no answer for {age:.0f} s", age)
        return Health(True, "", age)

    def interval_for(self, rounds: RoundsSection) -> float:
        """The heartbeat interval to advise a run's volunteers now."""
        return advise_interval(
            configured_s=rounds.heartbeat_interval_s,
            ttl_s=rounds.lease_ttl_s,
            live_leases=self.live_leases,
            budget_per_s=self.budget_per_s,
        )
