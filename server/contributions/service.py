"""What contributors did: one's own record, the leaderboard, and a ban that withdraws the
banned contributor's work from the rounds not yet closed.

Every figure is computed from the ``contributions`` rows, the one source of truth: a row
exists only for an accepted upload, and ``aggregated_at`` / ``credit`` are set only in the
transaction that closes its round (``server.rounds.closing``). So a rejected or late upload
never counts, and an accepted one counts toward credit only once its outer step happened
and, where credit waits for audits, an audit confirmed it (``server.rounds.escrow``).

Above ``server.contributors`` (the volunteer's own row) and ``server.rounds``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.protocol.audit import CreditStatus
from server.contributors import service as contributors_service
from server.contributors.models import Contributor
from server.contributors.schemas import (
    BanState,
    Hardware,
    Leaderboard,
    LeaderboardEntry,
    Order,
    Profile,
    RecentContribution,
    RunTotals,
    SortKey,
    Totals,
)
from server.rounds import bans as rounds_bans
from server.rounds import quarantine
from server.rounds.models import Contribution
from server.runs import service as runs_service
from server.runs.models import Run

RECENT = 20  # contributions listed in a profile


async def ban(
    *, session: AsyncSession, contributor_id: str, reason: str, now: datetime
) -> BanState:
    """Ban the contributor: its token is refused from this commit on (403 banned), its work
    in rounds not yet closed is excluded and its live leases are released, all in this
    transaction. Banning again replaces the reason and keeps the first ban's time."""
    banned = await contributors_service.mark_banned(
        session=session, contributor_id=contributor_id, reason=reason, now=now
    )
    excluded, released = await rounds_bans.withdraw(
        session=session, contributor_id=contributor_id, reason=reason, now=now
    )
    return contributors_service.ban_state(banned, excluded=excluded, released=released)


def _figures() -> list[ColumnElement[Any]]:
    """accepted, aggregated, tokens (of the aggregated ones), credit (confirmed) and
    pending credit (waiting for an audit: ``server.rounds.escrow``): over grouped rows."""
    aggregated = Contribution.aggregated_at.is_not(None)
    return [
        func.count(Contribution.id).label("accepted"),
        func.count(Contribution.aggregated_at).label("aggregated"),
        func.coalesce(func.sum(Contribution.tokens).filter(aggregated), 0).label("tokens"),
        _credit(CreditStatus.CONFIRMED).label("credit"),
        _credit(CreditStatus.PENDING).label("pending_credit"),
    ]


def _credit(status: CreditStatus) -> ColumnElement[Any]:
    in_status = Contribution.credit_status == status
    return func.coalesce(func.sum(Contribution.credit).filter(in_status), 0.0)


def _stats(*where: ColumnElement[bool]) -> Select[Any]:
    """The figures per contributor."""
    return (
        select(Contribution.contributor_id.label("contributor_id"), *_figures())
        .where(*where)
        .group_by(Contribution.contributor_id)
    )


