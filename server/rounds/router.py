from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, BackgroundTasks, Request, Response

from server.auth import ContributorAuth
from server.db import SessionDep
from server.errors import HubError
from server.inputs import RoundIndex, RunId
from server.metrics import UPLOAD_BYTES, UPLOADS
from server.rounds import ingest, leases, rejections
from server.rounds import service as rounds_service
from server.rounds.schemas import (
    ContributionOut,
    HeartbeatIn,
    HeartbeatOut,
    LeaseOut,
    RoundContributions,
    RoundList,
)
from server.runs import service as runs_service

router = APIRouter(prefix="/api/v1/runs/{run_id}", tags=["rounds"])


@router.get("/rounds")
async def list_rounds(run_id: RunId, session: SessionDep) -> RoundList:
    await runs_service.get(session=session, run_id=run_id)
    return RoundList(rounds=await rounds_service.list_rounds(session=session, run_id=run_id))


@router.get("/rounds/{index}/contributions")
async def round_contributions(
    run_id: RunId, index: RoundIndex, session: SessionDep
) -> RoundContributions:
    """The round's accepted contributions and its latest refused uploads, with reasons."""
    await runs_service.get(session=session, run_id=run_id)
    return await rejections.round_contributions(session=session, run_id=run_id, index=index)


@router.post("/join")
async def join(
    run_id: RunId, request: Request, session: SessionDep, contributor: ContributorAuth
) -> LeaseOut:
    """A lease on the open round: what to download, how many steps, until when."""
    run = await runs_service.get(session=session, run_id=run_id)
    return await leases.join(
        session=session,
        settings=request.app.state.settings,
        run=run,
        contributor_id=contributor.id,
        now=datetime.now(UTC),
    )


@router.post("/rounds/{index}/heartbeat")
async def heartbeat(
    run_id: RunId,
    index: RoundIndex,
    body: HeartbeatIn,
    request: Request,
    session: SessionDep,
    contributor: ContributorAuth,
) -> HeartbeatOut:
    lease, rnd = await leases.heartbeat(
        session=session,
        settings=request.app.state.settings,
        run_id=run_id,
        index=index,
        contributor_id=contributor.id,
        lease_id=body.lease_id,
        step=body.step,
        loss=body.loss,
        now=datetime.now(UTC),
    )
    return HeartbeatOut(
        lease_expires_at=lease.expires_at, round_state=rnd.state, deadline=rnd.deadline
    )


@router.delete("/rounds/{index}/lease", status_code=204)
async def release_lease(
    run_id: RunId,
    index: RoundIndex,
    request: Request,
    session: SessionDep,
    contributor: ContributorAuth,
    after: BackgroundTasks,
) -> None:
    """Give up your lease on the round now (you are stopping), so that a round waiting only
    for you can close. Idempotent; 404 no_lease if you never held one."""
    await runs_service.get(session=session, run_id=run_id)
    await leases.release(
        session=session,
        run_id=run_id,
        index=index,
        contributor_id=contributor.id,
        now=datetime.now(UTC),
    )
    after.add_task(request.app.state.sweeper.wake)  # after the commit: the sweep must see it


@router.put(
    "/rounds/{index}/contribution",
    status_code=201,
    responses={200: {"description": "an identical retry of an accepted upload"}},
)
async def contribution(
    run_id: RunId,
    index: RoundIndex,
    request: Request,
    response: Response,
    contributor: ContributorAuth,
) -> ContributionOut:
    """The upload body of docs/protocol.md, streamed. 2xx means durable."""
    state = request.app.state
    try:
        accepted = await ingest.receive(
            sessions=state.sessions,
            storage=state.storage,
            settings=state.settings,
            run_id=run_id,
            index=index,
            contributor_id=contributor.id,
            content_length=request.headers.get("content-length"),
            stream=request.stream(),
        )
    except HubError as err:
        UPLOADS.labels(err.code).inc()
        await rejections.record(
            sessions=state.sessions,
            run_id=run_id,
            index=index,
            contributor_id=contributor.id,
            error=err,
            now=datetime.now(UTC),
        )
        raise
    UPLOADS.labels("accepted" if accepted.created else "retry").inc()
    if accepted.created:
        UPLOAD_BYTES.inc(int(request.headers.get("content-length", "0")))
        state.sweeper.wake()  # the target may be reached: close without waiting a sweep
    else:
        response.status_code = 200
    return accepted.out
