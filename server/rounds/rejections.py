"""Refused uploads, kept in a small log so that the dashboard can say why an upload did not
count. The log is not the run's state (invariant 4): nothing that trains, closes rounds or
gives credit reads it. It is bounded: each insert prunes the run's log to its newest KEEP.

Also here: a round's contributions joined with its rejections, for
``GET /runs/{id}/rounds/{index}/contributions``.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import delete, or_, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from server.contributors.models import Contributor
from server.http.errors import HubError, RunNotFound
from server.rounds import service as rounds_service
from server.rounds.models import Contribution, UploadRejection
from server.rounds.schemas import (
    ArrivalScore,
    RoundContribution,
    RoundContributions,
    RoundRejection,
    UploadChecks,
)
from server.runs.models import Run

log = logging.getLogger("diloco.server.rejections")

KEEP = 1000  # rejections kept per run, newest first
LIST = 100  # rejections listed per round
DETAIL_CHARS = 500


async def record(
    *,
    sessions: async_sessionmaker[AsyncSession],
    run_id: str,
    index: int,
    contributor_id: str,
    error: HubError,
    now: datetime,
) -> None:
    """Log a refused upload in its own transaction. An unknown run is not logged (there is
    nothing to show it on), and a failure to log is logged, never raised: the contributor
    gets the original error either way."""
    if isinstance(error, RunNotFound) or not 0 <= index < 1 << 31:
        return
    try:
        async with sessions() as session, session.begin():
            if await session.get(Run, run_id) is None:
                return
            session.add(
                UploadRejection(
                    run_id=run_id,
                    round_index=index,
                    contributor_id=contributor_id,
                    code=error.code,
                    detail=error.detail[:DETAIL_CHARS],
                    created_at=now,
                )
            )
            await session.flush()
            newest = (
                select(UploadRejection.id)
                .where(UploadRejection.run_id == run_id)
                .order_by(UploadRejection.id.desc())
                .offset(KEEP)
                .limit(1)
                .scalar_subquery()
            )
            await session.execute(
                delete(UploadRejection).where(
                    UploadRejection.run_id == run_id, UploadRejection.id <= newest
                )
            )
    except (OSError, DBAPIError) as err:
        log.warning("could not log the rejected upload of %s: %s", contributor_id, err)


async def round_contributions(
    *, session: AsyncSession, run_id: str, index: int
) -> RoundContributions:
    rnd = await rounds_service.get_round(session=session, run_id=run_id, index=index)
    accepted = await session.execute(
        select(Contribution, Contributor.name)
        .join(Contributor, Contributor.id == Contribution.contributor_id)
        .where(
            Contribution.run_id == run_id,
            # its own, and late work it took or that was trained for it and merged later
            or_(Contribution.round_index == index, Contribution.merged_into_round == index),
        )
        .order_by(Contribution.created_at, Contribution.id)
    )
    refused = await session.execute(
        select(UploadRejection, Contributor.name)
        .join(Contributor, Contributor.id == UploadRejection.contributor_id)
        .where(UploadRejection.run_id == run_id, UploadRejection.round_index == index)
        .order_by(UploadRejection.id.desc())
        .limit(LIST)
    )
    return RoundContributions(
        run_id=run_id,
        round=index,
        state=rnd.state,
        contributions=[
            RoundContribution(
                id=c.id,
                contributor_id=c.contributor_id,
                contributor_name=name,
                tokens=c.tokens,
                inner_steps=c.inner_steps,
                loss=c.loss,
                created_at=c.created_at,
                aggregated=c.aggregated_at is not None,
                credit=c.credit,
                credit_status=c.credit_status,
                excluded=c.excluded,
                weight=c.counted_weight,
                standing=c.earned,
                round=c.round_index,
                merged_into_round=c.merged_into_round,
                staleness=c.staleness,
                norm=c.norm,
                sha256=c.sha256,
                nbytes=c.nbytes,
                blob_retained=c.blob_deleted_at is None,
                cosine=c.cosine,
                clip=c.clip_factor,
                checks=None if c.checks is None else UploadChecks.model_validate(c.checks),
                score=ArrivalScore.model_validate(c.score) if c.score else None,
            )
            for c, name in accepted
        ],
        rejections=[
            RoundRejection(
                contributor_id=r.contributor_id,
                contributor_name=name,
                error=r.code,
                detail=r.detail,
                created_at=r.created_at,
            )
            for r, name in refused
        ],
    )
