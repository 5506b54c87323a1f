from __future__ import annotations

from fastapi import APIRouter, Query

from server.auth import ContributorAuth
from server.contributors import service
from server.contributors.schemas import (
    ContributorCreate,
    ContributorCreated,
    ContributorOut,
    Leaderboard,
)
from server.db import SessionDep

router = APIRouter(prefix="/api/v1/contributors", tags=["contributors"])


@router.post("", status_code=201)
async def register(body: ContributorCreate, session: SessionDep) -> ContributorCreated:
    """Register a volunteer; the token in the answer is shown only this once."""
    contributor, token = await service.register(session=session, name=body.name)
    return ContributorCreated(id=contributor.id, name=contributor.name, token=token)


@router.get("/me")
async def me(contributor: ContributorAuth) -> ContributorOut:
    return ContributorOut(
        id=contributor.id, name=contributor.name, created_at=contributor.created_at
    )


@router.get("")
async def leaderboard(session: SessionDep, limit: int = Query(100, ge=1, le=1000)) -> Leaderboard:
    return Leaderboard(contributors=await service.leaderboard(session=session, limit=limit))
