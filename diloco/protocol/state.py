"""What the round protocol's rules look at and what they decide: states, views, decisions.

Views are plain frozen dataclasses that a service fills from the database (or the simulator
from its own bookkeeping); rules in ``diloco.protocol.rules`` take them and return one of
the decision types below. Times are timezone-aware datetimes; a naive one is refused at
the boundary with the field's name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Literal

from diloco.config import RoundsSection
from diloco.protocol.messages import ErrorCode


class RunStatus(StrEnum):
    ACTIVE = "active"  # rounds open, leases are handed out
    PAUSED = "paused"  # no leases, heartbeats or uploads; the open round waits for resume
    COMPLETED = "completed"  # its last round closed; the final checkpoint is the trained model
    CANCELLED = "cancelled"  # stopped by its owner; final, never overwritten


class RoundState(StrEnum):
    OPEN = "open"  # accepting contributions; the sweeper asks decide_close about it
    CLOSING = "closing"  # decided to close: a worker claims it, steps, then publishes
    CLOSED = "closed"  # outer step applied and its checkpoint published; next round is open


class Action(StrEnum):
    KEEP_OPEN = "keep_open"  # nothing to do yet
    CLOSE = "close"  # aggregate the counted contributions and apply the outer step
    EXTEND = "extend"  # deadline passed below quorum: stay open with `new_deadline`


# Stable, machine-readable reason codes of a round's decision (metrics labels, API);
# the `reason` sentence is for people.
ReasonCode = Literal[
    "target", "quorum_no_live_leases", "deadline_quorum", "deadline_below_quorum", "waiting",
    "not_open", "excluded_quorum", "excluded_below_quorum", "guard_below_quorum",
]  # fmt: skip

# Why a close attempt failed (stored on the round, retried with backoff), and why a
# contribution was left out of its round's step (stored on the contribution; it earns 0).
# step_rejected: recorded by servers from before issue 26, whose close retried a step the
# guard discarded; now such a round reopens (guard_below_quorum)
CloseFailure = Literal["close_failed", "injected_fault", "claim_expired", "step_rejected"]
Exclusion = Literal["blob_unreadable", "banned", "guard"]


def require_aware(name: str, value: datetime) -> None:
    # Naive datetimes compare wrongly against aware ones (or raise deep in a comparison);
    # reject them at the boundary with the field's name instead.
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name}: must be timezone-aware, got naive {value.isoformat()}")


# ---------------------------------------------------------------- views


@dataclass(frozen=True)
class RoundView:
    index: int
    opened_at: datetime
    deadline: datetime  # opened_at + timeout_s, moved later by each extension
    state: RoundState
    extensions: int = 0  # how many times the deadline has been extended so far

    def __post_init__(self) -> None:
        require_aware("opened_at", self.opened_at)
        require_aware("deadline", self.deadline)

    @property
    def base_version(self) -> int:
        """Round i trains from checkpoint version i − 1 and publishes version i."""
        return self.index - 1


@dataclass(frozen=True)
class ContributionView:
    contributor_id: str
    accepted: bool  # passed validation (shapes, finite values, base version)
    tokens: int
    base_version: int
    excluded: bool = False  # left out of the step (its stored blob was unreadable, ...)


@dataclass(frozen=True)
class LeaseView:
    """A contributor's claim to be working on the round; live while `now < expires_at`."""

    contributor_id: str
    last_heartbeat: datetime
    expires_at: datetime  # pushed forward by each heartbeat; when heartbeats stop, it lapses
    shard: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        require_aware("last_heartbeat", self.last_heartbeat)
        require_aware("expires_at", self.expires_at)

    def is_live(self, now: datetime) -> bool:
        return now < self.expires_at


# ---------------------------------------------------------------- policies


