"""The rows of ``diloco simulate --mode protocol``'s hub (:mod:`diloco.simulate.hub`):
the server settings that shape a round, and the leases, contributions and round logs the
server keeps in Postgres, here in memory."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from diloco.protocol.state import CloseEffects, LeaseAssignment, LeaseView, RoundView
from diloco.simulate.server import RoundDesk
from diloco.simulate.work import Upload

# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class HubSettings:
    """The hub's own settings that shape a round (the defaults are ``server.settings``'s);
    the run's heartbeats, lease TTL and extensions are its config's ``[rounds]``, as on a
    real hub."""

    sweep_interval_s: float = 1.0  # how often the sweeper asks decide_close
    close_s: float = 0.0  # simulated seconds a close takes (aggregate, step, eval, write)
    n_shards: int | None = None  # training shards; None: one per volunteer, as diloco mode

    def __post_init__(self) -> None:
        sweep = self.sweep_interval_s
        if not (math.isfinite(sweep) and sweep > 0):
            raise ValueError(f"sweep_interval_s: must be a positive number of seconds, got {sweep}")
        if not (math.isfinite(self.close_s) and self.close_s >= 0):
            raise ValueError(f"close_s: must be 0 or more seconds, got {self.close_s}")
        if self.n_shards is not None and self.n_shards < 1:
            raise ValueError(f"n_shards: must be at least 1, got {self.n_shards}")


# ---------------------------------------------------------------- the rows


@dataclass
class HubLease:
    """A lease row: whose, which round, the data it trains on, when it lapses."""

    contributor: str
    round: int
    shard: int
    seed: int
    last_heartbeat: datetime
    expires_at: datetime
    inner_steps: int  # its H (diloco.protocol.sizing)
    unit: int | None = None  # a dataset run's data unit (diloco.simulate.dealing.Units)

    @property
    def assignment(self) -> LeaseAssignment:
        return LeaseAssignment(shard=self.shard, seed=self.seed)

    def view(self) -> LeaseView:
        return LeaseView(
            self.contributor, self.last_heartbeat, self.expires_at, self.shard, self.seed
        )


@dataclass(frozen=True)
class Stored:
    """A contribution row with its body (the blob)."""

    contribution_id: str
    contributor: str
    upload: Upload
    compute: timedelta  # the volunteer time that went into it (for goodput)


@dataclass
class RoundLog:
    """A round's rows and what was decided about it."""

    desk: RoundDesk  # the uploads as the server checks them (diloco.simulate.server)
    leases: dict[str, HubLease] = field(default_factory=dict)  # by contributor, in issue order
    contributions: list[Stored] = field(default_factory=list)  # in the order they arrived
    # late work merged into this round's step (trained for an earlier round, whose
    # contribution it is: ``contribution_of`` there); never counted towards quorum here
    late: list[Stored] = field(default_factory=list)
    close_code: str = ""
    close_reason: str = ""
    extension_reasons: list[str] = field(default_factory=list)

    def contribution_of(self, contributor: str) -> Stored | None:
        return next((c for c in self.contributions if c.contributor == contributor), None)


@dataclass(frozen=True)
class Closed:
    """A published close: what ``close_effects`` said, and the step's figures."""

    round: RoundView
    log: RoundLog
    effects: CloseEffects
    update_norm: float