async def profile(*, session: AsyncSession, contributor: Contributor) -> Profile:
    """One's own record: totals, per run (highest credit first), the newest contributions."""
    mine = Contribution.contributor_id == contributor.id
    by_run = await session.execute(
        select(
            Contribution.run_id,
            Run.name,
            *_figures(),
            func.max(Contribution.round_index),
        )
        .join(Run, Run.id == Contribution.run_id)
        .where(mine)
        .group_by(Contribution.run_id, Run.name)
        .order_by(
            _credit(CreditStatus.CONFIRMED).desc(),
            _credit(CreditStatus.PENDING).desc(),
            func.max(Contribution.created_at).desc(),
            Contribution.run_id,
        )
    )
    run_totals = [
        RunTotals(
            run_id=run_id,
            run_name=name,
            accepted=int(accepted),
            aggregated=int(aggregated),
            tokens=int(tokens),
            credit=float(credit),
            pending_credit=float(pending),
            last_round=int(last_round),
        )
        for run_id, name, accepted, aggregated, tokens, credit, pending, last_round in by_run
    ]
    recent = await session.scalars(
        select(Contribution)
        .where(mine)
        .order_by(Contribution.created_at.desc(), Contribution.id.desc())
        .limit(RECENT)
    )
    hw = contributor.hardware
    return Profile(
        id=contributor.id,
        name=contributor.name,
        created_at=contributor.created_at,
        last_seen_at=contributor.last_seen_at,
        hardware=None if hw is None else Hardware.model_validate(hw),
        totals=Totals(
            accepted=sum(r.accepted for r in run_totals),
            aggregated=sum(r.aggregated for r in run_totals),
            tokens=sum(r.tokens for r in run_totals),
            credit=sum(r.credit for r in run_totals),
            pending_credit=sum(r.pending_credit for r in run_totals),
        ),
        runs=run_totals,
        quarantined_at=contributor.quarantined_at,
        quarantine_reason=contributor.quarantine_reason,
        standing=await quarantine.standing_of(session, contributor.id),
        recent=[
            RecentContribution(
                run_id=c.run_id,
                round=c.round_index,
                tokens=c.tokens,
                loss=c.loss,
                created_at=c.created_at,
                aggregated=c.aggregated_at is not None,
                credit=c.credit,
                credit_status=c.credit_status,
                excluded=c.excluded,
            )
            for c in recent
        ],
    )


def default_order(sort: SortKey) -> Order:
    """Biggest or latest first, except names, which read A to Z."""
    return Order.ASC if sort is SortKey.NAME else Order.DESC


async def leaderboard(
    *,
    session: AsyncSession,
    run_id: str | None,
    sort: SortKey,
    order: Order,
    limit: int,
    offset: int,
) -> Leaderboard:
    """Every registered contributor (zeros included), or those with a contribution in
    ``run_id`` counting that run only. Ties: earliest registered first, then by id."""
    if run_id is not None:
        await runs_service.get(session=session, run_id=run_id)  # 404 run_not_found
        stats = _stats(Contribution.run_id == run_id).subquery()
        total = select(func.count(func.distinct(Contribution.contributor_id))).where(
            Contribution.run_id == run_id
        )
    else:
        stats = _stats().subquery()
        total = select(func.count(Contributor.id))
    accepted = func.coalesce(stats.c.accepted, 0)
    aggregated = func.coalesce(stats.c.aggregated, 0)
    tokens = func.coalesce(stats.c.tokens, 0)
    credit = func.coalesce(stats.c.credit, 0.0)
    pending = func.coalesce(stats.c.pending_credit, 0.0)
    key: Any = {
        SortKey.CREDIT: credit,
        SortKey.TOKENS: tokens,
        SortKey.ACCEPTED: accepted,
        SortKey.AGGREGATED: aggregated,
        SortKey.LAST_SEEN: Contributor.last_seen_at,
        SortKey.NAME: Contributor.name,
        SortKey.CREATED: Contributor.created_at,
    }[sort]
    rows = await session.execute(
        select(
            Contributor.id,
            Contributor.name,
            accepted,
            aggregated,
            tokens,
            credit,
            pending,
            Contributor.last_seen_at,
            Contributor.created_at,
            Contributor.hardware["device"].astext,
        )
        .join(stats, stats.c.contributor_id == Contributor.id, isouter=run_id is None)
        .order_by(
            (key.desc() if order is Order.DESC else key.asc()).nulls_last(),
            Contributor.created_at,
            Contributor.id,
        )
        .limit(limit)
        .offset(offset)
    )
    entries = [
        LeaderboardEntry(
            rank=offset + position,
            id=cid,
            name=name,
            accepted=int(n_accepted),
            aggregated=int(n_aggregated),
            tokens=int(n_tokens),
            credit=float(n_credit),
            pending_credit=float(n_pending),
            last_seen_at=last_seen_at,
            created_at=created_at,
            device=device,
        )
        for position, (
            cid,
            name,
            n_accepted,
            n_aggregated,
            n_tokens,
            n_credit,
            n_pending,
            last_seen_at,
            created_at,
            device,
        ) in enumerate(rows, start=1)
    ]
    return Leaderboard(
        run_id=run_id,
        sort=sort,
        order=order,
        total=int(await session.scalar(total) or 0),
        contributors=entries,
    )
