"""``/api/v1/datasets``: register a prepared dataset's manifest, upload its files one by one
(admin), read them (anyone: a run's volunteers download its shards)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from diloco.data.manifest import SHARD_NAME, TOKENIZER, VAL
from server.auth import AdminAuth
from server.datasets import service
from server.datasets.schemas import DatasetOut, StoredFile
from server.db import SessionDep
from server.http.errors import BodyTooLarge, NotFound
from server.http.inputs import declared_length
from server.storage import keys
from server.storage.files import serve_blob

router = APIRouter(prefix="/api/v1/datasets", tags=["datasets"])
MAX_MANIFEST_BYTES = 64 << 20  # a manifest of 100,000 shards is about 20 MB

DatasetId = Annotated[str, Path(pattern=r"^ds_[0-9a-f]{24}$")]
FileName = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]


def _known_name(name: str) -> None:
    if name not in (TOKENIZER, VAL) and not SHARD_NAME.match(name):
        raise NotFound(f"a dataset has no file {name!r}: tokenizer.json, val.bin, shard-NNNNN.bin")


@router.post("", status_code=201, responses={200: {"description": "already registered"}})
async def register(
    request: Request, response: Response, session: SessionDep, _: AdminAuth
) -> DatasetOut:
    """Register a dataset by its manifest (JSON body); answers which files are missing.
    Registering it again changes nothing (200): that is how an upload resumes."""
    declared_length(
        request.headers.get("content-length"), limit=MAX_MANIFEST_BYTES, what="a manifest"
    )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MANIFEST_BYTES:
            raise BodyTooLarge(f"a manifest is at most {MAX_MANIFEST_BYTES} bytes")
    manifest = service.parse(bytes(body))
    row, new = await service.register(session, manifest)
    if not new:
        response.status_code = 200
    return await service.view(session, request.app.state.storage, row)


@router.get("/{dataset_id}")
async def get_dataset(dataset_id: DatasetId, request: Request, session: SessionDep) -> DatasetOut:
    """The dataset's manifest and each file's state."""
    row = await service.get(session, dataset_id)
    return await service.view(session, request.app.state.storage, row)


@router.put(
    "/{dataset_id}/files/{name}",
    status_code=201,
    responses={200: {"description": "already stored"}},
)
async def put_file(
    dataset_id: DatasetId,
    name: FileName,
    request: Request,
    response: Response,
    session: SessionDep,
    _: AdminAuth,
) -> StoredFile:
    """One file of the dataset, the raw bytes streamed (Content-Length = its manifest size).
    Kept only if its sha256 is the manifest's; 200 without reading when already stored."""
    _known_name(name)
    row = await service.get(session, dataset_id)
    await session.commit()  # no transaction stays open while the body streams
    stored = await service.receive_file(
        request.app.state.storage,
        row,
        name,
        content_length=request.headers.get("content-length"),
        stream=request.stream(),
    )
    if not stored:
        response.status_code = 200
    return StoredFile(dataset_id=dataset_id, file=name, stored=stored)


@router.get("/{dataset_id}/files/{name}")
async def get_file(
    dataset_id: DatasetId, name: FileName, request: Request, session: SessionDep
) -> Response:
    """One stored file (ETag = its sha256; Range; a 307 to the bucket on object storage)."""
    _known_name(name)
    row = await service.get(session, dataset_id)
    entry = service.manifest_of(row).files().get(name)
    if entry is None:
        raise NotFound(f"dataset {dataset_id} has no file {name!r}")
    return serve_blob(
        request,
        keys.dataset_file(dataset_id, name),
        etag=entry[1],
        media_type="application/octet-stream",
        headers={},
        kind="shard",
    )
