"""Prepared datasets on the server: register a manifest, receive its files one by one
(streamed into storage, each checked against the manifest's size and sha256 before it is
kept), and say what is missing. The id is the manifest's hash (``diloco.data.manifest``), so an
upload cut halfway is resumed by sending the same manifest again and only the files it
reports missing, and a dataset already there is never sent twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from sqlalchemy import update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.data.manifest import Manifest, ManifestError, dataset_id, parse_manifest
from server.datasets.models import Dataset
from server.datasets.schemas import DatasetOut, FileState
from server.http.errors import HubError, InvalidData, NotFound
from server.http.inputs import declared_length
from server.storage import keys
from server.storage.base import BlobMissing, Storage
from server.storage.files import write_checked


def manifest_of(row: Dataset) -> Manifest:
    return Manifest.model_validate(row.manifest)


def parse(raw: bytes) -> Manifest:
    try:
        return parse_manifest(raw)
    except ManifestError as err:
        raise InvalidData(f"manifest: {err}") from None


async def register(session: AsyncSession, manifest: Manifest) -> tuple[Dataset, bool]:
    """The dataset's row, inserted unless it exists; True when it is new."""
    ident = dataset_id(manifest)
    inserted = await session.scalar(
        insert(Dataset)
        .values(
            id=ident,
            manifest=manifest.model_dump(mode="json"),
            total_bytes=manifest.total_bytes,
            created_at=datetime.now(UTC),
        )
        .on_conflict_do_nothing()
        .returning(Dataset.id)
    )
    return await get(session, ident), inserted is not None


async def get(session: AsyncSession, ident: str) -> Dataset:
    row = await session.get(Dataset, ident, populate_existing=True)
    if row is None:
        raise NotFound(
            f"no dataset {ident!r}; register its manifest first (POST /api/v1/datasets, which "
            "`diloco run create` does)"
        )
    return row


def _present(storage: Storage, key: str, nbytes: int) -> bool:
    try:
        return storage.size(key) == nbytes
    except BlobMissing:
        return False


async def view(session: AsyncSession, storage: Storage, row: Dataset) -> DatasetOut:
    """The dataset with each file's state; a dataset found complete is marked so once."""
    manifest = manifest_of(row)
    files: dict[str, FileState] = {}
    for name, (nbytes, sha) in manifest.files().items():
        present = row.completed_at is not None or await asyncio.to_thread(
            _present, storage, keys.dataset_file(row.id, name), nbytes
        )
        files[name] = FileState(nbytes=nbytes, sha256=sha, present=present)
    missing = [name for name, state in files.items() if not state.present]
    if not missing and row.completed_at is None:
        row.completed_at = datetime.now(UTC)
        await session.execute(
            update(Dataset).where(Dataset.id == row.id).values(completed_at=row.completed_at)
        )
    return DatasetOut(
        id=row.id,
        complete=not missing,
        total_bytes=row.total_bytes,
        files=files,
        missing=missing,
        manifest=row.manifest,
    )


async def receive_file(
    storage: Storage,
    row: Dataset,
    name: str,
    *,
    content_length: str | None,
    stream: AsyncIterator[bytes],
) -> bool:
    """Store one file of the dataset from ``stream``; False when it was already there
    (nothing read). Kept only when its size and sha256 are the manifest's; otherwise
    InvalidData, and nothing stays."""
    expected = manifest_of(row).files().get(name)
    if expected is None:
        raise NotFound(f"dataset {row.id} has no file {name!r}; GET it for the list")
    nbytes, sha = expected
    declared_length(content_length, limit=nbytes, what=f"{name} (its manifest size)")
    if content_length != str(nbytes):
        raise InvalidData(
            f"{name}: Content-Length must be the manifest's size, {nbytes} bytes "
            f"(got {content_length!r})"
        )
    key = keys.dataset_file(row.id, name)
    if await asyncio.to_thread(_present, storage, key, nbytes):
        return False

    def check(digest: str, got: int) -> None:
        if got != nbytes:
            raise InvalidData(f"{name}: {got} bytes arrived of the manifest's {nbytes}")
        if digest != sha:
            raise InvalidData(f"{name}: its sha256 is not the manifest's; nothing was kept")

    def over() -> HubError:
        return InvalidData(f"{name}: the body is over the manifest's {nbytes} bytes")

    await write_checked(storage, key, stream, limit=nbytes, too_large=over, check=check, what=name)
    return True
