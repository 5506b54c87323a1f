"""Audits by replay as an upload meets them (``diloco.protocol.audit``): whether the round's
secret draws the contribution, in the upload's own transaction, and, for a retry, whether
its audit still waits for the volunteer's state; and the round's suspect, audited at its
close. What follows (the reveal, the claims and
verdicts of verifiers) is ``server.audits``, above the rounds."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.config import RunConfig
from diloco.protocol.audit import AuditStatus, audit_share, drawn, reveal_deadline, suspect
from diloco.wire.header import FRESH, ReplayRecord
from server.rounds.models import Audit, Contribution, Round


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
    return _open(session, cfg, run_id, index, contribution_id, contributor_id, replay, now)


async def suspect_at_close(
    session: AsyncSession,
    cfg: RunConfig,
    *,
    run_id: str,
    median_cosines: Mapping[str, float],
    alignments: Mapping[str, float],
    now: datetime,
) -> str | None:
    """In the close's transaction: audit the round's least aligned upload
    (``diloco.protocol.audit.suspect``, among the round's own contributions the step took,
    by their cosines to the others' median, else by their scores' ``own_alignment``) unless
    it is audited already or cannot be replayed. Its volunteer learns it after its next
    upload (``GET …/audits/mine``). The new audit's id, or None."""
    if cfg.audit.fraction <= 0.0 or not cfg.audit.suspects:
        return None
    on_time = set(
        await session.scalars(
            select(Contribution.id).where(
                Contribution.id.in_([*median_cosines, *alignments]), Contribution.staleness == 0
            )
        )
    )  # late work points from an older base by rights: not a suspect for it
    cid = suspect(
        {i: c for i, c in median_cosines.items() if i in on_time},
        {i: a for i, a in alignments.items() if i in on_time},
    )
    if cid is None:
        return None
    found = (
        await session.execute(
            select(Contribution.contributor_id, Contribution.round_index, Contribution.replay)
            .outerjoin(Audit, Audit.contribution_id == Contribution.id)
            .where(Contribution.id == cid, Audit.id.is_(None))
        )
    ).first()
    if found is None or found.replay is None:  # audited by the draw, or not replayable
        return None
    replay = ReplayRecord(**found.replay)  # as the upload stored it (asdict)
    _open(session, cfg, run_id, found.round_index, cid, found.contributor_id, replay, now)
    return cid


def _open(
    session: AsyncSession,
    cfg: RunConfig,
    run_id: str,
    index: int,
    contribution_id: str,
    contributor_id: str,
    replay: ReplayRecord,
    now: datetime,
) -> str | None:
    """An audit of the contribution; its id when the volunteer must now reveal its
    starting state (a lease begun fresh has none: its audit waits for a verifier)."""
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
