"""Direct uploads: on object storage a volunteer PUTs its body straight into the bucket.

The lease carries an ``UploadTarget``: a PUT URL signed for one object,
``runs/<run>/incoming/<round>/<contributor>.bin``, and the commit URL. After its PUT the
volunteer POSTs the commit; the replica that takes it:

1. HEADs the object (its size against the round's limit, and its ETag);
2. streams it from the store through exactly the checks of a proxied upload
   (``ingest.receive``), reading with ``If-Match: <ETag>``, so that a body replaced while
   it is read fails the read instead of mixing two bodies;
3. copies it, inside the store and again only if its ETag is still the one checked, to the
   round's key (``runs/<run>/rounds/<round>/<contributor>-<hex>.bin``), which no volunteer
   can write: a later PUT to the incoming URL changes nothing that was accepted;
4. inserts the row, then removes the incoming object.

The commit's 2xx therefore means what a proxied upload's does (invariant 1): the checked
bytes are durable in the store, under a key only servers write, and the row is committed.
The volunteer's PUT answering 200 means only that the bucket holds its bytes; a refused
body is deleted from the bucket. Nothing of the body passes through the server's HTTP
side: it is read from the store to be checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator
from datetime import datetime, timedelta
from types import TracebackType

from diloco.protocol.messages import UploadTarget
from server.http.errors import MalformedUpload, NotFound, StorageFailed
from server.metrics import DIRECT_UPLOAD_BYTES
from server.rounds import ingest
from server.rounds.streaming import FEED_BYTES
from server.settings import Settings
from server.storage import keys
from server.storage.base import BlobMissing, Storage
from server.storage.s3 import MAX_SIGNED_S

API = "/api/v1"
READ_BYTES = FEED_BYTES  # one GET body read per decode batch


def upload_target(
    settings: Settings,
    storage: Storage,
    *,
    run_id: str,
    index: int,
    contributor_id: str,
    deadline: datetime,
    now: datetime,
) -> UploadTarget | None:
    """The lease's direct upload, or None where the server takes the body itself."""
    if not storage.direct:
        return None
    # until the round's deadline, and signed_url_ttl_s beyond (a late upload is refused by
    # the round, not by an expired signature)
    left = max(0.0, (deadline - now).total_seconds())
    ttl = int(min(MAX_SIGNED_S, left + settings.signed_url_ttl_s))
    key = keys.incoming(run_id, index, contributor_id)
    return UploadTarget(
        url=storage.signed_url(key, "PUT", ttl),
        expires_at=now + timedelta(seconds=ttl),
        commit_url=f"{API}/runs/{run_id}/rounds/{index}/contribution/commit",
    )


class _CopyLanding:
    """``ingest.receive``'s landing for a body already in the store: nothing is written
    while it is checked; ``commit`` copies the checked object (same ETag) to its key."""

    def __init__(self, storage: Storage, source: str, key: str, etag: str) -> None:
        self._storage, self._source, self._key, self._etag = storage, source, key, etag
        self.nbytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.nbytes += len(data)

    def commit(self) -> None:
        self._storage.copy(self._source, self._key, if_match=self._etag)

    def abort(self) -> None:
        return  # nothing was written under the round's key

    def __enter__(self) -> _CopyLanding:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return


def _next(chunks: Generator[bytes, None, None]) -> bytes | None:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return next(chunks, None)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") == "PreconditionFailed":
            raise MalformedUpload(
                "the stored upload changed while it was being checked: PUT it once, then commit"
            ) from None
        raise StorageFailed(f"the store could not be read: {err}") from None
    except BotoCoreError as err:  # the connection to the store dropped, timed out
        raise StorageFailed(f"the store could not be read: {err}") from None


async def _read(storage: Storage, key: str, etag: str) -> AsyncIterator[bytes]:
    """The object's bytes, each GET read on a worker thread (boto3 blocks)."""
    chunks = storage.read_chunks(key, READ_BYTES, if_match=etag)
    try:
        while (chunk := await asyncio.to_thread(_next, chunks)) is not None:
            yield chunk
    finally:
        await asyncio.to_thread(chunks.close)


async def commit(
    *,
    sessions: ingest.async_sessionmaker[ingest.AsyncSession],
    storage: Storage,
    settings: Settings,
    run_id: str,
    index: int,
    contributor_id: str,
) -> ingest.Accepted:
    """Check the volunteer's stored upload and accept it (module docstring)."""
    if not storage.direct:
        raise NotFound(
            f"run {run_id} takes uploads through the server: PUT the body to "
            f"{API}/runs/{run_id}/rounds/{index}/contribution"
        )
    source = keys.incoming(run_id, index, contributor_id)
    try:
        stored = await asyncio.to_thread(storage.head, source)
    except BlobMissing:
        raise NotFound(
            f"no upload of yours is in the store for round {index}: PUT the body to the "
            "lease's upload.url first, then commit"
        ) from None
    try:
        accepted = await ingest.receive(
            sessions=sessions,
            storage=storage,
            settings=settings,
            run_id=run_id,
            index=index,
            contributor_id=contributor_id,
            content_length=str(stored.nbytes),
            stream=_read(storage, source, stored.etag),
            landing=lambda key: _CopyLanding(storage, source, key, stored.etag),
        )
    finally:  # accepted (copied), a retry or refused: the incoming object has served
        await asyncio.to_thread(storage.delete, source)
    if accepted.created:
        DIRECT_UPLOAD_BYTES.inc(stored.nbytes)
    return accepted
