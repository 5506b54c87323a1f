"""When to close a round: a pure function of (now, round, contributions, leases, policy).

The background sweeper loads these views, calls `decide_close` and persists the decision; the
`reason` is stored on the round and shown on the dashboard. No clock, database or network
here, so table tests with a fixed `now` pin every rule (as torchft's `quorum_compute`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal


class RoundState(StrEnum):
    OPEN = "open"  # accepting contributions; the sweeper asks decide_close about it
    CLOSING = "closing"  # decided to close: aggregating, outer step, writing the checkpoint
    CLOSED = "closed"  # outer step applied and its checkpoint published; next round is open


class Action(StrEnum):
    KEEP_OPEN = "keep_open"  # nothing to do yet
    CLOSE = "close"  # aggregate the accepted contributions and apply the outer step
    EXTEND = "extend"  # deadline passed below quorum: stay open with `new_deadline`


# Stable, machine-readable reason codes (metrics labels, API); `reason` is for people.
ReasonCode = Literal[
    "target", "quorum_no_live_leases", "deadline_quorum", "deadline_below_quorum", "waiting",
    "not_open",
]  # fmt: skip


def _require_aware(name: str, value: datetime) -> None:
    # Naive datetimes compare wrongly against aware ones (or raise deep in a comparison);
    # reject them at the boundary with the field's name instead.
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name}: must be timezone-aware, got naive {value.isoformat()}")


@dataclass(frozen=True)
class RoundView:
    index: int
    opened_at: datetime
    deadline: datetime  # opened_at + timeout_s, moved later by each extension
    state: RoundState
    extensions: int = 0  # how many times the deadline has been extended so far

    def __post_init__(self) -> None:
        _require_aware("opened_at", self.opened_at)
        _require_aware("deadline", self.deadline)


@dataclass(frozen=True)
class ContributionView:
    contributor_id: str
    accepted: bool  # passed validation (shapes, finite values, base version)
    tokens: int
    base_version: int


@dataclass(frozen=True)
class LeaseView:
    """A contributor's claim to be working on the round; live while `now < expires_at`."""

    contributor_id: str
    last_heartbeat: datetime
    expires_at: datetime  # pushed forward by each heartbeat; when heartbeats stop, it lapses

    def __post_init__(self) -> None:
        _require_aware("last_heartbeat", self.last_heartbeat)
        _require_aware("expires_at", self.expires_at)

    def is_live(self, now: datetime) -> bool:
        return now < self.expires_at


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
        for name in ("timeout_s", "extension_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value}")
        if self.max_extensions is not None and self.max_extensions < 0:
            raise ValueError(f"max_extensions: must be at least 0, got {self.max_extensions}")

    @property
    def extension(self) -> timedelta:
        return timedelta(seconds=self.timeout_s if self.extension_s is None else self.extension_s)


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    reason: str  # a sentence for the dashboard, with the numbers in it
    new_deadline: datetime | None = None  # set only for Action.EXTEND
    code: ReasonCode

    def __post_init__(self) -> None:
        if (self.new_deadline is not None) != (self.action is Action.EXTEND):
            raise ValueError("new_deadline: must be set for extend and only for extend")


def decide_close(
    now: datetime,
    round: RoundView,
    contributions: Sequence[ContributionView],
    leases: Sequence[LeaseView],
    policy: ClosePolicy,
) -> Decision:
    """Decide whether `round` closes now; the first matching rule wins.

    1. A round that is not open is being (or was) closed by someone: nothing to decide.
    2. Target reached: close at once, live leases or not; more work would be wasted.
    3. Quorum reached and no live lease outstanding: nobody else is about to deliver, so
       waiting for the deadline would only idle the volunteers.
    4. Deadline passed with quorum: close with what arrived.
    5. Deadline passed below quorum: extend by `policy.extension`, since the accepted
       contributions (same base) stay valid; once `max_extensions` is used up, keep waiting.
    6. Otherwise wait.

    Accepted contributions count once per contributor (a retry must not count twice). A lease
    is outstanding when it is live and its holder has no accepted contribution yet: a rejected
    upload may be retried while the lease lives, and the deadline bounds that wait.
    """
    _require_aware("now", now)
    if round.state is not RoundState.OPEN:
        reason = f"round {round.index} is {round.state}, not open: nothing to decide"
        return Decision(action=Action.KEEP_OPEN, reason=reason, code="not_open")

    contributed = {c.contributor_id for c in contributions if c.accepted}
    accepted = len(contributed)
    outstanding = {lease.contributor_id for lease in leases if lease.is_live(now)} - contributed
    quorum = policy.quorum

    if policy.target is not None and accepted >= policy.target:
        reason = f"target reached: {accepted} of target {policy.target} accepted contributions"
        return Decision(action=Action.CLOSE, reason=reason, code="target")
    if accepted >= quorum and not outstanding:
        reason = f"quorum reached ({accepted} of {quorum}) and no live lease outstanding"
        return Decision(action=Action.CLOSE, reason=reason, code="quorum_no_live_leases")
    if now >= round.deadline and accepted >= quorum:
        reason = f"deadline passed with quorum: {accepted} accepted, quorum {quorum}"
        return Decision(action=Action.CLOSE, reason=reason, code="deadline_quorum")
    if now >= round.deadline:
        below = f"deadline passed below quorum: {accepted} of {quorum} accepted"
        limit = policy.max_extensions
        if limit is not None and round.extensions >= limit:
            reason = f"{below}; extension limit {limit} reached, so the round waits for quorum"
            return Decision(action=Action.KEEP_OPEN, reason=reason, code="deadline_below_quorum")
        seconds = policy.extension.total_seconds()
        reason = f"{below}; deadline extended by {seconds:g} s (extension {round.extensions + 1})"
        return Decision(
            action=Action.EXTEND,
            reason=reason,
            new_deadline=now + policy.extension,
            code="deadline_below_quorum",
        )

    left = math.ceil((round.deadline - now).total_seconds())  # never "0 s" before it passes
    leases_text = f"{len(outstanding)} live lease{'' if len(outstanding) == 1 else 's'}"
    reason = f"waiting: {accepted} of quorum {quorum} accepted, {leases_text}, deadline in {left} s"
    return Decision(action=Action.KEEP_OPEN, reason=reason, code="waiting")


def expired_leases(now: datetime, leases: Sequence[LeaseView]) -> list[LeaseView]:
    """Leases whose holders stopped heartbeating (`expires_at <= now`): the sweeper frees them."""
    _require_aware("now", now)
    return [lease for lease in leases if not lease.is_live(now)]
