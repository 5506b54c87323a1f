"""Leases: a contributor's claim on a round. ``join`` hands one out (or renews it),
``heartbeat`` keeps it live, ``release`` gives it up early so that a round waiting only for
this contributor can close (decide_close counts live leases of contributors that have not
contributed yet as outstanding). The rules are ``diloco.protocol.rules``; this module
fetches their facts and persists their decisions.

A heartbeat is the most frequent request a server answers (every volunteer, every few
seconds), so it takes a short path: no ORM objects, no transaction, two statements in
autocommit (the facts, then one indexed UPDATE of the lease and the contributor's
``last_seen_at``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from sqlalchemy import Insert, Update, and_, exists, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from diloco.protocol.messages import CheckpointRef, HeartbeatOut, Lease, ShardRef
from diloco.protocol.rules import admit_heartbeat, admit_join, assign_lease
from diloco.protocol.state import (
    HeartbeatFacts,
    JoinFacts,
    LeaseView,
    Refusal,
    RoundState,
    RoundView,
    RunStatus,
)
from server.auth import hash_token
from server.checkpoints.models import Checkpoint
from server.contributors.models import Contributor
from server.errors import LeaseNotFound, RunNotFound, Unauthorized, refused
from server.rounds import service as rounds_service
from server.rounds.models import Contribution, Round
from server.rounds.models import Lease as LeaseRow
from server.runs.models import Run
from server.settings import Settings

API = "/api/v1"


# ---------------------------------------------------------------- the facts, in one statement


def _me(token_hash: str, now: datetime) -> Any:
    """The contributor behind the token, marked as seen now (a refused action counts too)."""
    return (
        update(Contributor)
        .where(Contributor.token_hash == token_hash)
        .values(last_seen_at=now)
        .returning(Contributor.id)
        .cte("me")
    )


def _in_progress(run_id: str) -> Any:
    return (
        select(func.max(Round.index))
        .where(Round.run_id == run_id, Round.state != RoundState.CLOSED)
        .scalar_subquery()
    )


@contextlib.asynccontextmanager
async def _short(engine: AsyncEngine) -> AsyncIterator[AsyncSession]:
    """A session on an autocommit connection: each statement commits by itself, with no
    BEGIN and COMMIT round trips (the short paths of join and heartbeat)."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        async with AsyncSession(bind=conn, expire_on_commit=False) as session:
            yield session


# ---------------------------------------------------------------- joining


async def join(
    *, engine: AsyncEngine, settings: Settings, token: str, run_id: str, now: datetime
) -> Lease:
    """A lease on the run's open round (a new one, or the contributor's own renewed), or the
    rule's refusal. No transaction: one statement reads every fact (and marks the
    contributor seen); a new lease then takes the round's next ordinal and is inserted."""
    me = _me(hash_token(token), now)
    current = _in_progress(run_id)
    contributed = exists().where(
        Contribution.run_id == run_id,
        Contribution.round_index == current,
        Contribution.contributor_id == me.c.id,
    )
    facts = (
        select(me.c.id, Run, Round, LeaseRow, Checkpoint, contributed.label("contributed"))
        .select_from(me)
        .outerjoin(Run, Run.id == run_id)
        .outerjoin(Round, and_(Round.run_id == run_id, Round.index == current))
        .outerjoin(
            LeaseRow,
            and_(
                LeaseRow.run_id == run_id,
                LeaseRow.round_index == current,
                LeaseRow.contributor_id == me.c.id,
            ),
        )
        .outerjoin(
            Checkpoint,
            and_(Checkpoint.run_id == run_id, Checkpoint.version == Round.index - 1),
        )
    )
    async with _short(engine) as session:
        row = (await session.execute(facts)).one_or_none()
        if row is None:
            raise Unauthorized("unknown contributor token; register with POST /api/v1/contributors")
        contributor_id, run, rnd, held, ckpt, has_contribution = row
        if run is None:
            raise RunNotFound(f"no run {run_id!r}; GET /api/v1/runs lists the runs")
        view = None if rnd is None else rounds_service.view_of(rnd)
        lease_facts = JoinFacts(
            run_status=RunStatus(run.status),
            round=view,
            contributed=bool(has_contribution),
            lease=None if held is None else _lease_view(held),
        )
        policy = rounds_service.lease_policy(run, settings)
        grant = admit_join(now, lease_facts, policy)
        if isinstance(grant, Refusal):
            raise refused(grant)
        assert rnd is not None and view is not None and ckpt is not None
        if grant.new_lease:
            # the round's lease counter, bumped atomically: the ordinal picks shard and seed
            ordinal = await session.scalar(
                update(Round)
                .where(
                    Round.run_id == run_id,
                    Round.index == rnd.index,
                    Round.state == RoundState.OPEN,
                )
                .values(leases_issued=Round.leases_issued + 1)
                .returning(Round.leases_issued - 1)
            )
            if ordinal is None:  # it started closing since we looked: the rule says so
                closing = dataclasses.replace(view, state=RoundState.CLOSING)
                late = admit_join(now, dataclasses.replace(lease_facts, round=closing), policy)
                assert isinstance(late, Refusal)
                raise refused(late)
            assignment = assign_lease(
                ordinal, round=rnd.index, run_seed=run.seed, n_shards=run.n_shards
            )
            fresh = insert(LeaseRow).values(
                id=f"lease_{secrets.token_hex(8)}",
                run_id=run_id,
                round_index=rnd.index,
                contributor_id=contributor_id,
                shard=assignment.shard,
                seed=assignment.seed,
                issued_at=now,
                last_heartbeat=now,
                expires_at=grant.expires_at,
            )
            # the same contributor joining twice at once: one lease, renewed
            written: Insert | Update = fresh.on_conflict_do_update(
                constraint="uq_leases_run_id_round_index_contributor_id",
                set_={"last_heartbeat": now, "expires_at": grant.expires_at},
            )
        else:
            assert held is not None
            written = (
                update(LeaseRow)
                .where(LeaseRow.id == held.id)
                .values(last_heartbeat=now, expires_at=grant.expires_at)
            )
        lease = (
            await session.execute(
                written.returning(LeaseRow.id, LeaseRow.shard, LeaseRow.seed, LeaseRow.expires_at)
            )
        ).one()
    return _lease_answer(settings, run, rnd, ckpt, lease)


