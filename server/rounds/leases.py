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

import dataclasses
import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import and_, exists, func, literal, select, update
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
from server.checkpoints import service as checkpoints_service
from server.contributors.models import Contributor
from server.errors import LeaseNotFound, RunNotFound, Unauthorized, refused
from server.rounds import service as rounds_service
from server.rounds.models import Contribution, Round
from server.rounds.models import Lease as LeaseRow
from server.runs.models import Run
from server.settings import Settings

API = "/api/v1"


async def join(
    *, session: AsyncSession, settings: Settings, run: Run, contributor_id: str, now: datetime
) -> Lease:
    rnd = await rounds_service.current(session=session, run_id=run.id)
    held = None
    contributed = False
    if rnd is not None:
        contributed = await _has_contribution(session, run.id, rnd.index, contributor_id)
        held = await session.scalar(
            select(LeaseRow).where(
                LeaseRow.run_id == run.id,
                LeaseRow.round_index == rnd.index,
                LeaseRow.contributor_id == contributor_id,
            )
        )
    view = None if rnd is None else rounds_service.view_of(rnd)
    facts = JoinFacts(
        run_status=RunStatus(run.status),
        round=view,
        contributed=contributed,
        lease=None if held is None else _lease_view(held),
    )
    policy = rounds_service.lease_policy(run, settings)
    grant = admit_join(now, facts, policy)
    if isinstance(grant, Refusal):
        raise refused(grant)
    assert rnd is not None and view is not None  # a grant names the open round
    if grant.new_lease:
        # the round's lease counter, bumped atomically: the ordinal picks shard and seed
        ordinal = await session.scalar(
            update(Round)
            .where(Round.run_id == run.id, Round.index == rnd.index, Round.state == RoundState.OPEN)
            .values(leases_issued=Round.leases_issued + 1)
            .returning(Round.leases_issued - 1)
        )
        if ordinal is None:  # it started closing since we looked: the rule says so
            closing = dataclasses.replace(view, state=RoundState.CLOSING)
            late = admit_join(now, dataclasses.replace(facts, round=closing), policy)
            assert isinstance(late, Refusal)
            raise refused(late)
        assignment = assign_lease(
            ordinal, round=rnd.index, run_seed=run.seed, n_shards=run.n_shards
        )
        stmt = insert(LeaseRow).values(
            id=f"lease_{secrets.token_hex(8)}",
            run_id=run.id,
            round_index=rnd.index,
            contributor_id=contributor_id,
            shard=assignment.shard,
            seed=assignment.seed,
            issued_at=now,
            last_heartbeat=now,
            expires_at=grant.expires_at,
        )
        lease = (
            await session.scalars(
                stmt.on_conflict_do_update(  # the same contributor joining twice at once
                    constraint="uq_leases_run_id_round_index_contributor_id",
                    set_={"last_heartbeat": now, "expires_at": grant.expires_at},
                ).returning(LeaseRow)
            )
        ).one()
    else:
        assert held is not None
        held.last_heartbeat, held.expires_at = now, grant.expires_at
        lease = held
    return await _lease_answer(session, settings, run, rnd, lease)


async def _lease_answer(
    session: AsyncSession, settings: Settings, run: Run, rnd: Round, lease: LeaseRow
) -> Lease:
    cfg = rounds_service.run_config(run)
    ckpt = await checkpoints_service.get(session=session, run_id=run.id, version=rnd.base_version)
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


async def _has_contribution(
    session: AsyncSession, run_id: str, index: int, contributor_id: str
) -> bool:
    found = await session.scalar(
        select(Contribution.id).where(
            Contribution.run_id == run_id,
            Contribution.round_index == index,
            Contribution.contributor_id == contributor_id,
        )
    )
    return found is not None


# ---------------------------------------------------------------- heartbeats (the short path)


def _heartbeat_facts(token_hash: str, run_id: str, index: int, lease_id: str) -> Any:
    """One row: the contributor behind the token, the run's status, the named round, the
    round in progress and whether the named lease is this contributor's on that round."""
    current = (
        select(func.max(Round.index))
        .where(Round.run_id == run_id, Round.state != RoundState.CLOSED)
        .scalar_subquery()
    )
    held = exists().where(
        LeaseRow.id == lease_id,
        LeaseRow.run_id == run_id,
        LeaseRow.round_index == index,
        LeaseRow.contributor_id == Contributor.id,
    )
    return (
        select(
            Contributor.id,
            Run.status,
            Round.state,
            Round.opened_at,
            Round.deadline,
            Round.extensions,
            current.label("current_round"),
            held.label("held"),
        )
        .select_from(Contributor)
        .outerjoin(Run, Run.id == run_id)
        .outerjoin(Round, and_(Round.run_id == run_id, Round.index == index))
        .where(Contributor.token_hash == token_hash)
    )


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
    """Renew the lease (and the contributor's ``last_seen_at``, refused or not)."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        row = (
            await conn.execute(_heartbeat_facts(hash_token(token), run_id, index, lease_id))
        ).one_or_none()
        if row is None:
            raise Unauthorized("unknown contributor token; register with POST /api/v1/contributors")
        contributor_id, status, state, opened_at, deadline, extensions, current, held = row
        seen = update(Contributor).where(Contributor.id == contributor_id).values(last_seen_at=now)
        if status is None:
            await conn.execute(seen)
            raise RunNotFound(f"no run {run_id!r}; GET /api/v1/runs lists the runs")
        rnd = None
        if state is not None:
            rnd = RoundView(index, opened_at, deadline, RoundState(state), extensions)
        facts = HeartbeatFacts(RunStatus(status), rnd, current, bool(held))
        grant = admit_heartbeat(now, facts, ttl_s=settings.lease_ttl_s)
        if isinstance(grant, Refusal):
            await conn.execute(seen)
            raise refused(grant)
        renewed = (
            update(LeaseRow)
            .where(LeaseRow.id == lease_id)
            .values(last_heartbeat=now, expires_at=grant.expires_at, last_step=step, last_loss=loss)
            .add_cte(seen.cte("seen"))
            .returning(literal(1))
        )
        await conn.execute(renewed)
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
