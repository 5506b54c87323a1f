from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response

from server.auth import ContributorAuth, bearer_token
from server.db import SessionDep
from server.http import ratelimit
from server.http.errors import HubError, TooManyUploads
from server.http.inputs import RoundIndex, RunId
from server.http.ratelimit import Action
from server.metrics import UPLOAD_BYTES, UPLOADS
from server.rounds import direct, heartbeats, ingest, leases, notify, rejections
from server.rounds import service as rounds_service
from server.rounds.schemas import (
    HeartbeatIn,
    HeartbeatOut,
    JoinIn,
    Lease,
    Receipt,
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
async def join(run_id: RunId, request: Request, body: JoinIn | None = None) -> Lease:
    """A lease on the open round: what to download, how many steps, until when (contributor
    token). The optional body's ``tokens_per_s`` (the volunteer's measured speed) sizes the
    lease's ``inner_steps`` to finish before the deadline. 409 ``run_not_active``: wait
    while paused, else stop; ``round_closing`` and ``already_contributed``: join again
    after ``retry_after_s``."""
    return await leases.join(
        pool=request.app.state.fast_pool,
        settings=request.app.state.settings,
        storage=request.app.state.storage,
        pulse=request.app.state.pulse,
        token=bearer_token(request),
        run_id=run_id,
        now=datetime.now(UTC),
        tokens_per_s=None if body is None else body.tokens_per_s,
    )


@router.post("/rounds/{index}/heartbeat")
async def heartbeat(
    run_id: RunId,
    index: RoundIndex,
    body: HeartbeatIn,
    request: Request,
) -> HeartbeatOut:
    """Keep your lease live while you train (contributor token); the answer's
    ``heartbeat_interval_s`` is how often to heartbeat from now on. 409 ``round_closed``,
    ``no_lease`` or ``run_not_active``: stop training for this round."""
    return await heartbeats.answer(
        request.app.state, token=bearer_token(request), run_id=run_id, index=index, beat=body
    )


@router.delete("/rounds/{index}/lease", status_code=204)
async def release_lease(
    run_id: RunId,
    index: RoundIndex,
    session: SessionDep,
    contributor: ContributorAuth,
) -> None:
    """Give up your lease on the round now (you are stopping), so that a round waiting only
    for you can close. Idempotent; 409 ``no_lease`` if you never held one."""
    await runs_service.get(session=session, run_id=run_id)
    await leases.release(
        session=session,
        run_id=run_id,
        index=index,
        contributor_id=contributor.id,
        now=datetime.now(UTC),
    )
    await notify.rounds_changed(session, run_id)  # the round may close now: wake the workers


@router.put(
    "/rounds/{index}/contribution",
    status_code=201,
    responses={200: {"description": "an identical retry of an accepted upload"}},
    dependencies=ratelimit.depends(Action.UPLOAD),  # before the token or a byte of the body
)
async def contribution(
    run_id: RunId,
    index: RoundIndex,
    request: Request,
    response: Response,
    contributor: ContributorAuth,
) -> Receipt:
    """The upload body of docs/protocol.md, streamed. 2xx means durable. 429
    ``too_many_uploads``: wait ``Retry-After`` seconds; 408 ``request_timeout``: the body
    stalled and was dropped, send it again."""
    accepted = await _accept(
        request,
        run_id,
        index,
        contributor.id,
        ingest.receive,
        content_length=request.headers.get("content-length"),
        stream=request.stream(),
    )
    if accepted.created:
        UPLOAD_BYTES.inc(int(request.headers.get("content-length", "0")))
    else:
        response.status_code = 200
    return accepted.out


@router.post(
    "/rounds/{index}/contribution/commit",
    status_code=201,
    responses={200: {"description": "an identical retry of an accepted upload"}},
    dependencies=ratelimit.depends(Action.UPLOAD),
)
async def commit_contribution(
    run_id: RunId,
    index: RoundIndex,
    request: Request,
    response: Response,
    contributor: ContributorAuth,
) -> Receipt:
    """A direct upload (runs on object storage): after PUTting the body to the lease's
    ``upload.url``, ask the server to check it there and accept it. Answers as the
    proxied upload does (2xx means durable); 404 ``not_found``: nothing was PUT, or this
    run takes uploads through the server."""
    accepted = await _accept(request, run_id, index, contributor.id, direct.commit)
    if not accepted.created:
        response.status_code = 200
    return accepted.out


async def _accept(
    request: Request,
    run_id: str,
    index: int,
    contributor_id: str,
    receive: Callable[..., Awaitable[ingest.Accepted]],
    **body: Any,
) -> ingest.Accepted:
    """``receive`` one upload (its ``body`` arguments) under an upload slot; count it, and
    record a refusal."""
    state = request.app.state
    try:
        # a slot is taken before the body is read, and given back whatever happens
        with state.upload_slots.hold(contributor_id):
            accepted = await receive(
                sessions=state.sessions,
                storage=state.storage,
                settings=state.settings,
                run_id=run_id,
                index=index,
                contributor_id=contributor_id,
                **body,
            )
    except TooManyUploads as err:  # counted, not recorded: a flood must not write rows
        UPLOADS.labels(err.code).inc()
        raise
    except HubError as err:
        UPLOADS.labels(err.code).inc()
        await rejections.record(
            sessions=state.sessions,
            run_id=run_id,
            index=index,
            contributor_id=contributor_id,
            error=err,
            now=datetime.now(UTC),
        )
        raise
    UPLOADS.labels("accepted" if accepted.created else "retry").inc()
    return accepted
