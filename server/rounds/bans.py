"""What banning a contributor changes in the rounds.

In the ban's own transaction (``withdraw``): the contributor's accepted work that no
published step has used yet is excluded (``excluded_code = "banned"``: decide_close no
longer counts it, the next close does not read it, it earns no credit) and its live leases
are released (a round waiting for it need not). A close whose compute had already read such
work finds out when it publishes (``used_banned``) and publishes nothing; the round is
computed again at once without it (``server.rounds.closing``).

The two cannot both miss each other: ``withdraw`` excludes only rows no step has marked
aggregated, and ``used_banned`` locks the rows its step used before looking, so whichever
transaction comes second sees the first one's writes.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.protocol.audit import CODE as AUDIT_FAILED
from diloco.protocol.reputation import CODE as QUARANTINED
from diloco.protocol.state import RoundState
from server.contributors.models import Contributor
from server.rounds import notify
from server.rounds.models import Contribution, Lease, Round
from server.runs.models import RunBan

EXCLUDED_CODE = "banned"


async def withdraw(
    *,
    session: AsyncSession,
    contributor_id: str,
    reason: str,
    now: datetime,
    run_id: str | None = None,
) -> tuple[int, int]:
    """Exclude the contributor's pending contributions and release its live leases (in
    run ``run_id`` only, when given: a ban from one run); how many of each. Wakes the round
    workers of every run concerned."""
    why = "banned" if run_id is None else "banned from this run by its owner"
    excluded = await exclude_pending(
        session, contributor_id, EXCLUDED_CODE, f"its contributor was {why}: {reason}", run_id
    )
    leases = [Lease.contributor_id == contributor_id, Lease.expires_at > now]
    if run_id is not None:
        leases.append(Lease.run_id == run_id)
    released = list(
        await session.scalars(
            update(Lease).where(*leases).values(expires_at=now).returning(Lease.run_id)
        )
    )
    for run_id in sorted(set(excluded) | set(released)):  # a round may close (or wait) now
        await notify.rounds_changed(session, run_id)
    return len(excluded), len(released)


async def exclude_pending(
    session: AsyncSession, contributor_id: str, code: str, reason: str, run_id: str | None = None
) -> list[str]:
    """Exclude the contributor's work that no step has used and whose step is still
    pending (a ban's, a quarantine's: ``server.rounds.quarantine``), in run ``run_id``
    only when given; the runs of the rows excluded, one per row."""
    unfinished = select(Round.run_id, Round.index).where(Round.state != RoundState.CLOSED)
    if run_id is not None:
        unfinished = unfinished.where(Round.run_id == run_id)
    return list(
        await session.scalars(
            update(Contribution)
            .where(
                Contribution.contributor_id == contributor_id,
                Contribution.aggregated_at.is_(None),
                Contribution.excluded_code.is_(None),
                # the step that takes it (late work: a later round than its own) is pending
                tuple_(Contribution.run_id, Contribution.merged_into_round).in_(unfinished),
            )
            .values(excluded_code=code, excluded_reason=reason)
            .returning(Contribution.run_id)
        )
    )


async def used_banned(*, session: AsyncSession, contribution_ids: list[str]) -> list[str]:
    """Of the contributions a step used, those a ban, a quarantine or a failed audit has
    excluded since it read them. Locks them all first (a ban in flight is waited for), then
    looks at their latest state."""
    if not contribution_ids:
        return []
    rows = await session.execute(
        select(Contribution.id, Contribution.excluded_code)
        .where(Contribution.id.in_(contribution_ids))
        .order_by(Contribution.id)  # one lock order for every publisher
        .with_for_update()
    )
    return [cid for cid, code in rows if code in (EXCLUDED_CODE, QUARANTINED, AUDIT_FAILED)]


# ---------------------------------------------------------------- bans from one run


async def ban_from_run(
    *, session: AsyncSession, run_id: str, contributor_id: str, reason: str, by: str, now: datetime
) -> tuple[RunBan, int, int]:
    """Ban the contributor from run ``run_id`` (its owner's or the admin's word): its joins
    and uploads there are refused (403 ``banned_from_run``) from this commit on, its work in
    the run's rounds not yet closed is excluded and its leases there released. The
    contributor's row is locked first: an upload being recorded (which holds it ``FOR
    SHARE``) either commits before, and is excluded here, or waits and sees the ban. Banning
    again replaces the reason and keeps the first time."""
    await session.execute(
        select(Contributor.id).where(Contributor.id == contributor_id).with_for_update()
    )
    row = await session.scalar(
        insert(RunBan)
        .values(
            run_id=run_id, contributor_id=contributor_id, reason=reason, banned_by=by, banned_at=now
        )
        .on_conflict_do_update(
            index_elements=["run_id", "contributor_id"], set_={"reason": reason, "banned_by": by}
        )
        .returning(RunBan)
    )
    assert row is not None
    excluded, released = await withdraw(
        session=session, contributor_id=contributor_id, reason=reason, now=now, run_id=run_id
    )
    return row, excluded, released


async def lift_run_ban(*, session: AsyncSession, run_id: str, contributor_id: str) -> bool:
    """Lift a ban from one run; whether there was one. Excluded work stays excluded."""
    lifted = await session.scalar(
        delete(RunBan)
        .where(RunBan.run_id == run_id, RunBan.contributor_id == contributor_id)
        .returning(RunBan.contributor_id)
    )
    return lifted is not None


async def run_bans(session: AsyncSession, run_id: str) -> list[tuple[RunBan, str]]:
    """The run's bans, newest first, with each contributor's name."""
    rows = await session.execute(
        select(RunBan, Contributor.name)
        .join(Contributor, Contributor.id == RunBan.contributor_id)
        .where(RunBan.run_id == run_id)
        .order_by(RunBan.banned_at.desc())
    )
    return [(ban, name) for ban, name in rows]


async def run_ban_reason(session: AsyncSession, run_id: str, contributor_id: str) -> str | None:
    """Why the contributor is banned from the run (None: it is not)."""
    return await session.scalar(
        select(RunBan.reason).where(
            RunBan.run_id == run_id, RunBan.contributor_id == contributor_id
        )
    )
