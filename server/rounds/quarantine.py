"""Quarantine: applied when a close leaves a contributor's work out by verification again
and again (``diloco.protocol.reputation``), lifted by an admin.

``review`` runs in the transaction that records a close's exclusions (publish or reopen),
for the contributors it left out: one whose latest judged contributions failed often
enough is quarantined there, and its work that no step has used yet is excluded with the
reason (as a ban's is, but its leases stay: it may keep working, and its uploads are
stored). An upload from a quarantined contributor is taken and excluded at once
(``server.rounds.ingest``).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.protocol.reputation import CODE, VERIFY_CODES, WINDOW, quarantine_reason, standing
from server.contributors.models import Contributor
from server.http.errors import NotFound
from server.rounds import bans, notify
from server.rounds.models import Contribution


async def standing_of(session: AsyncSession, contributor_id: str) -> float:
    """The contributor's standing now (``reputation.standing``): from its contributions a
    step took and no verification failed, and those verification left out."""
    c = Contribution
    row = (
        await session.execute(
            select(
                func.count().filter(c.aggregated_at.is_not(None), c.excluded_code.is_(None)),
                func.count().filter(c.excluded_code.in_(VERIFY_CODES)),
            ).where(c.contributor_id == contributor_id)
        )
    ).one()
    return standing(int(row[0]), int(row[1]))


async def review(session: AsyncSession, contributor_ids: Iterable[str], now: datetime) -> None:
    """Quarantine each of these contributors whose latest judged work says so."""
    for contributor_id in sorted(set(contributor_ids)):
        recent = list(
            await session.scalars(
                select(Contribution.excluded_code)
                .where(
                    Contribution.contributor_id == contributor_id,
                    or_(
                        Contribution.aggregated_at.is_not(None),
                        Contribution.excluded_code.in_(VERIFY_CODES),
                    ),
                )
                .order_by(Contribution.created_at.desc())
                .limit(WINDOW)
            )
        )
        if (reason := quarantine_reason(recent)) is None:
            continue
        won = await session.scalar(
            update(Contributor)
            .where(Contributor.id == contributor_id, Contributor.quarantined_at.is_(None))
            .values(quarantined_at=now, quarantine_reason=reason)
            .returning(Contributor.id)
        )
        if won is not None:
            await _exclude_pending(session, contributor_id, reason)


async def _exclude_pending(session: AsyncSession, contributor_id: str, reason: str) -> None:
    runs = await bans.exclude_pending(session, contributor_id, CODE, reason)
    for run_id in sorted(set(runs)):  # a round may close (or wait) now
        await notify.rounds_changed(session, run_id)


async def lift(session: AsyncSession, contributor_id: str) -> Contributor:
    """The admin lifts a quarantine: its next uploads count again (work excluded stays so)."""
    lifted = await session.scalar(
        update(Contributor)
        .where(Contributor.id == contributor_id)
        .values(quarantined_at=None, quarantine_reason=None)
        .returning(Contributor)
    )
    if lifted is None:
        raise NotFound(f"no contributor {contributor_id!r}; GET /api/v1/contributors lists them")
    return lifted
