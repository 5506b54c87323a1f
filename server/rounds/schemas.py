from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from diloco.config import INT32_MAX, NO_CONTROL_CHARS


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


class RoundList(BaseModel):
    rounds: list[RoundOut]


class FileRef(BaseModel):
    url: str
    sha256: str
    nbytes: int


class CheckpointRef(FileRef):
    version: int


class ShardRef(FileRef):
    index: int
    chunk_len: int


class LeaseOut(BaseModel):
    lease_id: str
    run_id: str
    round: int
    base_version: int
    checkpoint: CheckpointRef
    shard: ShardRef
    config: dict[str, Any]
    inner_steps: int
    start_step: int  # base_version * inner_steps: the global step for the lr schedule
    seed: int
    deadline: datetime
    lease_expires_at: datetime
    heartbeat_interval_s: float
    max_upload_bytes: int


class HeartbeatIn(BaseModel):
    lease_id: str = Field(min_length=1, max_length=32, pattern=NO_CONTROL_CHARS)  # leases.id
    step: int | None = Field(None, ge=0, le=INT32_MAX)  # leases.last_step is an integer
    loss: float | None = Field(None, allow_inf_nan=False)


class HeartbeatOut(BaseModel):
    lease_expires_at: datetime
    round_state: str
    deadline: datetime


class ContributionOut(BaseModel):
    contribution_id: str
    round: int
    sha256: str
    accepted: bool = True


class RoundContribution(BaseModel):
    id: str
    contributor_id: str
    contributor_name: str
    tokens: int
    inner_steps: int
    loss: float  # the contributor's mean inner training loss
    created_at: datetime  # when the upload was accepted
    aggregated: bool  # went into the round's outer step
    credit: float  # FLOPs; 0 until aggregated


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
