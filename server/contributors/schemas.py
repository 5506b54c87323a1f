from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from diloco.protocol.messages import Hardware

# no control characters, and something besides spaces
_Reason = r"^[^\x00-\x1f\x7f]*[^\x00-\x20\x7f][^\x00-\x1f\x7f]*$"


class ContributorCreate(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[\x21-\x7e][\x20-\x7e]*$")


class ContributorCreated(BaseModel):
    id: str
    name: str
    token: str  # shown once: only its hash is stored


class BanIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # told to the contributor on every refused request, and shown to admins
    reason: str = Field(min_length=1, max_length=500, pattern=_Reason)


class BanState(BaseModel):
    """A contributor's ban, as the admin's ban and unban answer it."""

    id: str
    name: str
    banned_at: datetime | None  # None: not banned
    ban_reason: str | None
    excluded: int  # contributions the ban excluded (this call's; 0 for an unban)
    leases_released: int  # live leases it released (this call's; 0 for an unban)


class QuarantineState(BaseModel):
    """A contributor's quarantine, as the admin's unquarantine answers it."""

    id: str
    name: str
    quarantined_at: datetime | None  # None: not quarantined
    quarantine_reason: str | None


class ProfileUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hardware: Hardware  # replaces what was stored


class Totals(BaseModel):
    accepted: int  # contributions stored (uploads accepted)
    aggregated: int  # of those, the ones that went into an outer step
    tokens: int  # tokens of the aggregated ones
    credit: float  # training FLOPs of the aggregated ones: tokens x 6 x n_params, confirmed
    # credited by a step but waiting for an audit of this contributor's work in the run
    # (diloco.protocol.audit.settle): not counted in `credit` until one passes
    pending_credit: float = 0.0


class RunTotals(BaseModel):
    run_id: str
    run_name: str
    accepted: int
    aggregated: int
    tokens: int
    credit: float  # confirmed
    pending_credit: float = 0.0  # waiting for an audit
    last_round: int  # the latest round this contributor contributed to


class RecentContribution(BaseModel):
    run_id: str
    round: int
    tokens: int
    loss: float
    created_at: datetime
    aggregated: bool
    credit: float  # what its step credited it (0 once forfeited)
    credit_status: str = "confirmed"  # confirmed, pending (an audit) or forfeited
    # why its round's close left it out (a failed check: `copy: a near-copy of …`), else null
    excluded: str | None = None


class Profile(BaseModel):
    id: str
    name: str
    created_at: datetime
    last_seen_at: datetime | None
    hardware: Hardware | None
    totals: Totals
    runs: list[RunTotals]  # by credit, highest first
    recent: list[RecentContribution]  # newest first
    # quarantined: its uploads are stored, never aggregated or credited (why, and since when)
    quarantined_at: datetime | None = None
    quarantine_reason: str | None = None
    # the share of its work's weight (and credit) its next upload counts for: a new account
    # little, one more share per verified contribution (diloco.protocol.reputation)
    standing: float = 1.0


class SortKey(StrEnum):
    CREDIT = "credit"
    TOKENS = "tokens"
    ACCEPTED = "accepted"
    AGGREGATED = "aggregated"
    LAST_SEEN = "last_seen"
    NAME = "name"
    CREATED = "created"


class Order(StrEnum):
    DESC = "desc"
    ASC = "asc"


class LeaderboardEntry(BaseModel):
    rank: int  # 1-based, counted across pages
    id: str
    name: str
    accepted: int
    aggregated: int
    tokens: int
    credit: float  # confirmed: what ranks
    pending_credit: float  # waiting for an audit of its work
    last_seen_at: datetime | None
    created_at: datetime
    device: str | None  # hardware.device, when reported


class Leaderboard(BaseModel):
    run_id: str | None  # None: every run
    sort: SortKey
    order: Order
    total: int  # contributors on the board, across pages
    contributors: list[LeaderboardEntry]
