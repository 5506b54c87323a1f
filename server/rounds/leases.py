"""Leases: a contributor's claim on a round. ``join`` hands one out (or renews it),
heartbeats keep it live (``server.rounds.heartbeats``), ``release`` gives it up early so
that a round waiting only for this contributor can close (decide_close counts live leases
of contributors that have not contributed yet as outstanding). The rules are
``diloco.protocol.rules``; this module fetches their facts and persists their decisions.

Heartbeats and joins are what every volunteer sends every few seconds (and every volunteer
at once when a round closes), so they take a short path: fixed SQL on a small asyncpg pool,
no ORM objects and no transaction; one statement reads every fact the rule needs, then at
most two indexed writes. ``release`` is rare and goes through SQLAlchemy like the rest.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from datetime import datetime
from functools import lru_cache
from typing import Any

import asyncpg
from sqlalchemy import func, update
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.config import RunConfig, parse_config
from diloco.protocol.messages import CheckpointRef, DataRange, Lease, ShardRef
from diloco.protocol.rules import admit_join, assign_lease
from diloco.protocol.state import (
    JoinFacts,
    JoinGrant,
    LeasePolicy,
    LeaseView,
    Refusal,
    RoundState,
    RoundView,
    RunStatus,
)
from server.auth import UNKNOWN_TOKEN, banned, banned_from_run, hash_token
from server.checkpoints import service as checkpoints_service
from server.http.errors import (
    HubError,
    Internal,
    NoLease,
    NotInvited,
    RunNotFound,
    Unauthorized,
    refused,
)
from server.pulse import Pulse
from server.rounds import service as rounds_service
from server.rounds import sizing
from server.rounds.direct import upload_target
from server.rounds.models import Lease as LeaseRow
from server.runs import coverage
from server.settings import Settings
from server.storage import keys
from server.storage.base import Storage
from server.storage.files import read_url

API = "/api/v1"


# ---------------------------------------------------------------- the short path's SQL
# Fixed statements on the asyncpg pool (``server.db.make_fast_pool``): asyncpg prepares each
# once per connection. The first statement of each request reads every fact the rule needs
# and marks the contributor seen (``me``: refused or not, the action counts); no row comes
# back for an unknown token nor for a banned contributor (``refusal`` then says which, off
# the hot path). Column names are the models' (tests/test_migrations.py pins
# the schema to them).

ME = """me AS (UPDATE contributors SET last_seen_at = $2
        WHERE token_hash = $1 AND banned_at IS NULL RETURNING id)"""

JOIN_FACTS = f"""
WITH {ME},
cur AS (SELECT max(index) AS index FROM rounds WHERE run_id = $3 AND state <> 'closed')
SELECT me.id AS contributor_id, run.status AS run_status, run.seed AS run_seed, run.n_shards,
       run.chunk_len, run.shards::text AS shards, run.config::text AS config,
       run.dataset_id, run.token_dtype,
       r.index, r.state, r.opened_at, r.deadline, r.extensions,
       l.id AS lease_id, l.shard, l.unit, l.seed, l.last_heartbeat, l.expires_at,
       c.version, c.sha256, c.nbytes, c.full_files_at IS NOT NULL AS full_durable,
       run.invite_hash IS NOT NULL AS private,
       EXISTS (SELECT 1 FROM run_members m WHERE m.run_id = $3
               AND m.contributor_id = me.id) AS member,
       (SELECT b.reason FROM run_bans b WHERE b.run_id = $3
               AND b.contributor_id = me.id) AS run_ban,
       EXISTS (SELECT 1 FROM contributions x WHERE x.run_id = $3
               AND x.round_index = r.index AND x.contributor_id = me.id) AS contributed
FROM me
LEFT JOIN runs run ON run.id = $3
LEFT JOIN cur ON true
LEFT JOIN rounds r ON r.run_id = $3 AND r.index = cur.index
LEFT JOIN leases l ON l.run_id = $3 AND l.round_index = r.index AND l.contributor_id = me.id
LEFT JOIN checkpoints c ON c.run_id = $3 AND c.version = r.index - 1
"""
NEXT_ORDINAL = """
UPDATE rounds SET leases_issued = leases_issued + 1
WHERE run_id = $1 AND index = $2 AND state = 'open'
RETURNING leases_issued - 1
"""
NEW_LEASE = """
INSERT INTO leases (id, run_id, round_index, contributor_id, shard, seed, issued_at,
                    last_heartbeat, expires_at, unit, inner_steps)
VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8, $9, $10)
ON CONFLICT ON CONSTRAINT uq_leases_run_id_round_index_contributor_id
DO UPDATE SET last_heartbeat = EXCLUDED.last_heartbeat, expires_at = EXCLUDED.expires_at
RETURNING id, shard, unit, seed, expires_at, inner_steps
"""
RENEW_LEASE = """
UPDATE leases SET last_heartbeat = $2, expires_at = $3 WHERE id = $1
RETURNING id, shard, unit, seed, expires_at, inner_steps
"""
BAN = "SELECT banned_at, ban_reason FROM contributors WHERE token_hash = $1"


async def unknown_or_banned(conn: asyncpg.Connection, token_hash: str) -> HubError:
    """Why ``me`` matched no one: a banned contributor (403 banned), else an unknown token."""
    row = await conn.fetchrow(BAN, token_hash)
    if row is not None and row["banned_at"] is not None:
        return banned(row["ban_reason"])
    return Unauthorized(UNKNOWN_TOKEN)


def round_view(row: asyncpg.Record) -> RoundView | None:
    if row["state"] is None:
        return None
    return RoundView(
        index=row["index"],
        opened_at=row["opened_at"],
        deadline=row["deadline"],
        state=RoundState(row["state"]),
        extensions=row["extensions"],
    )


# ---------------------------------------------------------------- joining


async def join(
    *,
    pool: asyncpg.Pool,
    settings: Settings,
    storage: Storage,
    pulse: Pulse,
    token: str,
    run_id: str,
    now: datetime,
    tokens_per_s: float | None = None,
) -> Lease:
    """A lease on the run's open round (a new one, or the contributor's own renewed), or the
    rule's refusal. No transaction: one statement reads every fact; a new lease then takes
    the round's next ordinal (an atomic counter), its H is sized to the volunteer's speed
    (``tokens_per_s`` it reported, else what the server measured: ``server.rounds.sizing``)
    and it is inserted. A renewed lease keeps its H. The lease advises the heartbeat
    interval to follow (``server.pulse.Pulse.interval_for``)."""
    async with pool.acquire() as conn:
        token_hash = hash_token(token)
        row = await conn.fetchrow(JOIN_FACTS, token_hash, now, run_id)
        if row is None:
            raise await unknown_or_banned(conn, token_hash)
        _may_join(row, run_id)
        cfg = run_config_of(row["config"])
        view = round_view(row)
        held = None
        if row["lease_id"] is not None:
            held = LeaseView(
                contributor_id=row["contributor_id"],
                last_heartbeat=row["last_heartbeat"],
                expires_at=row["expires_at"],
                shard=row["shard"],
                seed=row["seed"],
            )
        facts = JoinFacts(RunStatus(row["run_status"]), view, row["contributed"], held)
        policy = LeasePolicy.of(
            ttl_s=cfg.rounds.lease_ttl_s,
            n_shards=row["n_shards"],
            sweep_interval_s=settings.sweep_interval_s,
        )
        grant = admit_join(now, facts, policy)
        if isinstance(grant, Refusal):
            raise refused(grant)
        assert view is not None and row["version"] is not None  # a grant names the open round
        if grant.new_lease:
            lease = await _new_lease(
                conn, run_id, row, facts, policy, grant, cfg=cfg, tokens_per_s=tokens_per_s,
                now=now,
            )  # fmt: skip
        else:
            lease = await conn.fetchrow(RENEW_LEASE, row["lease_id"], now, grant.expires_at)
        unit = None
        if lease["unit"] is not None:
            unit = await conn.fetchrow(coverage.UNIT_OF, run_id, lease["unit"])
    interval = pulse.interval_for(cfg.rounds)
    return lease_answer(
        settings, storage, run_id, view, row, lease, unit, now, heartbeat_interval_s=interval
    )


def _may_join(row: asyncpg.Record, run_id: str) -> None:
    """Who may join at all, before the rule looks at the work: the run exists, the
    contributor is not banned from it, and a private run's contributor is its member."""
    if row["run_status"] is None:
        raise RunNotFound(f"no run {run_id!r}; GET /api/v1/runs lists the runs")
    if row["run_ban"] is not None:
        raise banned_from_run(run_id, row["run_ban"])
    if row["private"] and not row["member"]:
        raise NotInvited(
            f"run {run_id} is private: join it with the invite code its owner gave you "
            f"(POST /api/v1/runs/{run_id}/members, or diloco join --invite CODE)"
        )


