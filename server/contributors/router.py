from __future__ import annotations

from fastapi import APIRouter

from server.auth import AdminAuth, ContributorAuth
from server.contributors import service
from server.contributors.schemas import (
    BanState,
    ContributorCreate,
    ContributorCreated,
)
from server.db import SessionDep
from server.http import ratelimit
from server.http.inputs import ContributorId
from server.http.ratelimit import Action

router = APIRouter(prefix="/api/v1/contributors", tags=["contributors"])


@router.post("", status_code=201, dependencies=ratelimit.depends(Action.REGISTER))
async def register(body: ContributorCreate, session: SessionDep) -> ContributorCreated:
    """Register a volunteer; the token in the answer is shown only this once."""
    contributor, token = await service.register(session=session, name=body.name)
    return ContributorCreated(id=contributor.id, name=contributor.name, token=token)


@router.post("/me/token")
async def rotate_token(contributor: ContributorAuth, session: SessionDep) -> ContributorCreated:
    """A new token, shown only this once; the one sent stops working at once (401)."""
    token = await service.rotate_token(session=session, contributor=contributor)
    return ContributorCreated(id=contributor.id, name=contributor.name, token=token)


@router.post("/{contributor_id}/unban")
async def unban(contributor_id: ContributorId, _: AdminAuth, session: SessionDep) -> BanState:
    """Lift a ban (admin token): the token works again; excluded work stays excluded."""
    return await service.unban(session=session, contributor_id=contributor_id)
