"""Checkpoint versions: files first (atomic), rows after.

Each version is up to three files under ``runs/<id>/checkpoints/``: ``<v>.safetensors``
holds the parameters (what volunteers download, ETag = its sha256),
``<v>.state.safetensors`` the outer momentum and the delta residual (what a restarted
server continues from, bit-identically), and ``<v>.delta.safetensors`` the int8 delta from
``v − 1`` (``diloco.wire.delta``; what a returning volunteer downloads instead). A close writes
them chunk by chunk (``server.rounds.outer_step``) and publishes the row once the delta is
durable; the parameters and the outer state follow (``server.rounds.full_files``), and until
they are durable the row's ``full_files_at`` is NULL and the parameters' download answers
``503 checkpoint_pending`` (``check_full``). ``write_initial`` writes version 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.checkpoint import write_initial_state, write_params
from server.checkpoints.models import Checkpoint
from server.http.errors import CheckpointPending, Gone, NotFound
from server.settings import Settings
from server.storage import keys
from server.storage.base import Storage
from server.storage.files import read_url
from server.storage.staging import Stage

API = "/api/v1"
PENDING_RETRY_S = 5  # the Retry-After of a version whose parameters are not yet durable


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
    *, run_id: str, version: int, sha256: str, nbytes: int, delta_sha256: str, delta_nbytes: int
) -> VersionFiles:
    """The files a close wrote (``server.rounds.outer_step``), as the row records them: the
    parameters' sha256 and size as written, committed or not yet."""
    at = keys.version(run_id, version)
    return VersionFiles(
        version, at.params, at.state, sha256, nbytes, at.delta, delta_sha256, delta_nbytes
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


def row_for(
    files: VersionFiles,
    *,
    run_id: str,
    eval_loss: float | None,
    pending: tuple[dict, datetime] | None = None,
) -> Checkpoint:
    """The version's row; ``pending``: its full files are not yet durable, with what a
    rebuild of them needs (``server.rounds.full_files.Recipe``) and until when the caller
    holds them (it commits them next)."""
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
        full_files_at=None if pending else datetime.now(UTC),
        full_claim_expires_at=pending[1] if pending else None,
        rebuild=pending[0] if pending else None,
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


def params_url(
    settings: Settings, storage: Storage, *, run_id: str, version: int, durable: bool
) -> str:
    """Where a volunteer downloads a version's parameters (``read_url``); this server's own
    route while they are not yet ``durable``: it answers 503 ``checkpoint_pending`` until
    they are, where a bucket would answer a bare 404."""
    route = f"{API}/runs/{run_id}/checkpoints/{version}"
    return (
        read_url(settings, storage, keys.version(run_id, version).params, route)
        if durable
        else route
    )


def check_full(row: Checkpoint) -> Checkpoint:
    """The row, if its parameters file is durable; else 503 ``checkpoint_pending`` with
    Retry-After (it is, seconds after the close: ``server.rounds.full_files``)."""
    if row.full_files_at is None:
        raise CheckpointPending(
            f"checkpoint version {row.version} of run {row.run_id} is published with its delta; "
            f"its parameters file is being written. Ask again in {PENDING_RETRY_S} s, or catch "
            f"up from an older version by its deltas: {API}/runs/{row.run_id}/checkpoints/"
            f"{row.version}/catch-up?from=<the version you hold>",
            retry_after_s=PENDING_RETRY_S,
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
