"""Audits by replay (``diloco.protocol.audit``): drawn when an upload is recorded, the
volunteer's starting state revealed, claimed and decided by a verifier.

A failed audit costs its contribution what a failed check does: it is excluded with code
``replay`` and the sentence, its credit is taken back even when a step already used it (the
step stays published: a model cannot be un-trained, but the contributor earns nothing), and
it counts towards quarantine (``diloco.protocol.reputation``) in the same transaction.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.protocol.audit import (
    CLAIM_S,
    CODE,
    AuditStatus,
    CreditStatus,
    Verdict,
    max_state_bytes,
)
from server.audits.schemas import AuditResult, AuditView, WaitingAudit, WaitingAudits
from server.http.errors import (
    Forbidden,
    HubError,
    InvalidData,
    InvalidTransition,
    LengthRequired,
    NotFound,
    UploadTooLarge,
)
from server.http.inputs import declared_length
from server.rounds import escrow, notify, quarantine
from server.rounds.models import Audit, Contribution
from server.runs.models import Run
from server.storage import keys
from server.storage.base import Storage
from server.storage.files import write_checked


def view(audit: Audit) -> AuditView:
    return AuditView(
        id=audit.id,
        run_id=audit.run_id,
        round=audit.round_index,
        contribution_id=audit.contribution_id,
        contributor_id=audit.contributor_id,
        status=audit.status,
        reveal_by=audit.reveal_by,
        claimed_by=audit.claimed_by,
        cosine=audit.cosine,
        rel_error=audit.rel_error,
        norm_ratio=audit.norm_ratio,
        detail=audit.detail,
        created_at=audit.created_at,
        decided_at=audit.decided_at,
    )


async def get(session: AsyncSession, run_id: str, audit_id: str, *, lock: bool = False) -> Audit:
    query = select(Audit).where(Audit.id == audit_id, Audit.run_id == run_id)
    found = await session.scalar(query.with_for_update() if lock else query)
    if found is None:
        raise NotFound(f"run {run_id} has no audit {audit_id!r}; GET its audits to list them")
    return found


async def reveal(
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    *,
    run_id: str,
    audit_id: str,
    contributor_id: str,
    content_length: str | None,
    stream: AsyncIterator[bytes],
    now: datetime,
) -> AuditView:
    """Store the AdamW state an audited lease began from: the audit's contributor only,
    while it is waiting for it, and only the file whose SHA-256 the upload committed to
    (anything else is refused and nothing stays). The audit is then pending."""
    async with sessions() as session:
        audit = await get(session, run_id, audit_id)
        run = await session.get(Run, run_id)
        committed = await session.scalar(
            select(Contribution.replay).where(Contribution.id == audit.contribution_id)
        )
    if audit.contributor_id != contributor_id:
        raise Forbidden(f"audit {audit_id} is of another contributor's upload")
    if audit.status != AuditStatus.REVEALING or now > audit.reveal_by:
        raise InvalidTransition(
            f"audit {audit_id} is {audit.status}: it is not waiting for a state "
            f"(a state is taken until {audit.reveal_by.isoformat()})",
            status=audit.status,
        )
    assert run is not None and committed is not None  # a revealing audit has both
    limit = max_state_bytes(run.n_params)
    if content_length is None:
        raise LengthRequired("send the state with a Content-Length header")
    declared_length(content_length, limit=limit, what="a revealed state", too_large=UploadTooLarge)
    key = keys.audit_state(run_id, audit_id)
    nbytes = await _store(storage, key, stream, limit=limit, sha256=committed["start"])
    async with sessions() as session, session.begin():
        moved = await session.scalar(
            update(Audit)
            .where(Audit.id == audit_id, Audit.status == AuditStatus.REVEALING)
            .values(status=AuditStatus.PENDING, state_key=key, state_nbytes=nbytes)
            .returning(Audit)
        )
    if moved is None:  # decided meanwhile (its time ran out): the state is not needed
        await asyncio.to_thread(storage.delete, key)
        raise InvalidTransition(f"audit {audit_id} was decided while the state arrived")
    return view(moved)


async def _store(
    storage: Storage, key: str, stream: AsyncIterator[bytes], *, limit: int, sha256: str
) -> int:
    """The body into ``key``, committed only if it is at most ``limit`` bytes and its
    SHA-256 is ``sha256``; its size."""

    def check(digest: str, got: int) -> None:
        if digest != sha256:
            raise InvalidData(
                "the state's SHA-256 is not the one the upload committed to "
                "(its replay record's start); nothing was kept"
            )

    def over() -> HubError:
        return UploadTooLarge(f"the state is over the {limit}-byte limit")

    return await write_checked(
        storage, key, stream, limit=limit, too_large=over, check=check, what="the state"
    )


async def expire(session: AsyncSession, run_id: str, now: datetime) -> None:
    """Fail the run's audits whose volunteer did not reveal its state in time."""
    late = list(
        await session.scalars(
            select(Audit)
            .where(
                Audit.run_id == run_id,
                Audit.status == AuditStatus.REVEALING,
                Audit.reveal_by < now,
            )
            .with_for_update(skip_locked=True)
        )
    )
    for audit in late:
        await _fail(
            session,
            audit,
            "the volunteer did not reveal the AdamW state its lease began from by "
            f"{audit.reveal_by.isoformat()}",
            now,
        )


