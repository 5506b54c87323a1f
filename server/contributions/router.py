"""The routes of ``/api/v1/contributors`` that read or change the rounds
(``server.contributions.service``): one's own record, the leaderboard, a ban. Registration,
token rotation and unbans are in ``server.contributors.router``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from server.auth import AdminAuth, ContributorAuth, ContributorReadAuth
from server.contributions import service
from server.contributors import service as contributors_service
from server.contributors.schemas import (
    BanIn,
    BanState,
    Leaderboard,
    Order,
    Profile,
    ProfileUpdate,
    QuarantineState,
    SortKey,
)
from server.db import SessionDep
from server.http.inputs import ContributorId, RunFilter
from server.rounds import quarantine

router = APIRouter(prefix="/api/v1/contributors", tags=["contributors"])


@router.get("/me")
async def me(contributor: ContributorReadAuth, session: SessionDep) -> Profile:
    """Your record: totals, per run, the newest contributions. Does not count as activity."""
    return await service.profile(session=session, contributor=contributor)


@router.patch("/me")
async def update_me(
    body: ProfileUpdate, contributor: ContributorAuth, session: SessionDep
) -> Profile:
    """Report your machine (the client does this when it starts)."""
    updated = await contributors_service.set_hardware(
        session=session, contributor_id=contributor.id, hardware=body.hardware
    )
    return await service.profile(session=session, contributor=updated)


@router.post("/{contributor_id}/ban")
async def ban(
    contributor_id: ContributorId, body: BanIn, _: AdminAuth, session: SessionDep
) -> BanState:
    """Ban a contributor (admin token): its token is refused with 403 ``banned`` from now
    on, its work in rounds not yet closed is excluded (no credit) and its leases released."""
    return await service.ban(
        session=session, contributor_id=contributor_id, reason=body.reason, now=datetime.now(UTC)
    )


@router.post("/{contributor_id}/unquarantine")
async def unquarantine(
    contributor_id: ContributorId, _: AdminAuth, session: SessionDep
) -> QuarantineState:
    """Lift a quarantine (admin token): its next uploads are aggregated and credited again;
    work it excluded stays excluded."""
    lifted = await quarantine.lift(session, contributor_id)
    return QuarantineState(
        id=lifted.id,
        name=lifted.name,
        quarantined_at=lifted.quarantined_at,
        quarantine_reason=lifted.quarantine_reason,
    )


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
