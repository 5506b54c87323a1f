from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from server import ratelimit
from server.auth import AdminAuth, ContributorAuth, ContributorReadAuth
from server.contributors import service
from server.contributors.schemas import (
    BanIn,
    BanState,
    ContributorCreate,
    ContributorCreated,
    Leaderboard,
    Order,
    Profile,
    ProfileUpdate,
    SortKey,
)
from server.db import SessionDep
from server.inputs import ContributorId, RunFilter
from server.ratelimit import Action

router = APIRouter(prefix="/api/v1/contributors", tags=["contributors"])


@router.post("", status_code=201, dependencies=ratelimit.depends(Action.REGISTER))
async def register(body: ContributorCreate, session: SessionDep) -> ContributorCreated:
    """Register a volunteer; the token in the answer is shown only this once."""
    contributor, token = await service.register(session=session, name=body.name)
    return ContributorCreated(id=contributor.id, name=contributor.name, token=token)


@router.get("/me")
async def me(contributor: ContributorReadAuth, session: SessionDep) -> Profile:
    """Your record: totals, per run, the newest contributions. Does not count as activity."""
    return await service.profile(session=session, contributor=contributor)


@router.patch("/me")
async def update_me(
    body: ProfileUpdate, contributor: ContributorAuth, session: SessionDep
) -> Profile:
    """Report your machine (the client does this when it starts)."""
    updated = await service.set_hardware(
        session=session, contributor_id=contributor.id, hardware=body.hardware
    )
    return await service.profile(session=session, contributor=updated)


@router.post("/me/token")
async def rotate_token(contributor: ContributorAuth, session: SessionDep) -> ContributorCreated:
    """A new token, shown only this once; the one sent stops working at once (401)."""
    token = await service.rotate_token(session=session, contributor=contributor)
    return ContributorCreated(id=contributor.id, name=contributor.name, token=token)


@router.post("/{contributor_id}/ban")
async def ban(
    contributor_id: ContributorId, body: BanIn, _: AdminAuth, session: SessionDep
) -> BanState:
    """Ban a contributor (admin token): its token is refused with 403 ``banned`` from now
    on, its work in rounds not yet closed is excluded (no credit) and its leases released."""
    return await service.ban(
        session=session, contributor_id=contributor_id, reason=body.reason, now=datetime.now(UTC)
    )


@router.post("/{contributor_id}/unban")
async def unban(contributor_id: ContributorId, _: AdminAuth, session: SessionDep) -> BanState:
    """Lift a ban (admin token): the token works again; excluded work stays excluded."""
    return await service.unban(session=session, contributor_id=contributor_id)


@router.get("")
async def leaderboard(
    session: SessionDep,
    run: RunFilter = None,
    sort: SortKey = SortKey.CREDIT,
    order: Order | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
) -> Leaderboard:
    """Contributors ranked by credit (training FLOPs put into outer steps) or another key;
    with ``run``, only that run's contributors and figures."""
    return await service.leaderboard(
        session=session,
        run_id=run,
        sort=sort,
        order=order or service.default_order(sort),
        limit=limit,
        offset=offset,
    )
