from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter

from server.auth import ContributorAuth
from server.db import SessionDep
from server.http.inputs import RunId
from server.runs import service
from server.runs.access import RunManagerAuth
from server.runs.schemas import (
    Invite,
    Member,
    MemberIn,
)

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])


@router.post("/{run_id}/invite")
async def invite(run_id: RunId, session: SessionDep, _: RunManagerAuth) -> Invite:
    """Make the run private with a new invite code, shown only this once (its owner's or the
    admin token). An older code stops admitting; whoever it admitted stays a member."""
    return Invite(run_id=run_id, invite=await service.new_invite(session=session, run_id=run_id))


@router.delete("/{run_id}/invite", status_code=204)
async def drop_invite(run_id: RunId, session: SessionDep, _: RunManagerAuth) -> None:
    """Make the run public again: anyone may join (its owner's or the admin token)."""
    await service.make_public(session=session, run_id=run_id)


@router.post("/{run_id}/members")
async def join_private(
    run_id: RunId, body: MemberIn, contributor: ContributorAuth, session: SessionDep
) -> Member:
    """Become a member of a private run with its invite code (contributor token); then
    ``join`` works. Idempotent; a public run needs no membership."""
    return await service.admit(
        session=session,
        run_id=run_id,
        contributor_id=contributor.id,
        invite=body.invite,
        now=datetime.now(UTC),
    )