async def _new_lease(
    conn: asyncpg.Connection,
    run_id: str,
    row: asyncpg.Record,
    facts: JoinFacts,
    policy: LeasePolicy,
    grant: JoinGrant,
    *,
    cfg: RunConfig,
    tokens_per_s: float | None,
    now: datetime,
) -> asyncpg.Record:
    """Insert the new lease the rule granted: the round's next ordinal, its shard and seed
    (or a dataset run's least trained unit), its H sized to the volunteer's speed."""
    view = facts.round
    assert view is not None
    ordinal = await conn.fetchval(NEXT_ORDINAL, run_id, view.index)
    if ordinal is None:  # it started closing since we looked: the rule says so
        closing = dataclasses.replace(view, state=RoundState.CLOSING)
        late = admit_join(now, dataclasses.replace(facts, round=closing), policy)
        assert isinstance(late, Refusal)
        raise refused(late)
    work = assign_lease(
        ordinal, round=view.index, run_seed=row["run_seed"], n_shards=row["n_shards"]
    )
    shard, unit = work.shard, None
    if row["dataset_id"] is not None:  # the data least trained on (server.runs.coverage)
        unit = await conn.fetchrow(coverage.PICK_UNIT, run_id, now)
        if unit is None:
            raise Internal(f"run {run_id} has no data units; it cannot hand out leases")
        shard = unit["shard"]
    sized = await sizing.size_new_lease(
        conn,
        cfg=cfg,
        run_id=run_id,
        contributor_id=row["contributor_id"],
        dataset=row["dataset_id"] is not None,
        reported=tokens_per_s,
        now=now,
        deadline=view.deadline,
    )
    return await conn.fetchrow(
        NEW_LEASE,
        f"lease_{secrets.token_hex(8)}",
        run_id,
        view.index,
        row["contributor_id"],
        shard,
        work.seed,
        now,
        grant.expires_at,
        None if unit is None else unit["unit"],
        sized.steps,
    )


def lease_answer(
    settings: Settings,
    storage: Storage,
    run_id: str,
    rnd: RoundView,
    row: asyncpg.Record,
    lease: asyncpg.Record,
    unit: asyncpg.Record | None,
    now: datetime,
    *,
    heartbeat_interval_s: float | None = None,
) -> Lease:
    """The lease's answer; ``heartbeat_interval_s``: the advice (None: the run's own)."""
    config, shards = _parsed(row["config"], row["shards"])
    cfg = run_config_of(row["config"])
    shard = shards[lease["shard"]]
    version, index = row["version"], lease["shard"]
    dataset = row["dataset_id"]
    return Lease(
        lease_id=lease["id"],
        run_id=run_id,
        round=rnd.index,
        base_version=rnd.base_version,
        checkpoint=CheckpointRef(
            version=version,
            url=checkpoints_service.params_url(
                settings, storage, run_id=run_id, version=version, durable=row["full_durable"]
            ),
            sha256=row["sha256"],
            nbytes=row["nbytes"],
        ),
        shard=ShardRef(
            index=index,
            url=read_url(
                settings,
                storage,
                keys.training_shard(run_id, dataset, index),
                f"{API}/runs/{run_id}/shards/{index}",
            ),
            sha256=shard["sha256"],
            nbytes=shard["nbytes"],
            chunk_len=row["chunk_len"] if dataset is None else shard["tokens"],
            dtype=row["token_dtype"],
        ),
        data_range=None
        if unit is None
        else DataRange(unit=unit["unit"], start=unit["start"], tokens=unit["tokens"]),
        config=config,
        inner_steps=cfg.inner.steps if lease["inner_steps"] is None else lease["inner_steps"],
        start_step=rnd.base_version * cfg.inner.steps,  # the nominal H indexes the schedule
        seed=lease["seed"],
        deadline=rnd.deadline,
        deadline_in_s=(rnd.deadline - now).total_seconds(),
        lease_expires_at=lease["expires_at"],
        heartbeat_interval_s=cfg.rounds.heartbeat_interval_s
        if heartbeat_interval_s is None
        else heartbeat_interval_s,
        max_upload_bytes=rounds_service.max_upload_bytes(cfg, settings),
        upload=upload_target(
            settings,
            storage,
            run_id=run_id,
            index=rnd.index,
            contributor_id=row["contributor_id"],
            deadline=rnd.deadline,
            now=now,
        ),
    )


@lru_cache(maxsize=256)
def _parsed(config_json: str, shards_json: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A run's config and shards, which never change once it is created: parsed once and
    shared, never changed (a ``Lease`` takes a copy of the config's top level, and is only
    ever serialized; a deep copy for each join cost ~0.1 ms)."""
    return json.loads(config_json), json.loads(shards_json)


@lru_cache(maxsize=256)
def run_config_of(config_json: str) -> RunConfig:
    """A run's config, validated once (it never changes once the run is created)."""
    return parse_config(json.loads(config_json))


async def release(
    *, session: AsyncSession, run_id: str, index: int, contributor_id: str, now: datetime
) -> None:
    """Expire this contributor's lease on the round now. The row stays (its contribution,
    if any, refers to it); releasing an expired lease changes nothing (idempotent)."""
    released = await session.scalar(
        update(LeaseRow)
        .where(
            LeaseRow.run_id == run_id,
            LeaseRow.round_index == index,
            LeaseRow.contributor_id == contributor_id,
        )
        .values(expires_at=func.least(LeaseRow.expires_at, now))
        .returning(LeaseRow.id)
    )
    if released is None:
        raise NoLease(f"you hold no lease on round {index} of run {run_id}")
