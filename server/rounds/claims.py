"""A close's claim on a round: taking it, keeping it while the compute runs, and giving it
back with the failure recorded (``server.rounds.closing`` is the close itself).

Every write a claim holder makes is guarded by ``mine``: the round still closing, and still
under this very claim token. A worker whose claim expired (it stopped renewing: it died or
stalled) and was taken over writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import case, exists, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.sql.elements import ColumnElement

from diloco.faults import InjectedFault
from diloco.protocol.outcome import close_retry_at
from diloco.protocol.state import RetryPolicy, RoundState
from server.checkpoints.models import Checkpoint
from server.metrics import CLOSE_FAILURES
from server.rounds.models import Round
from server.settings import Settings
from server.webhooks import events as webhooks

log = logging.getLogger("diloco.rounds")


class BannedInStep(Exception):
    """The step used work of a contributor who was banned while it computed."""


@dataclass(frozen=True)
class Claim:
    run_id: str
    index: int
    token: str  # this worker's, for this attempt
    attempt: int  # claims taken on the round so far, this one included


async def claim_next(
    *, sessions: async_sessionmaker[AsyncSession], settings: Settings, now: datetime
) -> Claim | None:
    """Claim one closing round that is free (or whose claim expired) and due, and whose base
    version's full files are durable; None if none. A round whose base was published with
    its full files pending (``server.rounds.full_files``) stays closing, unclaimed, until
    they are: its close reads them (``close_inputs.read_inputs``)."""
    token = secrets.token_hex(8)
    base_full = exists().where(
        Checkpoint.run_id == Round.run_id,
        Checkpoint.version == Round.base_version,
        Checkpoint.full_files_at.is_not(None),
    )
    due = (
        select(Round.run_id, Round.index)
        .where(
            Round.state == RoundState.CLOSING,
            or_(Round.claim_expires_at.is_(None), Round.claim_expires_at <= now),
            or_(Round.retry_at.is_(None), Round.retry_at <= now),
            base_full,
        )
        .order_by(Round.retry_at.asc().nulls_first(), Round.opened_at)
        .limit(1)
        .with_for_update(skip_locked=True)
        .cte("due")
    )
    taken_over = Round.claim_token.is_not(None)  # its holder stopped renewing: it died
    async with sessions() as session, session.begin():
        row = (
            await session.execute(
                update(Round)
                .where(Round.run_id == due.c.run_id, Round.index == due.c.index)
                .values(
                    claim_token=token,
                    claim_expires_at=now + timedelta(seconds=settings.claim_ttl_s),
                    close_attempts=Round.close_attempts + 1,
                    error_code=case((taken_over, "claim_expired"), else_=Round.error_code),
                    error=case(
                        (taken_over, "the worker closing it stopped renewing its claim"),
                        else_=Round.error,
                    ),
                    error_at=case((taken_over, now), else_=Round.error_at),
                )
                .returning(Round.run_id, Round.index, Round.close_attempts)
            )
        ).one_or_none()
    if row is None:
        return None
    return Claim(run_id=row[0], index=row[1], token=token, attempt=row[2])


def mine(claim: Claim) -> tuple[ColumnElement[bool], ...]:
    """The WHERE of every write a claim holder makes: still closing, still its claim."""
    return (
        Round.run_id == claim.run_id,
        Round.index == claim.index,
        Round.state == RoundState.CLOSING,
        Round.claim_token == claim.token,
    )


async def record_failure(
    sessions: async_sessionmaker[AsyncSession], settings: Settings, claim: Claim, err: Exception
) -> None:
    now = datetime.now(UTC)
    code = (
        "injected_fault"
        if isinstance(err, InjectedFault)
        else "contributor_banned"
        if isinstance(err, BannedInStep)
        else "close_failed"
    )
    policy = RetryPolicy(base_s=settings.close_retry_base_s, max_s=settings.close_retry_max_s)
    # a ban is no fault of the close: no backoff
    retry_at = now if isinstance(err, BannedInStep) else close_retry_at(now, claim.attempt, policy)
    detail = f"attempt {claim.attempt}: {type(err).__name__}: {err}"[:1000]
    CLOSE_FAILURES.labels(code).inc()
    async with sessions() as session, session.begin():
        await session.execute(
            update(Round)
            .where(*mine(claim))
            .values(
                claim_token=None,
                claim_expires_at=None,
                error_code=code,
                error=detail,
                error_at=now,
                retry_at=retry_at,
            )
        )
        if claim.attempt == settings.webhook_close_failures:
            await webhooks.emit(
                session,
                run_id=claim.run_id,
                event="round.close_failing",
                data={"round": claim.index, "attempts": claim.attempt, "error": detail},
                now=now,
            )
    log.warning(
        "run %s round %d: %s; retrying at %s",
        claim.run_id,
        claim.index,
        detail,
        retry_at.isoformat(),
    )


async def renew(
    sessions: async_sessionmaker[AsyncSession], settings: Settings, claim: Claim
) -> None:
    """Keep the claim while the compute runs; stop when it is no longer ours."""
    every = settings.claim_ttl_s / 3
    while True:
        await asyncio.sleep(every)
        now = datetime.now(UTC)
        async with sessions() as session, session.begin():
            kept = await session.scalar(
                update(Round)
                .where(*mine(claim))
                .values(claim_expires_at=now + timedelta(seconds=settings.claim_ttl_s))
                .returning(Round.index)
            )
        if kept is None:
            log.warning("run %s round %d: claim lost", claim.run_id, claim.index)
            return
