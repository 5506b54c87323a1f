from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel


class CurrentRound(BaseModel):
    index: int
    state: str
    opened_at: datetime
    deadline: datetime
    accepted: int
    quorum: int
    target: int | None
    reason: str | None  # decide_close's sentence, as of this request


class LatestMetrics(BaseModel):
    round: int
    eval_loss: float | None
    train_loss: float | None


class DataInfo(BaseModel):
    train_tokens: int
    val_tokens: int
    n_shards: int
    chunk_len: int


class RunOut(BaseModel):
    id: str
    name: str
    status: str
    created_at: datetime
    config: dict[str, Any]
    n_params: int
    checkpoint_version: int
    data: DataInfo
    current_round: CurrentRound | None
    latest: LatestMetrics | None


class RunList(BaseModel):
    runs: list[RunOut]
