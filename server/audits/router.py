"""The routes of audits by replay (``server.audits.service``, docs/verification.md): the
audited volunteer reveals its starting state; verifiers (and the admin) read the ledger,
claim audits and decide them; the admin grants the verifier role."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from sqlalchemy import select

from diloco.protocol.audit import AuditStatus
from server.audits import ledger, service
from server.audits.schemas import (
    AuditList,
    AuditResult,
    AuditView,
    BlobRef,
    LedgerEntry,
    ReplayView,
    WaitingAudits,
)
from server.auth import ContributorAuth, VerifierAuth
from server.db import SessionDep
from server.http.errors import NotFound
from server.http.inputs import ContributorId, RoundIndex, RunId
from server.rounds.models import Audit, Contribution
from server.runs import service as runs_service
from server.storage.files import read_url, serve_blob

API = "/api/v1"
router = APIRouter(prefix=f"{API}/runs/{{run_id}}", tags=["audits"])

AuditId = Annotated[
    str,
    Path(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$", description="an audit id"),
]
ContributionId = Annotated[
    str,
    Path(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$", description="a contribution id"),
]


@router.put("/audits/{audit_id}/state", status_code=201)
async def reveal_state(
    run_id: RunId, audit_id: AuditId, request: Request, contributor: ContributorAuth
) -> AuditView:
    """The audited volunteer sends the AdamW state file its lease began from (its SHA-256
    is the upload's replay record's ``start``), as the upload's receipt asked."""
    return await service.reveal(
        request.app.state.sessions,
        request.app.state.storage,
        run_id=run_id,
        audit_id=audit_id,
        contributor_id=contributor.id,
        content_length=request.headers.get("content-length"),
        stream=request.stream(),
        now=datetime.now(UTC),
    )


@router.get("/audits")
async def audits(
    run_id: RunId,
    _: VerifierAuth,
    session: SessionDep,
    status: Annotated[AuditStatus | None, Query()] = None,
) -> AuditList:
    """The run's audits, oldest first (at most 1000), with ``status`` only those."""
    await runs_service.get(session=session, run_id=run_id)
    found = await service.listed(session, run_id, status, datetime.now(UTC))
    await session.commit()  # audits whose state never came are failed by now
    return AuditList(audits=found)


@router.get("/audits/mine")
async def my_audits(
    run_id: RunId, contributor: ContributorAuth, session: SessionDep
) -> WaitingAudits:
    """The caller's audits in this run that wait for its starting state: one drawn at an
    upload (its receipt named it) or one a close opened on the round's least aligned
    upload (``[audit] suspects``), which the volunteer learns of here after its next
    upload."""
    await runs_service.get(session=session, run_id=run_id)
    return await service.waiting(session, run_id, contributor.id)


@router.post("/audits/claim", responses={204: {"description": "no audit is pending"}})
async def claim(
    run_id: RunId, verifier: VerifierAuth, session: SessionDep, response: Response
) -> AuditView | None:
    """Hold the oldest pending audit for a while (``CLAIM_S``) and replay it."""
    await runs_service.get(session=session, run_id=run_id)
    claimed = await service.claim(session, run_id, verifier, datetime.now(UTC))
    await session.commit()
    if claimed is None:
        response.status_code = 204
    return claimed


@router.post("/audits/{audit_id}")
async def decide(
    run_id: RunId,
    audit_id: AuditId,
    body: AuditResult,
    request: Request,
    verifier: VerifierAuth,
    session: SessionDep,
) -> AuditView:
    """A verifier's finding on a pending audit; a failed one costs the contribution its
    credit (``replay``) and counts towards its contributor's quarantine; a passed one's
    revealed state is deleted (a failed one's is kept: the evidence)."""
    decided, released = await service.decide(
        session, run_id, audit_id, verifier, body, datetime.now(UTC)
    )
    await session.commit()
    if released is not None:  # a passed audit's state is not needed any more
        await asyncio.to_thread(request.app.state.storage.delete, released)
    return decided


@router.get("/audits/{audit_id}/state")
async def audit_state(
    run_id: RunId, audit_id: AuditId, request: Request, _: VerifierAuth, session: SessionDep
) -> Response:
    """The revealed state of an audit (safetensors)."""
    audit = await service.get(session, run_id, audit_id)
    if audit.state_key is None:
        raise NotFound(
            f"audit {audit_id} holds no revealed state (it began fresh, none came, or it "
            "passed and its state was deleted)"
        )
    return serve_blob(
        request,
        audit.state_key,
        etag=audit.id,
        media_type="application/octet-stream",
        headers={},
        kind="audit",
    )


@router.get("/contributions/{contribution_id}/blob")
async def contribution_blob(
    run_id: RunId,
    contribution_id: ContributionId,
    request: Request,
    _: VerifierAuth,
    session: SessionDep,
) -> Response:
    """An accepted contribution's body, as uploaded (while retention keeps it)."""
    row = await _contribution(session, run_id, contribution_id)
    return serve_blob(
        request,
        row.blob_key,
        etag=row.sha256,
        media_type="application/octet-stream",
        headers={},
        kind="contribution",
    )


async def _contribution(session: SessionDep, run_id: str, contribution_id: str) -> Contribution:
    row = await session.get(Contribution, contribution_id)
    if row is None or row.run_id != run_id:
        raise NotFound(f"run {run_id} has no contribution {contribution_id!r}")
    if row.blob_deleted_at is not None:
        raise NotFound(f"contribution {contribution_id}'s blob was deleted by retention")
    return row


@router.get("/rounds/{index}/ledger/{contributor_id}")
async def ledger_entry(
    run_id: RunId,
    index: RoundIndex,
    contributor_id: ContributorId,
    request: Request,
    _: VerifierAuth,
    session: SessionDep,
) -> LedgerEntry:
    """What re-running this contributor's lease of the round needs (``diloco verify``)."""
    await runs_service.get(session=session, run_id=run_id)
    row = await session.scalar(
        select(Contribution).where(
            Contribution.run_id == run_id,
            Contribution.round_index == index,
            Contribution.contributor_id == contributor_id,
        )
    )
    if row is None:
        raise NotFound(f"contributor {contributor_id!r} has no contribution in round {index}")
    settings, storage = request.app.state.settings, request.app.state.storage
    lease = await ledger.issued(
        pool=request.app.state.fast_pool,
        settings=settings,
        storage=storage,
        run_id=run_id,
        index=index,
        contributor_id=contributor_id,
        now=datetime.now(UTC),
    )
    assert lease is not None  # a contribution's lease stays with it
    audit = await session.scalar(select(Audit).where(Audit.contribution_id == row.id))
    base = f"{API}/runs/{run_id}"
    blob = None
    if row.blob_deleted_at is None:
        url = read_url(settings, storage, row.blob_key, f"{base}/contributions/{row.id}/blob")
        blob = BlobRef(url=url, sha256=row.sha256, nbytes=row.nbytes)
    state = None
    if audit is not None and audit.state_key is not None and row.replay is not None:
        url = read_url(settings, storage, audit.state_key, f"{base}/audits/{audit.id}/state")
        state = BlobRef(url=url, sha256=row.replay["start"], nbytes=audit.state_nbytes or 0)
    return LedgerEntry(
        contribution_id=row.id,
        round=index,
        contributor_id=contributor_id,
        inner_steps=row.inner_steps,
        lease=lease,
        replay=None if row.replay is None else ReplayView(**row.replay),
        contribution=blob,
        state=state,
        audit=None if audit is None else service.view(audit),
    )