def _positive_seconds(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be a positive number of seconds, got {value}")


@dataclass(frozen=True)
class ClosePolicy:
    quorum: int  # fewest accepted contributions that may close a round
    target: int | None  # close at once at this many accepted (None: no target)
    timeout_s: float  # round deadline, from its opening
    extension_s: float | None = None  # deadline extension below quorum (None: timeout_s)
    max_extensions: int | None = None  # None: extend for ever; a limit: then wait, unextended

    def __post_init__(self) -> None:
        if self.quorum < 1:
            raise ValueError(f"quorum: must be at least 1, got {self.quorum}")
        if self.target is not None and self.target < self.quorum:
            raise ValueError(f"target: must be at least quorum ({self.quorum}), got {self.target}")
        _positive_seconds("timeout_s", self.timeout_s)
        _positive_seconds("extension_s", self.extension_s)
        if self.max_extensions is not None and self.max_extensions < 0:
            raise ValueError(f"max_extensions: must be at least 0, got {self.max_extensions}")

    @property
    def extension(self) -> timedelta:
        return timedelta(seconds=self.timeout_s if self.extension_s is None else self.extension_s)

    @classmethod
    def of(cls, rounds: RoundsSection) -> ClosePolicy:
        """The policy of a run's ``[rounds]`` config."""
        return cls(
            quorum=rounds.quorum,
            target=rounds.target,
            timeout_s=rounds.timeout_s,
            max_extensions=rounds.max_extensions,
        )


@dataclass(frozen=True)
class LeasePolicy:
    ttl_s: float  # a lease lapses this long after its last join or heartbeat
    n_shards: int  # the run's training shards, handed out round-robin
    retry_after_s: float  # what a refused joiner is told to wait before joining again

    def __post_init__(self) -> None:
        _positive_seconds("ttl_s", self.ttl_s)
        _positive_seconds("retry_after_s", self.retry_after_s)
        if self.n_shards < 1:
            raise ValueError(f"n_shards: must be at least 1, got {self.n_shards}")

    @classmethod
    def of(cls, *, ttl_s: float, n_shards: int, sweep_interval_s: float) -> LeasePolicy:
        """A refused joiner comes back after two sweeps (the round may have closed by
        then), at most 5 s."""
        return cls(ttl_s=ttl_s, n_shards=n_shards, retry_after_s=min(5.0, sweep_interval_s * 2))


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff for a round whose close failed: base · 2^(attempt − 1), at most max_s."""

    base_s: float = 2.0
    max_s: float = 300.0

    def __post_init__(self) -> None:
        _positive_seconds("base_s", self.base_s)
        _positive_seconds("max_s", self.max_s)


# ---------------------------------------------------------------- what the rules look at


@dataclass(frozen=True)
class JoinFacts:
    run_status: RunStatus
    round: RoundView | None  # the round in progress (open or closing); None: none left
    contributed: bool  # this contributor already has a contribution in that round
    lease: LeaseView | None  # its lease on that round, if it ever had one


@dataclass(frozen=True)
class HeartbeatFacts:
    run_status: RunStatus
    round: RoundView | None  # the round the URL names; None: the run has no such round
    current_round: int | None  # the round in progress, for the 409's body
    lease_held: bool  # the named lease is this contributor's, on this round


@dataclass(frozen=True)
class UploadFacts:
    run_status: RunStatus
    round: RoundView | None  # the round the URL names; None: the run has no such round
    current_round: int | None  # the round in progress, for the 409's body
    existing_sha256: str | None  # this contributor's stored contribution to it, if any
    lease_held: bool  # this contributor holds a lease on it
    current_open: bool = False  # the round in progress is open (late work may join it)
    max_staleness: int = 0  # the run's [rounds] max_staleness (0: no late work)


@dataclass(frozen=True)
class UploadClaim:
    """What an upload's header says about itself (the wire header's metadata)."""

    run_id: str
    round: int
    base_version: int
    tokens: int
    inner_steps: int


@dataclass(frozen=True)
class Aggregated:
    """A contribution that went into a round's outer step."""

    contribution_id: str
    contributor_id: str
    tokens: int  # its weight, discounted by its staleness: what the round's tokens count
    loss: float  # the contributor's mean inner training loss
    standing: float = 1.0  # its contributor's, when accepted: the share its credit counts


# ---------------------------------------------------------------- what the rules decide


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do with an open round, and the sentence why (stored on the round)."""

    action: Action
    reason: str  # a sentence for the dashboard, with the numbers in it
    new_deadline: datetime | None = None  # set only for Action.EXTEND
    code: ReasonCode

    def __post_init__(self) -> None:
        if (self.new_deadline is not None) != (self.action is Action.EXTEND):
            raise ValueError("new_deadline: must be set for extend and only for extend")


@dataclass(frozen=True)
class Refusal:
    """A request the protocol turns down: the error code, a sentence, extra answer fields."""

    code: ErrorCode
    reason: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JoinGrant:
    round: int
    base_version: int
    expires_at: datetime
    new_lease: bool  # False: the contributor's lease on this round, renewed (same shard, seed)


@dataclass(frozen=True)
class LeaseAssignment:
    """The data a new lease trains on: its shard and batch-sampling seed."""

    shard: int
    seed: int


@dataclass(frozen=True)
class HeartbeatGrant:
    expires_at: datetime


class UploadVerdict(StrEnum):
    ACCEPT = "accept"  # read the body, validate, store
    RETRY = "retry"  # the contributor already has a contribution here: same body → 200


@dataclass(frozen=True)
class LateGrant:
    """A late upload welcome (``diloco.protocol.late.admit_late``): its round closed, but it
    was trained from ``staleness`` versions back, within the run's bound, so it is read,
    checked against its own round and merged into the open round ``merged_into``."""

    merged_into: int  # the open round whose outer step takes it
    staleness: int  # versions published since its base version: merged_into − its round


@dataclass(frozen=True)
class NextRound:
    index: int
    opened_at: datetime
    deadline: datetime


@dataclass(frozen=True)
class CloseEffects:
    """Everything a round's close changes besides the checkpoint itself."""

    accepted: int  # contributions in the step
    tokens: int
    train_loss: float | None  # token-weighted mean of the contributors' losses
    credit: Mapping[str, float]  # FLOPs, by contribution id (only those in the step)
    run_status: RunStatus  # the run's status after the close
    next_round: NextRound | None  # None: the run has no further round
    summary: str  # a sentence for the log and the dashboard


@dataclass(frozen=True)
class StepVerdict:
    """The guard's word on an outer step: publish it, or discard it and say why."""

    ok: bool
    code: Literal["ok", "non_finite", "loss_rise"]
    reason: str
