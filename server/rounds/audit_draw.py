"""Audits by replay as an upload meets them (``diloco.protocol.audit``): whether the round's
secret draws the contribution, in the upload's own transaction, and, for a retry, whether
its audit still waits for the volunteer's state. What follows (the reveal, the claims and
verdicts of verifiers) is ``server.audits``, above the rounds."""

from __future__ import annotations

import secrets
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.config import RunConfig
from diloco.protocol.audit import AuditStatus, audit_share, drawn, reveal_deadline
from diloco.wire.header import FRESH, ReplayRecord
from server.rounds.models import Audit, Round


async def draw(
    session: AsyncSession,
    cfg: RunConfig,
    *,
    run_id: str,
    index: int,
    contribution_id: str,
    contributor_id: str,
    replay: ReplayRecord | None,
    standing: float,
    now: datetime,
) -> str | None:
    """In the upload's transaction: audit this contribution if the round's secret draws it
    (``audit_share`` of its contributor's ``standing``). The audit's id when the volunteer
    must now reveal its starting state, else None (not drawn, not replayable, or begun
    fresh: nothing to reveal)."""
    share = audit_share(cfg.audit.fraction, standing, newcomers=cfg.audit.newcomers)
    if replay is None or share <= 0.0:
        return None
    seed = await session.scalar(
        select(Round.check_seed).where(Round.run_id == run_id, Round.index == index)
    )
    if seed is None or not drawn(seed, contributor_id, share):
        return None
    revealing = replay.start != FRESH
    audit_id = f"aud_{secrets.token_hex(8)}"
    session.add(
        Audit(
            id=audit_id,
            run_id=run_id,
            round_index=index,
            contribution_id=contribution_id,
            contributor_id=contributor_id,
            status=AuditStatus.REVEALING if revealing else AuditStatus.PENDING,
            reveal_by=reveal_deadline(now, cfg.audit.reveal_s),
            created_at=now,
        )
    )
    return audit_id if revealing else None


async def revealing(session: AsyncSession, contribution_id: str) -> str | None:
    """The id of the contribution's audit while it waits for the volunteer's state (an
    identical retry of the upload is told again), else None."""
    return await session.scalar(
        select(Audit.id).where(
            Audit.contribution_id == contribution_id, Audit.status == AuditStatus.REVEALING
        )
    )