def _lease_answer(settings: Settings, run: Run, rnd: Round, ckpt: Checkpoint, lease: Any) -> Lease:
    cfg = rounds_service.run_config(run)
    shard = run.shards[lease.shard]
    return Lease(
        lease_id=lease.id,
        run_id=run.id,
        round=rnd.index,
        base_version=rnd.base_version,
        checkpoint=CheckpointRef(
            version=ckpt.version,
            url=f"{API}/runs/{run.id}/checkpoints/{ckpt.version}",
            sha256=ckpt.sha256,
            nbytes=ckpt.nbytes,
        ),
        shard=ShardRef(
            index=lease.shard,
            url=f"{API}/runs/{run.id}/shards/{lease.shard}",
            sha256=shard["sha256"],
            nbytes=shard["nbytes"],
            chunk_len=run.chunk_len,
        ),
        config=run.config,
        inner_steps=cfg.inner.steps,
        start_step=rnd.base_version * cfg.inner.steps,
        seed=lease.seed,
        deadline=rnd.deadline,
        lease_expires_at=lease.expires_at,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        max_upload_bytes=rounds_service.max_upload_bytes(cfg, settings),
    )


def _lease_view(lease: LeaseRow) -> LeaseView:
    return LeaseView(
        contributor_id=lease.contributor_id,
        last_heartbeat=lease.last_heartbeat,
        expires_at=lease.expires_at,
        shard=lease.shard,
        seed=lease.seed,
    )


# ---------------------------------------------------------------- heartbeats


async def heartbeat(
    *,
    engine: AsyncEngine,
    settings: Settings,
    token: str,
    run_id: str,
    index: int,
    lease_id: str,
    step: int | None,
    loss: float | None,
    now: datetime,
) -> HeartbeatOut:
    """Renew the lease, or the rule's refusal. No transaction: one statement reads the facts
    (and marks the contributor seen, refused or not), one indexed UPDATE renews."""
    me = _me(hash_token(token), now)
    held = exists().where(
        LeaseRow.id == lease_id,
        LeaseRow.run_id == run_id,
        LeaseRow.round_index == index,
        LeaseRow.contributor_id == me.c.id,
    )
    facts = (
        select(
            Run.status,
            Round.state,
            Round.opened_at,
            Round.deadline,
            Round.extensions,
            _in_progress(run_id).label("current_round"),
            held.label("held"),
        )
        .select_from(me)
        .outerjoin(Run, Run.id == run_id)
        .outerjoin(Round, and_(Round.run_id == run_id, Round.index == index))
    )
    async with _short(engine) as session:
        row = (await session.execute(facts)).one_or_none()
        if row is None:
            raise Unauthorized("unknown contributor token; register with POST /api/v1/contributors")
        status, state, opened_at, deadline, extensions, current, is_held = row
        if status is None:
            raise RunNotFound(f"no run {run_id!r}; GET /api/v1/runs lists the runs")
        rnd = None
        if state is not None:
            rnd = RoundView(index, opened_at, deadline, RoundState(state), extensions)
        beat = HeartbeatFacts(RunStatus(status), rnd, current, bool(is_held))
        grant = admit_heartbeat(now, beat, ttl_s=settings.lease_ttl_s)
        if isinstance(grant, Refusal):
            raise refused(grant)
        await session.execute(
            update(LeaseRow)
            .where(LeaseRow.id == lease_id)
            .values(last_heartbeat=now, expires_at=grant.expires_at, last_step=step, last_loss=loss)
        )
    assert rnd is not None
    return HeartbeatOut(
        lease_expires_at=grant.expires_at, round_state=rnd.state, deadline=rnd.deadline
    )


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
        raise LeaseNotFound(f"you hold no lease on round {index} of run {run_id}")
