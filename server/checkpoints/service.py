"""Checkpoint versions: files first (atomic), rows after.

Each version is up to three files under ``runs/<id>/checkpoints/``: ``<v>.safetensors``
holds the parameters (what volunteers download, ETag = its sha256),
``<v>.state.safetensors`` the outer momentum and the delta residual (what a restarted
server continues from, bit-identically), and ``<v>.delta.safetensors`` the int8 delta from
``v − 1`` (``diloco.wire.delta``; what a returning volunteer downloads instead). A close writes
them chunk by chunk (``server.rounds.outer_step``); ``write_initial`` writes version 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.checkpoint import write_initial_state, write_params
from server.checkpoints.models import Checkpoint
from server.http.errors import Gone, NotFound
from server.storage import keys
from server.storage.base import Storage
from server.storage.staging import Stage

API = "/api/v1"


@dataclass(frozen=True)
class VersionFiles:
    version: int
    params_key: str
    state_key: str
    sha256: str
    nbytes: int
    delta_key: str | None = None  # None for version 0
    delta_sha256: str | None = None
    delta_nbytes: int | None = None


def version_files(
    storage: Storage, *, run_id: str, version: int, sha256: str, delta_sha256: str
) -> VersionFiles:
    """The files a close wrote (``server.rounds.outer_step``), as the row records them."""
    at = keys.version(run_id, version)
    return VersionFiles(
        version,
        at.params,
        at.state,
        sha256,
        storage.size(at.params),
        at.delta,
        delta_sha256,
        storage.size(at.delta),
    )


def write_initial(
    storage: Storage,
    *,
    run_id: str,
    params: Mapping[str, torch.Tensor],
    hparams: Mapping[str, Any],
) -> VersionFiles:
    """Version 0: the initial parameters, and an outer state with no momentum yet and no
    residual (both read as zeros by the first close)."""
    at = keys.version(run_id, 0)
    meta = {"run_id": run_id}
    with Stage(storage) as stage:
        sha = write_params(stage.output(at.params), params, version=0, metadata=meta)
        write_initial_state(
            stage.output(at.state), names=list(params), hparams=hparams, metadata=meta
        )
        stage.publish()
    return VersionFiles(0, at.params, at.state, sha, storage.size(at.params))


def row_for(files: VersionFiles, *, run_id: str, eval_loss: float | None) -> Checkpoint:
    return Checkpoint(
        run_id=run_id,
        version=files.version,
        params_key=files.params_key,
        state_key=files.state_key,
        sha256=files.sha256,
        nbytes=files.nbytes,
        delta_key=files.delta_key,
        delta_sha256=files.delta_sha256,
        delta_nbytes=files.delta_nbytes,
        eval_loss=eval_loss,
    )


async def get(*, session: AsyncSession, run_id: str, version: int | None) -> Checkpoint:
    """A published version; ``None`` means the latest."""
    query = select(Checkpoint).where(Checkpoint.run_id == run_id)
    if version is None:
        query = query.order_by(Checkpoint.version.desc()).limit(1)
    else:
        query = query.where(Checkpoint.version == version)
    row = await session.scalar(query)
    if row is None:
        which = "any checkpoint" if version is None else f"checkpoint version {version}"
        raise NotFound(f"run {run_id} has no {which}")
    return row


def check_retained(row: Checkpoint) -> Checkpoint:
    """The row, if its files are still kept; else 410 gone (``server.upkeep.retention``)."""
    if row.files_deleted_at is not None:
        raise Gone(
            f"checkpoint version {row.version} of run {row.run_id}: its files were deleted on "
            f"{row.files_deleted_at.isoformat()} by the run's retention policy ([retention] "
            "keep_last, milestone_every); its hashes stay. Download a version still kept: "
            f"{API}/runs/{row.run_id}/storage lists how many are, and the latest always is",
            version=row.version,
        )
    return row


async def with_deltas(
    *, session: AsyncSession, run_id: str, after: int, through: int
) -> list[Checkpoint]:
    """The versions ``after`` < v ≤ ``through`` that have a delta still kept (retention
    has not deleted it), in order."""
    query = (
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id)
        .where(Checkpoint.version > after, Checkpoint.version <= through)
        .where(Checkpoint.delta_key.is_not(None), Checkpoint.files_deleted_at.is_(None))
        .order_by(Checkpoint.version)
    )
    return list(await session.scalars(query))
