from __future__ import annotations

import secrets

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from server.auth import hash_token, new_token
from server.contributors.models import Contributor
from server.contributors.schemas import LeaderboardEntry
from server.rounds.models import Contribution


async def register(*, session: AsyncSession, name: str) -> tuple[Contributor, str]:
    token = new_token("ctr")
    contributor = Contributor(
        id=f"ctr_{secrets.token_hex(6)}", name=name, token_hash=hash_token(token)
    )
    session.add(contributor)
    await session.flush()
    return contributor, token


async def leaderboard(*, session: AsyncSession, limit: int = 100) -> list[LeaderboardEntry]:
    accepted = func.count(Contribution.id)
    tokens = func.coalesce(func.sum(Contribution.tokens), 0)
    rows = await session.execute(
        select(Contributor.id, Contributor.name, accepted, tokens)
        .outerjoin(Contribution, Contribution.contributor_id == Contributor.id)
        .group_by(Contributor.id)
        .order_by(tokens.desc(), Contributor.created_at)
        .limit(limit)
    )
    return [
        LeaderboardEntry(id=i, name=n, accepted=int(a), tokens=int(t)) for i, n, a, t in rows.all()
    ]
