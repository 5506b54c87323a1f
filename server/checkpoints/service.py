"""Writing and reading checkpoint versions: files first (atomic), rows after.

Each version is two files under ``runs/<id>/checkpoints/``: ``<v>.safetensors`` holds the
parameters only (what volunteers download, ETag = its sha256) and ``<v>.state.safetensors``
adds the outer momentum (what a restarted server continues from, bit-identically).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.checkpoint import Checkpoint as LoadedCheckpoint
from diloco.checkpoint import load_checkpoint, save_checkpoint
from server.checkpoints.models import Checkpoint
from server.errors import NotFound
from server.storage import Storage


@dataclass(frozen=True)
class VersionFiles:
    version: int
    params_key: str
    state_key: str
    sha256: str
    nbytes: int


def write_version(
    storage: Storage,
    *,
    run_id: str,
    version: int,
    params: Mapping[str, torch.Tensor],
    outer_state: Mapping[str, Any],
) -> VersionFiles:
    """Write both files of a version atomically (temp, fsync, rename). Rewriting a version
    after a crash gives the same bytes, because the outer step is deterministic."""
    params_key = f"runs/{run_id}/checkpoints/{version}.safetensors"
    state_key = f"runs/{run_id}/checkpoints/{version}.state.safetensors"
    meta = {"run_id": run_id}
    storage.path(params_key).parent.mkdir(parents=True, exist_ok=True)
    sha = save_checkpoint(storage.path(params_key), params=params, version=version, metadata=meta)
    save_checkpoint(
        storage.path(state_key),
        params=params,
        version=version,
        outer_state=outer_state,
        metadata=meta,
    )
    return VersionFiles(version, params_key, state_key, sha, storage.size(params_key))


def load_state(storage: Storage, row: Checkpoint) -> LoadedCheckpoint:
    return load_checkpoint(storage.path(row.state_key))


def row_for(files: VersionFiles, *, run_id: str, eval_loss: float | None) -> Checkpoint:
    return Checkpoint(
        run_id=run_id,
        version=files.version,
        params_key=files.params_key,
        state_key=files.state_key,
        sha256=files.sha256,
        nbytes=files.nbytes,
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


async def with_deltas(
    *, session: AsyncSession, run_id: str, after: int, through: int
) -> list[Checkpoint]:
    """The versions ``after`` < v ≤ ``through`` that have a delta, in order."""
    query = (
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id)
        .where(Checkpoint.version > after, Checkpoint.version <= through)
        .where(Checkpoint.delta_key.is_not(None))
        .order_by(Checkpoint.version)
    )
    return list(await session.scalars(query))
