"""Contributors: registration, the hardware report, token rotation, bans and unbans.

What contributors did (their record, the leaderboard) and a ban's withdrawal of their work
read and change the rounds: ``server.contributions``.
"""

from __future__ import annotations

import secrets
from datetime import datetime

from sqlalchemy import func, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.auth import hash_token, new_token
from server.contributors.models import Contributor
from server.contributors.schemas import (
    BanState,
    Hardware,
)
from server.http.errors import NotFound, Unauthorized


async def register(*, session: AsyncSession, name: str) -> tuple[Contributor, str]:
    token = new_token("ctr")
    contributor = Contributor(
        id=f"ctr_{secrets.token_hex(6)}", name=name, token_hash=hash_token(token)
    )
    session.add(contributor)
    await session.flush()
    return contributor, token


async def set_hardware(
    *, session: AsyncSession, contributor_id: str, hardware: Hardware
) -> Contributor:
    """Replace the stored hardware report (only the fields the client sent are kept)."""
    updated = await session.scalar(
        update(Contributor)
        .where(Contributor.id == contributor_id)
        .values(hardware=hardware.model_dump(exclude_unset=True))
        .returning(Contributor)
    )
    if updated is None:  # deleted between authentication and now
        raise Unauthorized(f"contributor {contributor_id} no longer exists; register again")
    return updated


async def rotate_token(*, session: AsyncSession, contributor: Contributor) -> str:
    """A new token for the contributor; the one it authenticated with stops working when
    this commits. Of two rotations with the same token at once, one wins; the other is 401."""
    token = new_token("ctr")
    rotated = await session.scalar(
        update(Contributor)
        .where(Contributor.id == contributor.id, Contributor.token_hash == contributor.token_hash)
        .values(token_hash=hash_token(token))
        .returning(Contributor.id)
    )
    if rotated is None:
        raise Unauthorized("this token was rotated or revoked meanwhile; use the new one")
    return token


# ---------------------------------------------------------------- bans (admin)


async def mark_banned(
    *, session: AsyncSession, contributor_id: str, reason: str, now: datetime
) -> Contributor:
    """Mark the contributor banned: its token is refused from this commit on (403 banned).
    Banning again replaces the reason and keeps the first ban's time. Withdrawing its work
    from the rounds is ``server.contributions.service.ban``'s."""
    banned = await session.scalar(
        update(Contributor)
        .where(Contributor.id == contributor_id)
        .values(
            banned_at=func.coalesce(Contributor.banned_at, now),
            ban_reason=reason,
        )
        .returning(Contributor)
    )
    if banned is None:
        raise NotFound(f"no contributor {contributor_id!r}; GET /api/v1/contributors lists them")
    return banned


async def unban(*, session: AsyncSession, contributor_id: str) -> BanState:
    """Lift the ban: the token works again. Work the ban excluded stays excluded."""
    lifted = await session.scalar(
        update(Contributor)
        .where(Contributor.id == contributor_id)
        .values(banned_at=None, ban_reason=None)
        .returning(Contributor)
    )
    if lifted is None:
        raise NotFound(f"no contributor {contributor_id!r}; GET /api/v1/contributors lists them")
    return ban_state(lifted, excluded=0, released=0)


def ban_state(contributor: Contributor, *, excluded: int, released: int) -> BanState:
    return BanState(
        id=contributor.id,
        name=contributor.name,
        banned_at=contributor.banned_at,
        ban_reason=contributor.ban_reason,
        excluded=excluded,
        leases_released=released,
    )