async def listed(
    session: AsyncSession, run_id: str, status: AuditStatus | None, now: datetime
) -> list[AuditView]:
    await expire(session, run_id, now)
    query = select(Audit).where(Audit.run_id == run_id)
    if status is not None:
        query = query.where(Audit.status == status)
    rows = await session.scalars(query.order_by(Audit.created_at, Audit.id).limit(1000))
    return [view(a) for a in rows]


async def waiting(session: AsyncSession, run_id: str, contributor_id: str) -> WaitingAudits:
    """The contributor's audits in the run that wait for its starting state, oldest first,
    each with the digest its upload committed to."""
    rows = await session.execute(
        select(Audit, Contribution.replay)
        .join(Contribution, Contribution.id == Audit.contribution_id)
        .where(
            Audit.run_id == run_id,
            Audit.contributor_id == contributor_id,
            Audit.status == AuditStatus.REVEALING,
        )
        .order_by(Audit.created_at, Audit.id)
        .limit(100)
    )
    return WaitingAudits(
        audits=[
            WaitingAudit(
                id=a.id,
                round=a.round_index,
                contribution_id=a.contribution_id,
                start=replay["start"],
                reveal_by=a.reveal_by,
            )
            for a, replay in rows.all()
            if replay is not None
        ]
    )


async def claim(
    session: AsyncSession, run_id: str, verifier: str, now: datetime
) -> AuditView | None:
    """The oldest pending audit of the run no other verifier holds, now held by
    ``verifier`` for ``CLAIM_S``; None when there is none."""
    await expire(session, run_id, now)
    audit = await session.scalar(
        select(Audit)
        .where(
            Audit.run_id == run_id,
            Audit.status == AuditStatus.PENDING,
            or_(Audit.claimed_until.is_(None), Audit.claimed_until < now),
        )
        .order_by(Audit.created_at, Audit.id)
        .limit(1)
        .with_for_update(skip_locked=True)
    )
    if audit is None:
        return None
    audit.claimed_by, audit.claimed_until = verifier, now + timedelta(seconds=CLAIM_S)
    return view(audit)


async def decide(
    session: AsyncSession,
    run_id: str,
    audit_id: str,
    verifier: str,
    result: AuditResult,
    now: datetime,
) -> tuple[AuditView, str | None]:
    """Record a verifier's finding on a pending audit: passed or failed by the figures
    (``Verdict``), or failed with the verifier's sentence. With it, the key of a passed
    audit's revealed state, no longer named by the audit, for the caller to delete once
    this commits (a failed one's stays: the evidence)."""
    audit = await get(session, run_id, audit_id, lock=True)
    if audit.status != AuditStatus.PENDING:
        raise InvalidTransition(
            f"audit {audit_id} is {audit.status}, not pending: it cannot be decided now",
            status=audit.status,
        )
    if result.failure is not None:
        await _fail(session, audit, f"the verifier could not replay it: {result.failure}", now)
    else:
        assert result.cosine is not None and result.rel_error is not None
        assert result.norm_ratio is not None
        verdict = Verdict(result.cosine, result.rel_error, result.norm_ratio)
        audit.cosine, audit.rel_error = verdict.cosine, verdict.rel_error
        audit.norm_ratio = verdict.norm_ratio
        if verdict.passed:
            audit.status, audit.detail, audit.decided_at = (
                AuditStatus.PASSED,
                verdict.sentence(),
                now,
            )
        else:
            await _fail(session, audit, verdict.sentence(), now)
    audit.claimed_by = verifier
    if audit.status == AuditStatus.PASSED:  # a failure settled the credit in _fail
        await escrow.after_decision(session, audit)
    released = None
    if audit.status == AuditStatus.PASSED and audit.state_key is not None:
        released, audit.state_key = audit.state_key, None
    return view(audit), released


async def _fail(session: AsyncSession, audit: Audit, detail: str, now: datetime) -> None:
    audit.status, audit.detail, audit.decided_at = AuditStatus.FAILED, detail, now
    await session.execute(
        update(Contribution)
        .where(Contribution.id == audit.contribution_id)
        .values(
            excluded_code=CODE,
            excluded_reason=f"audit {audit.id}: {detail}",
            credit=0.0,
            credit_status=CreditStatus.FORFEITED,
        )
    )
    await escrow.after_decision(session, audit)  # the contributor's pending credit before it
    await quarantine.review(session, [audit.contributor_id], now)
    await notify.rounds_changed(session, audit.run_id)
