"""The audits' API bodies (``server.audits.router``); docs/api.md describes each route."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco.config import NO_CONTROL_CHARS
from diloco.protocol.messages import Lease


class AuditView(BaseModel):
    id: str
    run_id: str
    round: int
    contribution_id: str
    contributor_id: str
    status: Literal["revealing", "pending", "passed", "failed"]
    reveal_by: datetime  # a state not revealed by then fails the audit
    claimed_by: str | None  # a verifier's id, or "admin"
    cosine: float | None
    rel_error: float | None
    norm_ratio: float | None
    detail: str | None  # why it passed or failed, in words
    created_at: datetime
    decided_at: datetime | None


class AuditList(BaseModel):
    audits: list[AuditView]


class WaitingAudit(BaseModel):
    """An audit of the caller's that waits for its starting state (``GET …/audits/mine``)."""

    id: str
    round: int
    contribution_id: str
    start: str  # the SHA-256 its upload committed to: the state file to send
    reveal_by: datetime


class WaitingAudits(BaseModel):
    audits: list[WaitingAudit]


class BlobRef(BaseModel):
    url: str  # this server's route, or a signed URL of the store
    sha256: str
    nbytes: int


class ReplayView(BaseModel):
    start: str  # the SHA-256 of the AdamW state file the lease began from, or "fresh"
    precision: str
    micro_batch: int


class LedgerEntry(BaseModel):
    """What re-running one contributor's lease of a round needs."""

    contribution_id: str
    round: int
    contributor_id: str
    inner_steps: int  # the steps the upload says it took (at most the lease's)
    lease: Lease  # as it was handed out: base, data, seed, H (download URLs fresh)
    replay: ReplayView | None  # None: not replayable (trained ahead, or an old client)
    contribution: BlobRef | None  # None: retention deleted the blob
    state: BlobRef | None  # the revealed starting state; None: fresh, or not revealed
    audit: AuditView | None


class AuditResult(BaseModel):
    """A verifier's finding: the replay's figures (the server decides pass or fail by
    ``diloco.protocol.audit.Verdict``), or a sentence saying why the volunteer's side
    cannot be replayed (its revealed state does not load, its upload does not decode)."""

    model_config = ConfigDict(extra="forbid")

    cosine: float | None = Field(None, ge=-1.0, le=1.0, allow_inf_nan=False)
    rel_error: float | None = Field(None, ge=0.0, le=1e12, allow_inf_nan=False)
    norm_ratio: float | None = Field(None, ge=0.0, le=1e12, allow_inf_nan=False)
    failure: str | None = Field(None, min_length=1, max_length=1000, pattern=NO_CONTROL_CHARS)

    @model_validator(mode="after")
    def _one_kind(self) -> AuditResult:
        figures = (self.cosine, self.rel_error, self.norm_ratio)
        if self.failure is None and None in figures:
            raise ValueError("send cosine, rel_error and norm_ratio, or a failure sentence")
        if self.failure is not None and any(f is not None for f in figures):
            raise ValueError("send either the figures or a failure sentence, not both")
        return self
