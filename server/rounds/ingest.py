"""Receiving a contribution: stream to storage while validating, fsync, then one row.

Order of work, so that a bad upload costs little and leaves nothing behind:
1. cheap checks before reading the body: size, round open, lease held;
2. the body streams into a temp blob and through a ``ContributionDecoder`` at the same time
   (decoded tensors are dropped at once: memory is one tensor, not the model);
3. after the checksum, the header is checked against the URL and the round;
4. the blob is committed (fsync + rename) and the row inserted in one transaction that
   holds the round ``FOR SHARE``, so a round cannot close between the check and the insert.
Any failure aborts the temp blob; a 2xx means blob fsynced and row committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.codec import make_codec
from diloco.config import RunConfig
from diloco.wire import (
    ContributionDecoder,
    ContributionHeader,
    NonFiniteWireError,
    WireFormatError,
)
from server.errors import (
    BaseVersionMismatch,
    DuplicateContribution,
    HeaderMismatch,
    LengthRequired,
    MalformedUpload,
    NoLease,
    NonFiniteUpload,
    RoundClosed,
    UploadTooLarge,
    WrongCodec,
    WrongTensors,
)
from server.rounds import service as rounds_service
from server.rounds.models import Contribution, Lease, Round
from server.rounds.policy import RoundState
from server.rounds.schemas import ContributionOut
from server.runs import service as runs_service
from server.settings import Settings
from server.storage import BlobWriter, Storage

FEED_BYTES = 1 << 20  # decode in pieces of about this size, off the event loop


@dataclass(frozen=True)
class Accepted:
    created: bool  # False: an identical retry of an accepted upload
    out: ContributionOut


def check_header(header: ContributionHeader, *, cfg: RunConfig, run_id: str, rnd: Round) -> None:
    """The header against the URL, the round and the run's model and codec."""
    meta = header.meta
    if meta.run_id != run_id or meta.round != rnd.index:
        raise HeaderMismatch(
            f"the body is for run {meta.run_id!r} round {meta.round}, "
            f"but was sent to run {run_id!r} round {rnd.index}"
        )
    if meta.base_version != rnd.base_version:
        raise BaseVersionMismatch(
            f"the contribution was trained from version {meta.base_version}, round {rnd.index} "
            f"trains from version {rnd.base_version}: download it and train again",
            expected=rnd.base_version,
        )
    codec = make_codec(cfg.compression.kind, cfg.compression.block_size)
    if meta.codec != codec.describe():
        raise WrongCodec(f"codec {meta.codec} is not the run's {codec.describe()}")
    expected = rounds_service.model_shapes(cfg)
    got = {t.name: t.shape for t in header.tensors}
    if got != expected:
        missing = sorted(expected.keys() - got.keys())
        extra = sorted(got.keys() - expected.keys())
        wrong = sorted(n for n in expected.keys() & got.keys() if expected[n] != got[n])
        raise WrongTensors(
            f"tensors differ from the run's model: missing {missing}, unknown {extra}, "
            f"wrong shape {[f'{n} {got[n]} != {expected[n]}' for n in wrong]}"
        )
    dtype = "int8" if cfg.compression.kind == "int8" else "float32"
    if bad := [t.name for t in header.tensors if t.dtype != dtype]:
        raise WrongTensors(f"tensors {bad} are not {dtype}, as the run's codec requires")
    if meta.tokens < 1 or meta.inner_steps < 1:
        raise MalformedUpload("tokens and inner_steps must be at least 1")


async def _stream_to_blob(
    stream: AsyncIterator[bytes],
    writer: BlobWriter,
    decoder: ContributionDecoder,
    *,
    limit: int,
) -> str:
    """Write and decode the body; return the sha256 of all its bytes."""
    digest = hashlib.sha256()
    pending = bytearray()

    def consume(piece: bytes) -> None:
        writer.write(piece)
        digest.update(piece)
        decoder.feed(piece)  # completed tensors are validated and dropped

    try:
        async for chunk in stream:
            if writer.nbytes + len(pending) + len(chunk) > limit:
                raise UploadTooLarge(f"the body is over this round's {limit}-byte limit")
            pending += chunk
            if len(pending) >= FEED_BYTES:
                await asyncio.to_thread(consume, bytes(pending))
                pending.clear()
        if pending:
            await asyncio.to_thread(consume, bytes(pending))
        decoder.finish()
    except NonFiniteWireError as err:
        raise NonFiniteUpload(f"rejected: {err}") from None
    except WireFormatError as err:
        raise MalformedUpload(f"not a valid contribution body: {err}") from None
    return digest.hexdigest()


