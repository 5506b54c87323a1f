from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from server.contributors.schemas import BanIn


class CloseError(BaseModel):
    """The latest failed attempt to close a round; kept after a later attempt succeeds."""

    # close_failed | injected_fault | step_rejected | contributor_banned | claim_expired
    code: str
    detail: str  # what went wrong, as a sentence
    at: datetime
    attempts: int  # close attempts (claims) so far
    retry_at: datetime | None  # when it is tried again; None once the round is closed


class LeaseState(BaseModel):
    """A contributor's lease on the current round, as the dashboard shows it."""

    contributor_id: str
    contributor_name: str
    shard: int
    issued_at: datetime
    last_heartbeat: datetime
    heartbeat_age_s: float  # seconds since the last join or heartbeat, as of this request
    expires_at: datetime
    live: bool  # not expired: the round counts it as outstanding until it contributes
    contributed: bool  # its upload for this round was accepted
    last_step: int | None  # as its last heartbeat reported
    last_loss: float | None
    inner_steps: int | None = None  # its H, sized to the volunteer (None: the run's steps)


class CurrentRound(BaseModel):
    index: int
    state: str
    opened_at: datetime
    deadline: datetime
    # the contributions taking part in its step so far (accepted, not left out), late work
    # merged into it included, as GET /runs/{id}/rounds counts them
    accepted: int
    late: int = 0  # of those, late work: it never counts towards quorum or target
    quorum: int
    target: int | None
    reason: str | None  # decide_close's sentence, as of this request
    error: CloseError | None  # the latest failed attempt to close it, while closing
    leases: list[LeaseState]  # every lease on this round, oldest first


class LatestMetrics(BaseModel):
    round: int
    eval_loss: float | None
    train_loss: float | None


class DataInfo(BaseModel):
    train_tokens: int
    val_tokens: int
    n_shards: int
    chunk_len: int
    dataset_id: str | None = None  # a run on a prepared dataset (None: a text file)
    token_dtype: str = "uint8"
    tokens_trained: int = 0  # the accepted contributions' weights, in tokens
    epochs: float = 0.0  # tokens_trained / train_tokens


class ShardCoverage(BaseModel):
    index: int
    units: int
    units_trained: int  # covered by at least one accepted contribution
    tokens_trained: int


class Coverage(BaseModel):
    """``GET /runs/{id}/coverage``: what the run has trained on. Units (a lease's tokens of
    one shard) exist for dataset runs only; a text-file run has the totals alone."""

    run_id: str
    train_tokens: int
    tokens_trained: int
    epochs: float
    units: int = 0
    units_issued: int = 0  # handed out at least once
    units_trained: int = 0  # covered at least once
    min_passes: int = 0  # the fewest times any unit was trained on
    max_passes: int = 0
    unit_tokens: int = 0  # training tokens inside units (a shard's tail shorter is not)
    shards: list[ShardCoverage] = Field(default_factory=list)


class RunOwner(BaseModel):
    id: str
    name: str


class RunOut(BaseModel):
    id: str
    name: str
    status: str
    # the run owner who created it; None: the hub's admin did (or the account is gone)
    owner: RunOwner | None = None
    created_at: datetime
    config: dict[str, Any]
    n_params: int
    checkpoint_version: int
    private: bool  # joining needs the run's invite code (POST /runs/{id}/members)
    data: DataInfo
    current_round: CurrentRound | None
    latest: LatestMetrics | None


class Invite(BaseModel):
    run_id: str
    invite: str  # shown once: only its hash is stored; hand it to whom may join


class MemberIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    invite: str = Field(min_length=1, max_length=64, pattern=r"^[\x21-\x7e]+$")


class Member(BaseModel):
    run_id: str
    contributor_id: str
    joined_at: datetime | None  # None: the run is public, nothing to join


class RunList(BaseModel):
    runs: list[RunOut]


class KindUsage(BaseModel):
    objects: int
    bytes: int


class StorageUsage(BaseModel):
    """What a run holds in the store now, as a listing of its prefix finds it."""

    run_id: str
    listed_at: datetime  # when the store was listed (a listing serves for a while)
    # data, checkpoints, states, deltas, contributions, incoming, unfinished, other
    kinds: dict[str, KindUsage]
    total: KindUsage
    retention: dict[str, Any]  # the run's [retention] policy (server.upkeep.retention)
    versions_kept: int  # checkpoint versions whose files are kept
    versions_retired: int  # versions whose files retention deleted (their rows stay)
    contributions_kept: int  # contributions whose blob is kept
    contributions_retired: int  # contributions whose blob retention deleted


class RunBanIn(BanIn):
    """A ban from one run: whom, and the reason told to it on every refused request there
    (and shown to the run's owner)."""

    contributor_id: str = Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$")


class RunBanOut(BaseModel):
    run_id: str
    contributor_id: str
    contributor_name: str
    reason: str
    banned_by: str  # "admin" or the owner's contributor id
    banned_at: datetime
    excluded: int | None = None  # a new ban: its work in unfinished rounds now left out
    released: int | None = None  # a new ban: its live leases on the run released


class RunBanList(BaseModel):
    run_id: str
    bans: list[RunBanOut]
