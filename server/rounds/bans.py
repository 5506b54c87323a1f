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

from sqlalchemy import select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.protocol.audit import CODE as AUDIT_FAILED
from diloco.protocol.reputation import CODE as QUARANTINED
from diloco.protocol.state import RoundState
from server.rounds import notify
from server.rounds.models import Contribution, Lease, Round

EXCLUDED_CODE = "banned"


async def withdraw(
    *, session: AsyncSession, contributor_id: str, reason: str, now: datetime
) -> tuple[int, int]:
    """Exclude the contributor's pending contributions and release its live leases; how
    many of each. Wakes the round workers of every run concerned."""
    excluded = await exclude_pending(
        session, contributor_id, EXCLUDED_CODE, f"its contributor was banned: {reason}"
    )
    released = list(
        await session.scalars(
            update(Lease)
            .where(Lease.contributor_id == contributor_id, Lease.expires_at > now)
            .values(expires_at=now)
            .returning(Lease.run_id)
        )
    )
    for run_id in sorted(set(excluded) | set(released)):  # a round may close (or wait) now
        await notify.rounds_changed(session, run_id)
    return len(excluded), len(released)


async def exclude_pending(
    session: AsyncSession, contributor_id: str, code: str, reason: str
) -> list[str]:
    """Exclude the contributor's work that no step has used and whose step is still
    pending (a ban's, a quarantine's: ``server.rounds.quarantine``); the runs of the
    rows excluded, one per row."""
    unfinished = select(Round.run_id, Round.index).where(Round.state != RoundState.CLOSED)
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