async def receive(
    *,
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    settings: Settings,
    run_id: str,
    index: int,
    contributor_id: str,
    content_length: str | None,
    stream: AsyncIterator[bytes],
) -> Accepted:
    # 1. cheap checks, in a short read-only transaction
    async with sessions() as session:
        run = await runs_service.get(session=session, run_id=run_id)
        cfg = rounds_service.run_config(run)
        rnd_or_none = await session.get(Round, (run_id, index))
        if rnd_or_none is None:
            current = await rounds_service.current_index(session=session, run_id=run_id)
            raise RoundClosed(
                f"run {run_id} has no round {index}; the current round is {current}",
                current_round=current,
            )
        rnd = rnd_or_none
        existing = await _existing(session, run_id, index, contributor_id)
        if existing is None:
            if rnd.state != RoundState.OPEN:
                current = await rounds_service.current_index(session=session, run_id=run_id)
                raise rounds_service.round_closed(rnd, current)
            lease_id = await _lease_id(session, run_id, index, contributor_id)
    limit = rounds_service.max_upload_bytes(cfg, settings)
    if content_length is None:
        raise LengthRequired("send the upload with a Content-Length header")
    if not content_length.isdigit():
        raise MalformedUpload(f"Content-Length {content_length!r} is not a number")
    if int(content_length) > limit:
        raise UploadTooLarge(f"{content_length} bytes is over this round's {limit}-byte limit")

    # 2. stream into a temp blob, validating as it goes; 3. check the header
    decoder = ContributionDecoder(max_bytes=limit)
    key = f"runs/{run_id}/rounds/{index}/{contributor_id}-{secrets.token_hex(4)}.bin"
    with storage.writer(key) as writer:
        sha = await _stream_to_blob(stream, writer, decoder, limit=limit)
        if decoder.header is None:
            raise MalformedUpload("the body ended before its header")
        check_header(decoder.header, cfg=cfg, run_id=run_id, rnd=rnd)
        if existing is not None:  # a retry: identical is fine, anything else is a conflict
            return _retry_answer(existing, sha)
        writer.commit()

    # 4. one transaction: the round must still be open, then the row
    meta = decoder.header.meta
    try:
        async with sessions() as session, session.begin():
            locked = await session.scalar(
                select(Round)
                .where(Round.run_id == run_id, Round.index == index)
                .with_for_update(read=True)
            )
            if locked is None or locked.state != RoundState.OPEN:
                current = await rounds_service.current_index(session=session, run_id=run_id)
                raise rounds_service.round_closed(rnd, current)
            row_id = f"con_{secrets.token_hex(8)}"
            inserted = await session.scalar(
                insert(Contribution)
                .values(
                    id=row_id,
                    run_id=run_id,
                    round_index=index,
                    contributor_id=contributor_id,
                    lease_id=lease_id,
                    base_version=meta.base_version,
                    tokens=meta.tokens,
                    inner_steps=meta.inner_steps,
                    loss=meta.loss,
                    nbytes=writer.nbytes,
                    sha256=sha,
                    blob_key=key,
                    created_at=datetime.now(UTC),
                )
                .on_conflict_do_nothing()
                .returning(Contribution.id)
            )
            if inserted is None:  # a concurrent upload of the same contributor won the race
                raced = await _existing(session, run_id, index, contributor_id)
                if raced is None:
                    raise DuplicateContribution("a concurrent upload conflicted; retry")
                storage.delete(key)
                return _retry_answer(raced, sha)
    except BaseException:
        storage.delete(key)
        raise
    return Accepted(True, ContributionOut(contribution_id=row_id, round=index, sha256=sha))


def _retry_answer(existing: Contribution, sha: str) -> Accepted:
    if existing.sha256 != sha:
        raise DuplicateContribution(
            f"you already contributed {existing.id} to round {existing.round_index} "
            "with a different body; one contribution per round"
        )
    return Accepted(
        False,
        ContributionOut(contribution_id=existing.id, round=existing.round_index, sha256=sha),
    )


async def _existing(
    session: AsyncSession, run_id: str, index: int, contributor_id: str
) -> Contribution | None:
    return await session.scalar(
        select(Contribution).where(
            Contribution.run_id == run_id,
            Contribution.round_index == index,
            Contribution.contributor_id == contributor_id,
        )
    )


async def _lease_id(session: AsyncSession, run_id: str, index: int, contributor_id: str) -> str:
    lease_id = await session.scalar(
        select(Lease.id).where(
            Lease.run_id == run_id,
            Lease.round_index == index,
            Lease.contributor_id == contributor_id,
        )
    )
    if lease_id is None:
        raise NoLease(f"you hold no lease on round {index}: POST /api/v1/runs/{run_id}/join first")
    return lease_id
