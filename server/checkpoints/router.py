from __future__ import annotations

from fastapi import APIRouter, Request, Response

from server.checkpoints import service
from server.db import SessionDep
from server.errors import NotFound
from server.files import serve_file
from server.inputs import CheckpointVersion, RunId, ShardIndex, checkpoint_version
from server.runs import data as run_data
from server.runs import service as runs_service

router = APIRouter(prefix="/api/v1/runs/{run_id}", tags=["checkpoints"])


@router.get("/checkpoints/{version}")
async def checkpoint(
    run_id: RunId, version: CheckpointVersion, request: Request, session: SessionDep
) -> Response:
    """The model parameters of a version (or ``latest``) as safetensors."""
    wanted = checkpoint_version(version)
    await runs_service.get(session=session, run_id=run_id)
    row = await service.get(session=session, run_id=run_id, version=wanted)
    return serve_file(
        request,
        request.app.state.storage.path(row.params_key),
        etag=row.sha256,
        media_type="application/octet-stream",
        headers={
            "X-Checkpoint-Version": str(row.version),
            "Content-Disposition": f'attachment; filename="{run_id}-v{row.version}.safetensors"',
        },
    )


@router.get("/shards/{index}")
async def shard(
    run_id: RunId, index: ShardIndex, request: Request, session: SessionDep
) -> Response:
    """A training shard: uint8 tokens, row-major (nbytes / chunk_len, chunk_len)."""
    run = await runs_service.get(session=session, run_id=run_id)
    if not 0 <= index < run.n_shards:
        raise NotFound(f"run {run_id} has shards 0..{run.n_shards - 1}, not {index}")
    return serve_file(
        request,
        request.app.state.storage.path(run_data.shard_key(run_id, index)),
        etag=run.shards[index]["sha256"],
        media_type="application/octet-stream",
        headers={"X-Chunk-Len": str(run.chunk_len)},
    )
