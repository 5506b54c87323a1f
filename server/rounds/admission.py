"""What an upload's admission looks at, and what it answers: the facts the protocol's
``admit_upload`` is asked about (read, or read again under locks, by
``server.rounds.ingest``), replays, bans, and receipts.

A receipt is built from the stored row alone, so that a retry of an upload (the same
bytes again, however much later) gets the very receipt the first answer had: its round,
the round it was merged into, its staleness and its weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.outer.inspection import UploadInspector
from diloco.protocol.messages import Receipt
from diloco.protocol.rules import admit_retry
from diloco.protocol.state import RoundState, RunStatus, UploadFacts
from server.auth import banned, banned_from_run
from server.contributors.models import Contributor
from server.http.errors import refused
from server.rounds import bans
from server.rounds import service as rounds_service
from server.rounds.models import Contribution, Lease, Round
from server.runs.models import Run


@dataclass(frozen=True)
class Accepted:
    created: bool  # False: an identical retry of an accepted upload
    out: Receipt


def receipt(row: Contribution) -> Receipt:
    """The receipt of a stored contribution: the same for its first answer and any retry."""
    return Receipt(
        contribution_id=row.id,
        round=row.round_index,
        sha256=row.sha256,
        merged_into_round=row.merged_into_round,
        staleness=row.staleness,
        weight=row.counted_weight,
    )


def retry_answer(existing: Contribution, sha: str) -> Accepted:
    """The same contributor again in the same round: its stored receipt for the same bytes,
    ``duplicate_contribution`` for others."""
    refusal = admit_retry(
        existing.sha256, sha, contribution_id=existing.id, round=existing.round_index
    )
    if refusal is not None:
        raise refused(refusal)
    return Accepted(False, receipt(existing))


async def admit_contributor(session: AsyncSession, contributor_id: str, run_id: str) -> str | None:
    """Refuse a contributor banned since its token was checked, from the hub or from run
    ``run_id``; hold its row until commit (a ban takes it ``FOR UPDATE``). Its quarantine's
    reason, when it is quarantined (its upload is taken, and excluded)."""
    row = (
        await session.execute(
            select(Contributor.banned_at, Contributor.ban_reason, Contributor.quarantine_reason)
            .where(Contributor.id == contributor_id)
            .with_for_update(read=True)
        )
    ).one_or_none()
    if row is not None and row.banned_at is not None:
        raise banned(row.ban_reason)
    from_run = await bans.run_ban_reason(session, run_id, contributor_id)
    if from_run is not None:
        raise banned_from_run(run_id, from_run)
    return None if row is None else row.quarantine_reason


async def lock_rounds(session: AsyncSession, run_id: str, index: int) -> None:
    """Hold the URL's round and the round in progress ``FOR SHARE`` until commit: neither
    can start closing (a guarded UPDATE) between the rules' word and the row's insert,
    whether the upload joins its own round or, late, the open one."""
    await session.execute(
        select(Round.index)
        .where(
            Round.run_id == run_id,
            or_(Round.index == index, Round.state != RoundState.CLOSED),
        )
        .order_by(Round.index)
        .with_for_update(read=True)
    )


async def upload_facts(
    session: AsyncSession, run: Run, index: int, contributor_id: str, *, max_staleness: int
) -> tuple[UploadFacts, Contribution | None, str | None]:
    """What admit_upload looks at, plus the existing contribution and the lease's id."""
    rnd = await session.get(Round, (run.id, index), populate_existing=True)
    existing = await session.scalar(
        select(Contribution).where(
            Contribution.run_id == run.id,
            Contribution.round_index == index,
            Contribution.contributor_id == contributor_id,
        )
    )
    lease_id = await session.scalar(
        select(Lease.id).where(
            Lease.run_id == run.id,
            Lease.round_index == index,
            Lease.contributor_id == contributor_id,
        )
    )
    current = await rounds_service.current(session=session, run_id=run.id)
    facts = UploadFacts(
        run_status=RunStatus(run.status),
        round=None if rnd is None else rounds_service.view_of(rnd),
        current_round=None if current is None else current.index,
        existing_sha256=None if existing is None else existing.sha256,
        lease_held=lease_id is not None,
        current_open=current is not None and current.state == RoundState.OPEN,
        max_staleness=max_staleness,
    )
    return facts, existing, lease_id


async def replayed(
    session: AsyncSession,
    run_id: str,
    *,
    index: int,
    step: int,
    contributor_id: str,
    inspection: UploadInspector,
) -> bool:
    """Whether another contributor's upload holds these very tensors, in the round it was
    sent for (``index``) or in the step that takes it (``step``: its round, or the open
    round a late upload joins)."""
    found = await session.scalar(
        select(Contribution.id).where(
            Contribution.run_id == run_id,
            or_(Contribution.round_index == index, Contribution.merged_into_round == step),
            Contribution.payload_sha256 == inspection.payload_sha256,
            Contribution.contributor_id != contributor_id,
        )
    )
    return found is not None
