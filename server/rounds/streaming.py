"""An upload's body, streamed into its blob and through its checks on worker threads
(``stream_to_blob``: ``server.rounds.ingest``'s step 2, for a proxied PUT and a direct
upload's commit alike)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from diloco.outer.inspection import UploadInspector
from diloco.wire.contribution import ContributionDecoder, NonFiniteWireError, WireFormatError
from diloco.wire.digest import Part
from server.http.errors import MalformedUpload, NonFiniteUpload, UploadTooLarge
from server.storage.base import BlobWriter

# decode in batches of at least this size, off the event loop (1 MiB cost 25% more CPU)
FEED_BYTES = 4 << 20


async def stream_to_blob(
    stream: AsyncIterator[bytes],
    writer: BlobWriter,
    decoder: ContributionDecoder,
    inspection: UploadInspector,
    *,
    limit: int,
) -> None:
    """Write and decode the body: the decoder judges the header as soon as it has arrived
    (its ``on_header``, before any tensor is looked at), then streams every tensor through
    ``inspection`` (its sink: finite, the norm, the payload's digest) without holding one.

    Three stages run at once, each on a batch of chunks (at least FEED_BYTES): the event
    loop receives batch k+2 while a worker thread writes and decodes batch k+1 (the blob,
    the tensors' scan) and two more hash batch k, one the body's SHA-256 (checked against
    the trailer by ``decoder.finish``), the other the payload's (``decoder`` and
    ``inspection`` were made with ``digest_later``: ``diloco.wire.digest``). With the
    body's hash on the decoding thread, that thread was the stage the others waited for
    (~90 ms of CPU per 50 MB upload against ~55 without it). So the body arrives at the
    transport's pace; memory per upload is three batches, whatever the tensor sizes.
    Chunks are used as received (``bytes``): no copies.
    """

    def consume(chunks: list[bytes]) -> tuple[list[Part], list[Part]]:
        for chunk in chunks:
            writer.write(chunk)
            decoder.feed(chunk)
        return decoder.digest_work(), inspection.digest_work()

    consuming: asyncio.Future[tuple[list[Part], list[Part]]] | None = None
    hashing: asyncio.Future[Any] | None = None

    async def handoff(batch: list[bytes] | None) -> None:
        """Pass the decoded batch's digest work on, then ``batch`` (None: none) to decode."""
        nonlocal consuming, hashing
        if consuming is not None:
            body_work, payload_work = await consuming
            if hashing is not None:
                await hashing  # digests in order
            hashing = asyncio.gather(
                asyncio.to_thread(decoder.digest, body_work),
                asyncio.to_thread(inspection.digest, payload_work),
            )
        consuming = (
            None if batch is None else asyncio.ensure_future(asyncio.to_thread(consume, batch))
        )

    received = 0
    batch: list[bytes] = []
    batched = 0
    try:
        async for chunk in stream:
            received += len(chunk)
            if received > limit:
                raise UploadTooLarge(f"the body is over this round's {limit}-byte limit")
            batch.append(chunk)
            batched += len(chunk)
            if batched >= FEED_BYTES:
                await handoff(batch)
                batch, batched = [], 0
        await handoff(batch or None)
        await handoff(None)
        if hashing is not None:
            await hashing
        decoder.finish()
    except NonFiniteWireError as err:
        raise NonFiniteUpload(f"rejected: {err}") from None
    except WireFormatError as err:
        raise MalformedUpload(f"not a valid contribution body: {err}") from None
    finally:  # the blob is aborted next: not while being written
        running = [f for f in (consuming, hashing) if f is not None and not f.done()]
        if running:
            await asyncio.wait(running)
        for f in running:
            if not f.cancelled():
                f.exception()  # retrieved: the error that stopped the loop is the answer
    if decoder.header is None:
        raise MalformedUpload("the body ended before its header")
