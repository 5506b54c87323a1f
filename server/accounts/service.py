"""Roles, run owners' quotas and the accounts list, on the database.

A quota bounds what one owner's runs may cost the hub: how many runs it has not ended at
once, and each run's model parameters and training data. Creating a run checks it twice:
``check_run`` before anything is written (a cheap refusal), and ``hold_runs`` in the
transaction that inserts the run, under a lock per owner, so that two creations sent at
once cannot both take the last run the quota allows.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.protocol.state import RunStatus
from server.accounts.schemas import Account, Quota, QuotaFigures, QuotaIn, Roles
from server.contributors.models import Contributor, ContributorRole, OwnerQuota
from server.http.errors import NotFound, QuotaExceeded
from server.runs.models import Run
from server.settings import Settings

NOT_ENDED = (RunStatus.ACTIVE, RunStatus.PAUSED)


async def account(session: AsyncSession, contributor_id: str) -> Contributor:
    found = await session.get(Contributor, contributor_id)
    if found is None:
        raise NotFound(f"no contributor {contributor_id!r}; GET /api/v1/accounts lists them")
    return found


# ---------------------------------------------------------------- roles


async def roles_of(session: AsyncSession, contributor_id: str) -> Roles:
    held = await session.scalars(
        select(ContributorRole.role)
        .where(ContributorRole.contributor_id == contributor_id)
        .order_by(ContributorRole.role)
    )
    return Roles(id=contributor_id, roles=list(held))


async def grant(session: AsyncSession, contributor_id: str, role: str, now: datetime) -> Roles:
    await account(session, contributor_id)
    await session.execute(
        insert(ContributorRole)
        .values(contributor_id=contributor_id, role=role, granted_at=now)
        .on_conflict_do_nothing()
    )
    await session.commit()
    return await roles_of(session, contributor_id)


async def revoke(session: AsyncSession, contributor_id: str, role: str) -> Roles:
    await account(session, contributor_id)
    await session.execute(
        delete(ContributorRole).where(
            ContributorRole.contributor_id == contributor_id, ContributorRole.role == role
        )
    )
    await session.commit()
    return await roles_of(session, contributor_id)


# ---------------------------------------------------------------- quotas


async def runs_not_ended(session: AsyncSession, owner_id: str) -> list[str]:
    """The owner's runs that are active or paused, oldest first."""
    return list(
        await session.scalars(
            select(Run.id)
            .where(Run.owner_id == owner_id, Run.status.in_(NOT_ENDED))
            .order_by(Run.created_at)
        )
    )


async def quota(session: AsyncSession, settings: Settings, owner_id: str) -> Quota:
    row = await session.get(OwnerQuota, owner_id, populate_existing=True)
    given = (
        QuotaIn()
        if row is None
        else QuotaIn(runs=row.runs, params=row.params, data_bytes=row.data_bytes)
    )
    defaults = QuotaFigures(
        runs=settings.owner_runs,
        params=settings.owner_params,
        data_bytes=settings.owner_data_bytes,
    )
    effective = QuotaFigures(
        runs=defaults.runs if given.runs is None else given.runs,
        params=defaults.params if given.params is None else given.params,
        data_bytes=defaults.data_bytes if given.data_bytes is None else given.data_bytes,
    )
    running = await runs_not_ended(session, owner_id)
    return Quota(id=owner_id, set=given, effective=effective, runs_not_ended=len(running))


async def set_quota(
    session: AsyncSession, settings: Settings, owner_id: str, body: QuotaIn, now: datetime
) -> Quota:
    await account(session, owner_id)
    values = {"runs": body.runs, "params": body.params, "data_bytes": body.data_bytes}
    await session.execute(
        insert(OwnerQuota)
        .values(contributor_id=owner_id, set_at=now, **values)
        .on_conflict_do_update(index_elements=["contributor_id"], set_={**values, "set_at": now})
    )
    await session.commit()
    return await quota(session, settings, owner_id)


async def check_run(
    session: AsyncSession,
    settings: Settings,
    owner_id: str,
    *,
    params: int | None = None,
    data_bytes: int | None = None,
) -> Quota:
    """Refuse a run the owner's quota does not allow (403 ``quota_exceeded``, naming the
    quota); what is not known yet (None) is not checked."""
    q = await quota(session, settings, owner_id)
    limit = q.effective
    if q.runs_not_ended >= limit.runs:
        raise _runs_exceeded(limit.runs, await runs_not_ended(session, owner_id))
    if params is not None and params > limit.params:
        raise QuotaExceeded(
            f"quota params: this model has {params:,} parameters, over the {limit.params:,} "
            "a run of yours may have (the hub's admin sets quotas)",
            quota="params",
            limit=limit.params,
        )
    if data_bytes is not None and data_bytes > limit.data_bytes:
        raise QuotaExceeded(
            f"quota data_bytes: this run's data is {data_bytes:,} bytes, over the "
            f"{limit.data_bytes:,} a run of yours may train on (the hub's admin sets quotas)",
            quota="data_bytes",
            limit=limit.data_bytes,
        )
    return q


def _runs_exceeded(limit: int, running: list[str]) -> QuotaExceeded:
    return QuotaExceeded(
        f"quota runs: you may have {limit} runs not ended at once, and have {len(running)} "
        f"({', '.join(running) or 'none'}); cancel one, or ask the hub's admin for more",
        quota="runs",
        limit=limit,
    )


async def hold_runs(session: AsyncSession, settings: Settings, owner_id: str) -> None:
    """In the transaction that inserts a run of ``owner_id``: wait for any other creation
    of the same owner's (a lock until commit), then refuse past the runs quota."""
    await session.execute(
        text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
        {"key": f"owner-runs:{owner_id}"},
    )
    q = await quota(session, settings, owner_id)
    if q.runs_not_ended >= q.effective.runs:
        raise _runs_exceeded(q.effective.runs, await runs_not_ended(session, owner_id))


# ---------------------------------------------------------------- the accounts list


async def accounts(session: AsyncSession, *, limit: int, offset: int) -> tuple[int, list[Account]]:
    """Every account, newest first, with its roles and how many runs it owns."""
    total = await session.scalar(select(func.count(Contributor.id)))
    rows = list(
        await session.scalars(
            select(Contributor)
            .order_by(Contributor.created_at.desc(), Contributor.id)
            .limit(limit)
            .offset(offset)
        )
    )
    ids = [c.id for c in rows]
    held: dict[str, list[str]] = {}
    for cid, role in await session.execute(
        select(ContributorRole.contributor_id, ContributorRole.role)
        .where(ContributorRole.contributor_id.in_(ids))
        .order_by(ContributorRole.role)
    ):
        held.setdefault(cid, []).append(role)
    counted = await session.execute(
        select(Run.owner_id, func.count(Run.id)).where(Run.owner_id.in_(ids)).group_by(Run.owner_id)
    )
    owned = {owner_id: n for owner_id, n in counted}  # a Result has keys(): no dict()
    return int(total or 0), [
        Account(
            id=c.id,
            name=c.name,
            created_at=c.created_at,
            last_seen_at=c.last_seen_at,
            roles=held.get(c.id, []),
            runs_owned=int(owned.get(c.id, 0)),
            banned_at=c.banned_at,
            ban_reason=c.ban_reason,
            quarantined_at=c.quarantined_at,
            quarantine_reason=c.quarantine_reason,
        )
        for c in rows
    ]
