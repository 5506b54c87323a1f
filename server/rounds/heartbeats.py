"""Heartbeats: a lease kept live while its volunteer trains, in one statement.

Every volunteer sends one every few seconds, so the request costs one round trip: one
statement marks the contributor seen (the authentication is inside it), reads every fact
``diloco.protocol.rules.admit_heartbeat`` looks at and, in the same statement, renews the
lease when those facts grant it. The rule then decides the answer from the same facts, and
the two must agree (they are checked against each other on every heartbeat: a
disagreement is a bug, answered 500). The answer names the heartbeat interval to follow
now (``server.pulse.Pulse.interval_for``).

The renewal's expiry needs the run's ``lease_ttl_s``: a run's config never changes once it
is created, so each process reads a run's ``[rounds]`` once and keeps it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from diloco.config import RoundsSection
from diloco.protocol.messages import HeartbeatIn, HeartbeatOut
from diloco.protocol.rules import admit_heartbeat
from diloco.protocol.state import HeartbeatFacts, Refusal, RoundState, RunStatus
from server.auth import hash_token
from server.http.errors import Internal, RunNotFound, refused
from server.pulse import Pulse
from server.rounds.leases import ME, round_view, run_config_of, unknown_or_banned

# One statement: ``me`` (the contributor, marked seen; no row for an unknown token nor a
# banned contributor), ``facts`` (what the rule reads) and ``renewed`` (the lease renewed
# exactly when the rule grants: held, on an open round of an active run). All three see
# the same snapshot.
HEARTBEAT = f"""
WITH {ME},
facts AS (
    SELECT run.status AS run_status, r.index, r.state, r.opened_at, r.deadline, r.extensions,
           (SELECT max(index) FROM rounds WHERE run_id = $3 AND state <> 'closed') AS current,
           EXISTS (SELECT 1 FROM leases l WHERE l.id = $5 AND l.run_id = $3
                   AND l.round_index = $4 AND l.contributor_id = me.id) AS held
    FROM me
    LEFT JOIN runs run ON run.id = $3
    LEFT JOIN rounds r ON r.run_id = $3 AND r.index = $4
),
renewed AS (
    UPDATE leases SET last_heartbeat = $2, expires_at = $6, last_step = $7, last_loss = $8
    FROM facts
    WHERE leases.id = $5 AND facts.held AND facts.run_status = '{RunStatus.ACTIVE.value}'
          AND facts.state = '{RoundState.OPEN.value}'
    RETURNING leases.id
)
SELECT facts.*, EXISTS (SELECT 1 FROM renewed) AS renewed FROM facts
"""
CONFIG = "SELECT config::text FROM runs WHERE id = $1"
log = logging.getLogger("diloco.server")

_ROUNDS: dict[str, RoundsSection] = {}  # run id -> its [rounds] (a run config is immutable)
_ROUNDS_KEPT = 4096  # runs remembered at most; past it, the memory starts over


async def _rounds_of(conn: asyncpg.Connection, run_id: str) -> RoundsSection | None:
    """The run's ``[rounds]``, read once per process; None: no such run."""
    rounds = _ROUNDS.get(run_id)
    if rounds is None:
        config = await conn.fetchval(CONFIG, run_id)
        if config is None:
            return None
        rounds = run_config_of(config).rounds
        if len(_ROUNDS) >= _ROUNDS_KEPT:
            _ROUNDS.clear()
        _ROUNDS[run_id] = rounds
    return rounds


async def heartbeat(
    *,
    pool: asyncpg.Pool,
    pulse: Pulse,
    token: str,
    run_id: str,
    index: int,
    lease_id: str,
    step: int | None,
    loss: float | None,
    now: datetime,
) -> HeartbeatOut:
    """Renew the lease, or the rule's refusal; the answer advises the interval to follow."""
    token_hash = hash_token(token)
    async with pool.acquire() as conn:
        rounds = await _rounds_of(conn, run_id)
        # no such run: nothing can be renewed, and the facts say who is refused how
        expires_at = now + timedelta(seconds=rounds.lease_ttl_s if rounds else 0.0)
        row = await conn.fetchrow(
            HEARTBEAT, token_hash, now, run_id, index, lease_id, expires_at, step, loss
        )
        if row is None:
            raise await unknown_or_banned(conn, token_hash)
    if row["run_status"] is None or rounds is None:
        raise RunNotFound(f"no run {run_id!r}; GET /api/v1/runs lists the runs")
    rnd = round_view(row)
    facts = HeartbeatFacts(RunStatus(row["run_status"]), rnd, row["current"], row["held"])
    grant = admit_heartbeat(now, facts, ttl_s=rounds.lease_ttl_s)
    if row["renewed"] == isinstance(grant, Refusal) or (
        not isinstance(grant, Refusal) and grant.expires_at != expires_at
    ):
        bug = (
            f"heartbeat on run {run_id} round {index}: the statement (renewed: "
            f"{row['renewed']}) and admit_heartbeat ({grant}) disagree; this is a bug"
        )
        log.error(bug)
        raise Internal(bug)
    if isinstance(grant, Refusal):
        raise refused(grant)
    assert rnd is not None
    return HeartbeatOut(
        lease_expires_at=grant.expires_at,
        round_state=rnd.state,
        deadline=rnd.deadline,
        heartbeat_interval_s=pulse.interval_for(rounds),
    )


async def answer(
    state: Any, *, token: str, run_id: str, index: int, beat: HeartbeatIn
) -> HeartbeatOut:
    """``heartbeat`` with the app's pools and pulse (``state``: ``app.state``), as the route
    and its fast lane (``server.rounds.lane``) both answer it."""
    return await heartbeat(
        pool=state.fast_pool,
        pulse=state.pulse,
        token=token,
        run_id=run_id,
        index=index,
        lease_id=beat.lease_id,
        step=beat.step,
        loss=beat.loss,
        now=datetime.now(UTC),
    )
