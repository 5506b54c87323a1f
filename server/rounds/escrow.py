"""Credit that waits for an audit (``diloco.protocol.audit.settle``), in the database.

A close credits the contributions its step took as it always did (``credit``, FLOPs); with
escrow their ``credit_status`` is ``pending`` unless an audit of the same contributor's
work in the run, at or after that round, was already decided. Each audit decision settles
that contributor's pending credit in the run up to the audited round: ``confirmed`` when it
passed, ``forfeited`` (credit 0) when it failed. Totals and the leaderboard count confirmed
credit (``server.contributions.service``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.config.rounds import AuditSection
from diloco.protocol.audit import DECIDED, AuditStatus, CreditStatus, escrowed, settle
from server.rounds.models import Audit, Contribution


async def at_close(
    session: AsyncSession, run_id: str, audit: AuditSection, credited: Mapping[str, float]
) -> dict[str, CreditStatus]:
    """The status of each contribution a step credits (by id), in the close's transaction."""
    rows = (
        await session.execute(
            select(
                Contribution.id,
                Contribution.contributor_id,
                Contribution.round_index,
                Contribution.replay.is_not(None),
            ).where(Contribution.id.in_(list(credited)))
        )
    ).all()
    waiting = [
        (cid, who, index)
        for cid, who, index, auditable in rows
        if escrowed(audit.fraction, audit.escrow, auditable=bool(auditable))
    ]
    statuses = {cid: CreditStatus.CONFIRMED for cid, *_ in rows}
    if not waiting:
        return statuses
    decided: dict[str, list[tuple[int, datetime, AuditStatus]]] = defaultdict(list)
    for who, index, when, status in await session.execute(
        select(Audit.contributor_id, Audit.round_index, Audit.decided_at, Audit.status).where(
            Audit.run_id == run_id,
            Audit.contributor_id.in_({who for _, who, _ in waiting}),
            Audit.status.in_(list(DECIDED)),
        )
    ):
        assert when is not None  # a decided audit has its time
        decided[who].append((index, when, AuditStatus(status)))
    for cid, who, index in waiting:
        statuses[cid] = settle(index, decided[who])
    return statuses


async def after_decision(session: AsyncSession, audit: Audit) -> int:
    """Settle the audited contributor's pending credit in the run up to the audited round,
    by the audit's decision; how many contributions it settled."""
    passed = audit.status == AuditStatus.PASSED
    status = CreditStatus.CONFIRMED if passed else CreditStatus.FORFEITED
    values: dict[str, object] = {"credit_status": status}
    if not passed:
        values["credit"] = 0.0
    settled = await session.execute(
        update(Contribution)
        .where(
            Contribution.run_id == audit.run_id,
            Contribution.contributor_id == audit.contributor_id,
            Contribution.credit_status == CreditStatus.PENDING,
            Contribution.round_index <= audit.round_index,
        )
        .values(**values)
        .returning(Contribution.id)
    )
    return len(settled.all())
