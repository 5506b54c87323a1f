from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

# what volunteers and the server exchange: one definition, in the package both import
from diloco.protocol.messages import (
    CheckpointRef,
    HeartbeatIn,
    HeartbeatOut,
    JoinIn,
    Lease,
    Receipt,
    ShardRef,
)
from server.runs.schemas import CloseError

__all__ = [
    "CheckpointRef",
    "CloseError",
    "HeartbeatIn",
    "HeartbeatOut",
    "JoinIn",
    "Lease",
    "Receipt",
    "RoundContribution",
    "RoundContributions",
    "RoundList",
    "RoundOut",
    "RoundRejection",
    "ShardRef",
]


class RoundOut(BaseModel):
    index: int
    state: str
    base_version: int
    opened_at: datetime
    deadline: datetime
    closed_at: datetime | None
    close_reason: str | None
    close_code: str | None
    extensions: int
    accepted: int
    tokens: int
    train_loss: float | None
    eval_loss: float | None
    update_norm: float | None
    close_attempts: int  # claims taken to close it (1 when the first attempt succeeded)
    error: CloseError | None
    # late contributions (trained for an earlier round) in its step, counted in `accepted`
    late: int = 0


class RoundList(BaseModel):
    rounds: list[RoundOut]


class UploadChecks(BaseModel):
    """What the close's checks measured of a contribution (``diloco.outer.checks``)."""

    # the check it failed (zero_update, copy, opposed, unaligned, no_gain); None: passed
    code: str | None
    loo_cosine: float | None  # cosine to the aggregate of the round's other uploads
    # on the sampled coordinates, to the coordinate-wise median of the others' (what the
    # direction checks judge)
    median_cosine: float | None = None
    copy_cosine: float | None  # the largest |cosine| to an earlier upload or a recent change
    copy_of: str | None  # which one
    norm_ratio: float | None  # ‖Δ‖ over the round's reference norm
    # scoring by the loss, applied alone to the base: the loss it takes off windows of its
    # lease's data and off the judging sample, in nats (None: not scored)
    own_gain: float | None = None
    other_gain: float | None = None
    # cos(Δ, its lease windows' gradient at the base) − cos(Δ, the judging windows'): work
    # trained on other data than the lease's points along its own windows' no more
    own_alignment: float | None = None


class ArrivalScore(BaseModel):
    """Its score by the loss, taken as it arrived (``server.rounds.arrival_scores``)."""

    own_gain: float  # the loss it takes off its lease's scored windows, applied alone, nats
    other_gain: float  # ... off the validation sample
    own_base: float  # the base version's loss on those windows
    other_base: float
    own_alignment: float | None = None  # as in UploadChecks (None: stored before it was)


class RoundContribution(BaseModel):
    id: str
    contributor_id: str
    contributor_name: str
    tokens: int
    inner_steps: int
    loss: float  # the contributor's mean inner training loss
    created_at: datetime  # when the upload was accepted
    aggregated: bool  # went into the round's outer step
    credit: float  # FLOPs; 0 until aggregated, and once forfeited
    # confirmed, or pending until an audit of its contributor's work in the run at or after
    # its round decides (diloco.protocol.audit.settle), or forfeited (one failed first)
    credit_status: str
    excluded: str | None  # why it was left out of the step (e.g. blob_unreadable: ...)
    # the tokens it counts for in its step and credit: its claim, at most what a lease
    # allows, divided by 1 + staleness (rounded up) for late work (diloco.protocol.late),
    # times its contributor's standing (diloco.protocol.reputation)
    weight: int
    standing: float  # the share of its weight its contributor had earned when it was accepted
    round: int  # the round it was trained for (its lease's)
    merged_into_round: int  # the round whose step takes it: `round` unless late
    staleness: int  # versions published since its base: 0 unless late
    norm: float | None  # ‖Δ‖ of its decoded tensors
    cosine: float | None  # to the round's aggregate, once the step is published
    clip: float | None  # the factor the robust aggregate scaled it by (1: untouched)
    checks: UploadChecks | None  # measured at the close (None: not closed yet)
    # taken as it arrived, off the close's critical path; the close uses it (None: not yet,
    # or not scored on arrival: late work, scoring off, or it arrived as the round closed)
    score: ArrivalScore | None = None
    sha256: str  # of the accepted body: the ledger's record, kept when the blob is not
    nbytes: int
    blob_retained: bool  # False: retention deleted the blob (server.upkeep.retention); row kept


class RoundRejection(BaseModel):
    contributor_id: str
    contributor_name: str
    error: str  # the error code the upload was answered with
    detail: str
    created_at: datetime


class RoundContributions(BaseModel):
    run_id: str
    round: int
    state: str
    contributions: list[RoundContribution]  # oldest first
    rejections: list[RoundRejection]  # newest first, at most rejections.LIST per round
