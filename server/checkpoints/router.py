from __future__ import annotations

import sys
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from diloco.config import INT32_MAX
from diloco.protocol.messages import CatchUpPlan, CheckpointRef, DeltaRef
from diloco.wire.delta import catch_up as plan_catch_up
from server.checkpoints import service
from server.checkpoints.models import Checkpoint
from server.db import SessionDep
from server.http.errors import InvalidRequest, NotFound
from server.http.inputs import CheckpointVersion, RunId, ShardIndex, checkpoint_version
from server.runs import service as runs_service
from server.settings import Settings
from server.storage import keys
from server.storage.base import Storage
from server.storage.files import read_url, serve_blob

router = APIRouter(prefix="/api/v1/runs/{run_id}", tags=["checkpoints"])
API = "/api/v1"

FromVersion = Annotated[
    int,
    Query(
        alias="from",
        ge=0,
        le=INT32_MAX,
        description="the version the volunteer holds (0 ≤ from < version)",
    ),
]


@router.get("/checkpoints/{version}")
async def checkpoint(
    run_id: RunId, version: CheckpointVersion, request: Request, session: SessionDep
) -> Response:
    """The model parameters of a version (or ``latest``) as safetensors; 410 ``gone`` for a
    version the run's retention policy deleted, 503 ``checkpoint_pending`` (Retry-After) for
    one whose parameters are not yet durable (``server.rounds.full_files``)."""
    wanted = checkpoint_version(version)
    await runs_service.get(session=session, run_id=run_id)
    row = await service.get(session=session, run_id=run_id, version=wanted)
    row = service.check_full(service.check_retained(row))
    return serve_blob(
        request,
        row.params_key,
        etag=row.sha256,
        media_type="application/octet-stream",
        headers={
            "X-Checkpoint-Version": str(row.version),
            "Content-Disposition": f'attachment; filename="{run_id}-v{row.version}.safetensors"',
        },
        kind="checkpoint",
    )


@router.get("/checkpoints/{version}/delta")
async def delta(
    run_id: RunId, version: CheckpointVersion, request: Request, session: SessionDep
) -> Response:
    """The int8 delta from ``version − 1`` to a version (or ``latest``), as safetensors
    (``diloco.wire.delta``); 404 ``not_found`` for version 0 and versions published without one,
    410 ``gone`` for a version the run's retention policy deleted."""
    wanted = checkpoint_version(version)
    await runs_service.get(session=session, run_id=run_id)
    row = service.check_retained(await service.get(session=session, run_id=run_id, version=wanted))
    if row.delta_key is None or row.delta_sha256 is None:
        raise NotFound(
            f"checkpoint version {row.version} of run {run_id} has no delta (version 0 and "
            "versions published before deltas existed have none); download the full "
            f"checkpoint: {API}/runs/{run_id}/checkpoints/{row.version}"
        )
    return serve_blob(
        request,
        row.delta_key,
        etag=row.delta_sha256,
        media_type="application/octet-stream",
        headers={
            "X-Checkpoint-Version": str(row.version),
            "X-Base-Version": str(row.version - 1),
            "Content-Disposition": (
                f'attachment; filename="{run_id}-v{row.version}.delta.safetensors"'
            ),
        },
        kind="delta",
    )


@router.get("/checkpoints/{version}/catch-up")
async def catch_up(
    run_id: RunId,
    version: CheckpointVersion,
    from_version: FromVersion,
    request: Request,
    session: SessionDep,
) -> CatchUpPlan:
    """How a volunteer holding version ``from`` gets this version (or ``latest``): the
    deltas in order when each exists (retention deleted none of them) and together they
    are smaller than the full file, or whatever their size while its parameters are not
    yet durable, else the full checkpoint (whose URL, while they are pending, is this
    server's: it answers 503 ``checkpoint_pending`` until they are); 410 ``gone`` when the
    version asked for is itself deleted."""
    wanted = checkpoint_version(version)
    await runs_service.get(session=session, run_id=run_id)
    row = service.check_retained(await service.get(session=session, run_id=run_id, version=wanted))
    if from_version >= row.version:
        raise InvalidRequest(
            f"from: {from_version} is not older than checkpoint version {row.version}; "
            f"a volunteer catches up from a version 0..{row.version - 1}"
        )
    rows = await service.with_deltas(
        session=session, run_id=run_id, after=from_version, through=row.version
    )
    settings, storage = request.app.state.settings, request.app.state.storage
    refs = {
        r.version: ref
        for r in rows
        if (ref := _delta_ref(run_id, r, settings, storage)) is not None
    }
    sizes = {v: ref.nbytes for v, ref in refs.items()}
    full_nbytes = row.nbytes if row.full_files_at is not None else sys.maxsize  # pending
    chosen = plan_catch_up(from_version, row.version, full_nbytes=full_nbytes, delta_nbytes=sizes)
    deltas = [refs[v] for v in chosen or []]
    return CatchUpPlan(
        version=row.version,
        from_version=from_version,
        kind="deltas" if chosen else "full",
        deltas=deltas,
        full=CheckpointRef(
            url=service.params_url(
                settings,
                storage,
                run_id=run_id,
                version=row.version,
                durable=row.full_files_at is not None,
            ),
            sha256=row.sha256,
            nbytes=row.nbytes,
            version=row.version,
        ),
        delta_nbytes=sum(d.nbytes for d in deltas),
    )


def _delta_ref(
    run_id: str, row: Checkpoint, settings: Settings, storage: Storage
) -> DeltaRef | None:
    if row.delta_key is None or row.delta_sha256 is None or row.delta_nbytes is None:
        return None
    return DeltaRef(
        url=read_url(
            settings, storage, row.delta_key, f"{API}/runs/{run_id}/checkpoints/{row.version}/delta"
        ),
        sha256=row.delta_sha256,
        nbytes=row.delta_nbytes,
        version=row.version,
        base_version=row.version - 1,
    )


@router.get("/shards/{index}")
async def shard(
    run_id: RunId, index: ShardIndex, request: Request, session: SessionDep
) -> Response:
    """A training shard: a text run's uint8 tokens, row-major (nbytes / chunk_len,
    chunk_len), or a dataset run's shard file (its dtype: ``data.token_dtype``)."""
    run = await runs_service.get(session=session, run_id=run_id)
    if not 0 <= index < run.n_shards:
        raise NotFound(f"run {run_id} has shards 0..{run.n_shards - 1}, not {index}")
    return serve_blob(
        request,
        keys.training_shard(run_id, run.dataset_id, index),
        etag=run.shards[index]["sha256"],
        media_type="application/octet-stream",
        headers={"X-Chunk-Len": str(run.chunk_len)},
        kind="shard",
    )
