from __future__ import annotations

from datetime import datetime
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.webhooks.events import EventName


class WebhookIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=2048)
    format: Literal["json", "slack", "discord"] = "json"
    events: list[EventName] = Field(default_factory=lambda: list(get_args(EventName)), min_length=1)
    # eval.rising: a version's eval loss past this many times the best so far
    eval_rise: float = Field(1.5, gt=1.0, le=100.0)

    @field_validator("events")
    @classmethod
    def _distinct(cls, events: list[str]) -> list[str]:
        return sorted(set(events))


class LastDelivery(BaseModel):
    id: str
    event: str
    attempts: int
    status: int | None
    delivered_at: datetime | None
    next_at: datetime | None  # None: done (delivered, or given up)
    last_error: str | None


class WebhookOut(BaseModel):
    id: str
    run_id: str | None  # None: every run's (the hub's admin set it)
    url: str
    format: str
    events: list[str]
    eval_rise: float
    created_by: str
    created_at: datetime
    secret: str | None = None  # the signing key: only in the answer that created it
    last: LastDelivery | None = None


class WebhookList(BaseModel):
    webhooks: list[WebhookOut]
