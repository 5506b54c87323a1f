from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Role(StrEnum):
    """What the admin may grant an account (``POST /contributors/{id}/roles``)."""

    VERIFIER = "verifier"  # claims and decides audits by replay (server.audits)
    OWNER = "owner"  # creates runs and manages its own (server.auth.Manager)


class RoleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role


class Roles(BaseModel):
    id: str
    roles: list[str]


_Quota = int | None


class QuotaIn(BaseModel):
    """A run owner's quota (admin token). A field left out or null takes the hub's default;
    0 allows none."""

    model_config = ConfigDict(extra="forbid", strict=True)

    runs: _Quota = Field(None, ge=0, le=10_000)  # runs not ended (active or paused) at once
    params: _Quota = Field(None, ge=0, le=1 << 50)  # a run's model parameters
    data_bytes: _Quota = Field(None, ge=0, le=1 << 50)  # a run's training data, in bytes


class QuotaFigures(BaseModel):
    runs: int
    params: int
    data_bytes: int


class Quota(BaseModel):
    """A run owner's quota: what the admin set (null: the hub's default), what applies, and
    how many runs it has not ended."""

    id: str
    set: QuotaIn
    effective: QuotaFigures
    runs_not_ended: int


class Account(BaseModel):
    """An account as the admin's page lists it."""

    id: str
    name: str
    created_at: datetime
    last_seen_at: datetime | None
    roles: list[str]
    runs_owned: int  # runs it created as an owner (any status)
    banned_at: datetime | None
    ban_reason: str | None
    quarantined_at: datetime | None
    quarantine_reason: str | None


class AccountList(BaseModel):
    total: int
    accounts: list[Account]


class WhoAmI(BaseModel):
    """What the token sent may do (``GET /api/v1/whoami``)."""

    kind: str  # admin | contributor
    id: str | None  # the contributor's id (None: the admin)
    name: str
    roles: list[str]  # the admin: ["admin"]
    can_create_runs: bool  # the admin and run owners
    quota: Quota | None  # a run owner's (None: the admin, or not an owner)
