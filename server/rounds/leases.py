"""Leases: a contributor's claim on a round. ``join`` hands one out (or renews it),
``heartbeat`` keeps it live, ``release`` gives it up early so that a round waiting only for
this contributor can close (decide_close counts live leases of contributors that have not
contributed yet as outstanding).
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from server.checkpoints import service as checkpoints_service
from server.errors import (
    AlreadyContributed,
    LeaseNotFound,
    NotFound,
    RoundClosing,
    RunNotActive,
)
from server.rounds import service as rounds_service
from server.rounds.models import Contribution, Lease, Round
from server.rounds.policy import RoundState
from server.rounds.schemas import CheckpointRef, LeaseOut, ShardRef
from server.runs.models import Run, RunStatus
from server.settings import Settings

API = "/api/v1"


async def join(
    *, session: AsyncSession, settings: Settings, run: Run, contributor_id: str, now: datetime
) -> LeaseOut:
    if run.status != RunStatus.ACTIVE:
        raise RunNotActive(f"run {run.id} is {run.status}", status=run.status)
    rnd = await rounds_service.current(session=session, run_id=run.id)
    if rnd is None or rnd.state != RoundState.OPEN:
        raise RoundClosing(
            f"round {rnd.index if rnd else '?'} of run {run.id} is closing; join again shortly",
            retry_after_s=1.0,
        )
    done = await session.scalar(
        select(Contribution.id).where(
            Contribution.run_id == run.id,
            Contribution.round_index == rnd.index,
            Contribution.contributor_id == contributor_id,
        )
    )
    if done is not None:
        raise AlreadyContributed(
            f"you already contributed to round {rnd.index}; the next round opens when it closes",
            retry_after_s=min(5.0, settings.sweep_interval_s * 2),
        )
    expires = now + timedelta(seconds=settings.lease_ttl_s)
    issued = await session.scalar(
        select(func.count(Lease.id)).where(Lease.run_id == run.id, Lease.round_index == rnd.index)
    )
    stmt = insert(Lease).values(
        id=f"lease_{secrets.token_hex(8)}",
        run_id=run.id,
        round_index=rnd.index,
        contributor_id=contributor_id,
        shard=int(issued or 0) % run.n_shards,
        seed=secrets.randbits(62),
        issued_at=now,
        last_heartbeat=now,
        expires_at=expires,
    )
    upsert = stmt.on_conflict_do_update(
        constraint="uq_leases_run_id_round_index_contributor_id",
        set_={"last_heartbeat": now, "expires_at": expires},
    ).returning(Lease)
    lease = (await session.scalars(upsert)).one()
    cfg = rounds_service.run_config(run)
    ckpt = await checkpoints_service.get(session=session, run_id=run.id, version=rnd.base_version)
    shard = run.shards[lease.shard]
    return LeaseOut(
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


async def heartbeat(
    *,
    session: AsyncSession,
    settings: Settings,
    run_id: str,
    index: int,
    contributor_id: str,
    lease_id: str,
    step: int | None,
    loss: float | None,
    now: datetime,
) -> tuple[Lease, Round]:
    rnd = await rounds_service.get_round(session=session, run_id=run_id, index=index)
    if rnd.state != RoundState.OPEN:
        raise rounds_service.round_closed(
            rnd, await rounds_service.current_index(session=session, run_id=run_id)
        )
    lease = await session.scalar(
        update(Lease)
        .where(
            Lease.id == lease_id,
            Lease.run_id == run_id,
            Lease.round_index == index,
            Lease.contributor_id == contributor_id,
        )
        .values(
            last_heartbeat=now,
            expires_at=now + timedelta(seconds=settings.lease_ttl_s),
            last_step=step,
            last_loss=loss,
        )
        .returning(Lease)
    )
    if lease is None:
        raise NotFound(f"you hold no lease {lease_id!r} on round {index} of run {run_id}")
    return lease, rnd


async def release(
    *, session: AsyncSession, run_id: str, index: int, contributor_id: str, now: datetime
) -> None:
    """Expire this contributor's lease on the round now. The row stays (its contribution,
    if any, refers to it); releasing an expired lease changes nothing (idempotent)."""
    released = await session.scalar(
        update(Lease)
        .where(
            Lease.run_id == run_id,
            Lease.round_index == index,
            Lease.contributor_id == contributor_id,
        )
        .values(expires_at=func.least(Lease.expires_at, now))
        .returning(Lease.id)
    )
    if released is None:
        raise LeaseNotFound(f"you hold no lease on round {index} of run {run_id}")
