"""Receiving a contribution: stream to storage while validating, fsync, then one row.

Order of work, so that a bad upload costs little and leaves nothing behind:
1. cheap checks before reading the body: the protocol's ``admit_upload`` (run active,
   round open, lease held, or a retry), then the size;
2. the body streams into a temp blob and through a ``ContributionDecoder`` at the same time,
   whose sink, an ``UploadInspector``, checks and measures every tensor piece by piece
   (no tensor is ever held: memory is a few chunks per upload, not a tensor), on worker
   threads (``server.rounds.streaming``);
3. as soon as the header is in (before any tensor byte is looked at), it is checked
   against the URL and the round (``admit_claim``) and the run's model and codec;
4. the blob is committed (fsync + rename) and the row inserted in one short transaction
   that holds the run, the round and the round in progress ``FOR SHARE`` and asks
   ``admit_upload`` again, so a round cannot start closing, nor the run be paused,
   between the check and the insert; it holds the contributor ``FOR SHARE`` too, so a ban
   that lands while the body streams is either seen here (403 banned) or waits, and then
   excludes the row it finds.
Any failure aborts the temp blob; a 2xx means blob fsynced and row committed.

An upload whose round has closed (before it was sent, or while its body streamed) is
merged late into the open round when the rules say so (``diloco.protocol.late``): its
row keeps its own round and records the round it was merged into and its staleness.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.config import RunConfig
from diloco.outer.inspection import UploadInspector
from diloco.protocol.messages import Receipt
from diloco.protocol.reputation import CODE as QUARANTINED
from diloco.protocol.reputation import counted_weight
from diloco.protocol.rules import admit_claim, admit_payload, admit_upload, upload_weight
from diloco.protocol.state import LateGrant, Refusal, UploadClaim
from diloco.wire.contribution import (
    ContributionDecoder,
    ContributionHeader,
    ContributionMeta,
)
from diloco.wire.exchange import codec_for
from diloco.wire.header import dtype_name
from server.http.errors import (
    DuplicateContribution,
    LengthRequired,
    MalformedUpload,
    UploadTooLarge,
    WrongCodec,
    WrongTensors,
    refused,
)
from server.http.inputs import declared_length
from server.rounds import audit_draw as audits
from server.rounds import notify, sizing
from server.rounds import quarantine as quarantined
from server.rounds import service as rounds_service
from server.rounds.admission import (
    Accepted,
    admit_contributor,
    lock_rounds,
    replayed,
    retry_answer,
    upload_facts,
)
from server.rounds.models import Contribution
from server.rounds.streaming import stream_to_blob
from server.runs import coverage
from server.runs import service as runs_service
from server.settings import Settings
from server.storage import keys
from server.storage.base import BlobWriter, Storage

__all__ = ["Accepted", "check_model", "receive"]


def check_model(header: ContributionHeader, *, cfg: RunConfig) -> None:
    """The header's codec and tensors against the run's model and codec."""
    codec = codec_for(cfg.compression)
    if header.meta.codec != codec.describe():
        raise WrongCodec(f"codec {header.meta.codec} is not the run's {codec.describe()}")
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
    dtype = dtype_name(codec.data_dtype)
    if bad := [t.name for t in header.tensors if t.dtype != dtype]:
        raise WrongTensors(f"tensors {bad} are not {dtype}, as the run's codec requires")
    if header.meta.replay is None and cfg.audit.fraction > 0 and cfg.inner.overlap == 0:
        raise MalformedUpload(
            "the upload carries no replay record (header key 'replay'), which this run's "
            "audits need; upgrade the client (pip install -U diloco-hub)"
        )


def _claim(header: ContributionHeader) -> UploadClaim:
    meta = header.meta
    return UploadClaim(
        run_id=meta.run_id,
        round=meta.round,
        base_version=meta.base_version,
        tokens=meta.tokens,
        inner_steps=meta.inner_steps,
    )


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
    landing: Callable[[str], BlobWriter] | None = None,
) -> Accepted:
    """``landing(key)``: where the checked body goes, committed only when it all passed
    (default: ``storage.writer``; a direct upload's lands by a copy inside the store)."""
    # 1. cheap checks, in a short read-only transaction
    async with sessions() as session:
        run = await runs_service.get(session=session, run_id=run_id)
        cfg = rounds_service.run_config(run)
        facts, existing, _ = await upload_facts(
            session, run, index, contributor_id, max_staleness=cfg.rounds.max_staleness
        )
    verdict = admit_upload(facts)
    if isinstance(verdict, Refusal):
        raise refused(verdict)
    assert facts.round is not None  # admitted uploads name an existing round
    limit = rounds_service.max_upload_bytes(cfg, settings)
    _check_length(content_length, limit)

    # 2. stream into a temp blob, checking the header as soon as it is in, then every
    # tensor as it streams (finite; measured); the blob is not kept unless all pass
    key = keys.contribution(run_id, index, contributor_id)
    rnd = facts.round

    def check_header(header: ContributionHeader) -> None:
        if refusal := admit_claim(_claim(header), run_id=run_id, round=rnd):
            raise refused(refusal)
        check_model(header, cfg=cfg)

    # the run's codec: check_model refuses any other before a tensor byte is looked at
    codec = codec_for(cfg.compression).describe()
    inspection = UploadInspector(codec, digest_later=True)
    decoder = ContributionDecoder(
        max_bytes=limit, on_header=check_header, sink=inspection, digest_later=True
    )
    with (landing or storage.writer)(key) as writer:
        await stream_to_blob(stream, writer, decoder, inspection, limit=limit)
        sha = decoder.body_sha256
        assert sha is not None  # finish() returned: the trailer matched
        if existing is not None:  # a retry: identical is fine, anything else is a conflict
            answer = retry_answer(existing, sha)
            async with sessions() as session:  # its audit may still wait for the state
                audit = await audits.revealing(session, existing.id)
            return Accepted(False, answer.out.model_copy(update={"audit": audit}))
        committing = asyncio.ensure_future(asyncio.to_thread(writer.commit))  # fsync: off the loop
        try:
            await asyncio.shield(committing)
        except asyncio.CancelledError:  # neither half-done nor a blob without its row
            await asyncio.wait([committing])
            storage.delete(key)
            raise

    # 3. one transaction: the rules again, under the run's and the round's locks, then the row
    assert decoder.header is not None
    body = _Body(key, sha, writer.nbytes, decoder.header.meta, inspection)
    try:
        return await _record(sessions, storage, cfg, run_id, index, contributor_id, body)
    except BaseException:
        storage.delete(key)
        raise


def _check_length(content_length: str | None, limit: int) -> None:
    """The upload's Content-Length: present, a number, within ``limit``."""
    if content_length is None:
        raise LengthRequired("send the upload with a Content-Length header")
    if not (content_length.isascii() and content_length.isdigit()):  # "¹".isdigit() is True
        raise MalformedUpload(f"Content-Length {content_length!r} is not a number")
    declared_length(content_length, limit=limit, what="this round", too_large=UploadTooLarge)


@dataclass(frozen=True)
class _Body:
    """A checked upload body, landed in storage under ``key``."""

    key: str
    sha: str
    nbytes: int
    meta: ContributionMeta
    inspection: UploadInspector


async def _record(
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    cfg: RunConfig,
    run_id: str,
    index: int,
    contributor_id: str,
    body: _Body,
) -> Accepted:
    """The contribution's row, in one transaction that checks the rules again under the
    run's and the round's locks; a retry's answer when a concurrent upload of the same
    contributor got in first (this body's blob deleted)."""
    async with sessions() as session, session.begin():
        locked = await runs_service.get(session=session, run_id=run_id, lock="share")
        await lock_rounds(session, run_id, index)
        quarantine = await admit_contributor(session, contributor_id, run_id)
        earned = await quarantined.standing_of(session, contributor_id)
        facts, raced, lease_id = await upload_facts(
            session, locked, index, contributor_id, max_staleness=cfg.rounds.max_staleness
        )
        verdict = admit_upload(facts)
        if isinstance(verdict, Refusal):
            raise refused(verdict)
        if raced is not None:  # a concurrent upload of the same contributor won the race
            storage.delete(body.key)
            return retry_answer(raced, body.sha)
        assert lease_id is not None
        # late work (its round closed): merged into the open round, discounted
        late = verdict if isinstance(verdict, LateGrant) else None
        step, staleness = (index, 0) if late is None else (late.merged_into, late.staleness)
        leased = await sizing.leased_steps(session, lease_id, cfg)  # this lease's H
        weight = upload_weight(body.meta.tokens, cfg.lease_tokens_for(leased))
        row_id = f"con_{secrets.token_hex(8)}"
        inserted = await session.scalar(
            insert(Contribution)
            .values(
                id=row_id,
                run_id=run_id,
                round_index=index,
                merged_into_round=step,
                staleness=staleness,
                contributor_id=contributor_id,
                lease_id=lease_id,
                base_version=body.meta.base_version,
                tokens=body.meta.tokens,
                inner_steps=min(body.meta.inner_steps, leased),  # at most the lease's H
                loss=body.meta.loss,
                nbytes=body.nbytes,
                sha256=body.sha,
                blob_key=body.key,
                created_at=datetime.now(UTC),
                weight=weight,
                norm=body.inspection.norm,
                payload_sha256=body.inspection.payload_sha256,
                # a quarantined contributor's work is stored, never aggregated or credited
                excluded_code=None if quarantine is None else QUARANTINED,
                excluded_reason=quarantine,
                replay=None if body.meta.replay is None else asdict(body.meta.replay),
                standing=earned,
            )
            .on_conflict_do_nothing()
            .returning(Contribution.id)
        )
        if inserted is None:
            return await _not_inserted(session, storage, run_id, index, step, contributor_id, body)
        audit = await audits.draw(
            session, cfg, run_id=run_id, index=index, contribution_id=row_id,
            contributor_id=contributor_id, replay=body.meta.replay, standing=earned,
            now=datetime.now(UTC),
        )  # fmt: skip
        # what it trained on is covered (a dataset run's unit; nothing for a text run)
        await coverage.record(session, lease_id=lease_id, tokens=weight)
        await notify.rounds_changed(session, run_id)
    out = Receipt(
        contribution_id=row_id,
        round=index,
        sha256=body.sha,
        merged_into_round=step,
        staleness=staleness,
        weight=counted_weight(weight, staleness, earned),
        audit=audit,
    )
    return Accepted(True, out)


async def _not_inserted(
    session: AsyncSession,
    storage: Storage,
    run_id: str,
    index: int,
    step: int,
    contributor_id: str,
    body: _Body,
) -> Accepted:
    """The row was not inserted: another contributor's upload holds these tensors (a
    replay, refused), or the same contributor's concurrent upload got in first (its
    retry answer)."""
    replay = await replayed(
        session, run_id, index=index, step=step, contributor_id=contributor_id,
        inspection=body.inspection,
    )  # fmt: skip
    if (refusal := admit_payload(replay)) is not None:
        raise refused(refusal)
    raced = await session.scalar(
        select(Contribution).where(
            Contribution.run_id == run_id,
            Contribution.round_index == index,
            Contribution.contributor_id == contributor_id,
        )
    )
    if raced is None:
        raise DuplicateContribution("a concurrent upload conflicted; retry")
    storage.delete(body.key)
    return retry_answer(raced, body.sha)
