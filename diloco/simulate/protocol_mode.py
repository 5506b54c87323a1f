"""``diloco simulate --mode protocol``: K volunteers against the round protocol's rules,
on a simulated clock, with the real training and the real outer step.

- :mod:`diloco.simulate.hub`: the server's side. It keeps the server's rows in memory and
  asks the rules of :mod:`diloco.protocol.rules` what the server's services ask them, in
  the same order: joins, heartbeats, upload admission, the sweeper's ``decide_close`` and
  its extensions, the close (aggregate → outer step → ``close_effects``).
- :mod:`diloco.simulate.events`: the clock and the volunteers. Volunteers behave as the
  client does (``client.worker``): join, train H steps while heartbeating, upload, join
  again; they may be slow, drop out (stop heartbeating, so their lease lapses) and come
  back. The sweeper ticks every ``sweep_interval_s`` and is woken by every accepted upload.
- This module: what a simulation is asked (:class:`ProtocolOptions`) and what it reports
  per round (:class:`ProtocolRound`) and in total (:class:`ProtocolTotals`): simulated
  time, compute spent against compute that reached an outer step (goodput), refused
  uploads by code, abandoned work, dropouts, deadline extensions.

``diloco.simulate.run.simulate(cfg, SimOptions(mode="protocol", workers=K), protocol=...)``
runs one; the same config, options and seed give the same records and parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from diloco.simulate.clock import EPOCH
from diloco.simulate.hub import Closed, HubSettings
from diloco.simulate.run import RoundRecord

# why volunteer time did not reach an outer step: an upload refused, a training abandoned
# (a heartbeat said the round closed), lost to a dropout, still going when the clock stopped
WASTE = ("refused", "abandoned", "dropped", "in_flight")


# ---------------------------------------------------------------- options


@dataclass(frozen=True)
class Outage:
    """Volunteer ``volunteer`` (from 0) goes offline at ``at_s`` and comes back at
    ``back_s`` (None: never)."""

    volunteer: int
    at_s: float
    back_s: float | None = None


def per_second(name: str, p: float) -> float:
    """A per-minute probability as the rate of an exponential waiting time."""
    if not (0.0 <= p < 1.0):
        raise ValueError(f"{name}: must be a probability in [0, 1), got {p}")
    return -math.log1p(-p) / 60.0


@dataclass(frozen=True)
class Links:
    """Every volunteer's home link: ``up_mbps`` and ``down_mbps`` megabits per second and
    ``latency_s`` added to each transfer. An upload reaches the hub that long after its
    training ends, and a new lease's download (the checkpoint, or the deltas since the
    version the volunteer holds) delays its training; the volunteer is idle meanwhile.
    ``as_params``: transfers sized as for a model of that many parameters (the simulated
    model's real bytes scaled by as_params / its parameters), so a small model can stand
    for a large one's links; None: the real bytes."""

    up_mbps: float
    down_mbps: float
    latency_s: float = 0.0
    as_params: float | None = None

    def __post_init__(self) -> None:
        for name in ("up_mbps", "down_mbps"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(
                    f"links: {name} must be a positive number, got {getattr(self, name)}"
                )
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"links: latency_s must be 0 or more seconds, got {self.latency_s}")
        if self.as_params is not None and not (
            math.isfinite(self.as_params) and self.as_params >= 1
        ):
            raise ValueError(
                f"links: as_params must be a number of parameters, got {self.as_params}"
            )

    def seconds(self, nbytes: int, mbps: float, n_params: int) -> float:
        """How long ``nbytes`` of a model of ``n_params`` parameters take at ``mbps``."""
        scale = self.as_params / n_params if self.as_params is not None else 1.0
        return self.latency_s + nbytes * scale * 8 / (mbps * 1e6)


@dataclass(frozen=True)
class ProtocolOptions:
    speeds: tuple[float, ...] | None = None  # each volunteer's relative speed (None: all 1)
    step_s: float = 1.0  # simulated seconds of one inner step at speed 1
    join_at_s: tuple[float, ...] | None = None  # each volunteer's first join (None: all at 0)
    drop_per_min: float = 0.0  # chance an online volunteer drops out within a minute
    return_per_min: float = 0.0  # chance an offline volunteer comes back within a minute
    outages: tuple[Outage, ...] = ()  # scripted dropouts, besides the random ones
    hub: HubSettings = field(default_factory=HubSettings)
    max_sim_s: float | None = None  # stop the clock here if the run has not ended by then
    # size each lease's H to its volunteer's speed, as the server does
    # (diloco.protocol.sizing): volunteers report their speed with each join. False: every
    # lease trains the run's steps
    size_h: bool = False
    links: Links | None = None  # None: transfers take no time

    def __post_init__(self) -> None:
        if self.speeds is not None and not all(math.isfinite(s) and s > 0 for s in self.speeds):
            raise ValueError(f"speeds: must all be positive numbers, got {list(self.speeds)}")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"step_s: must be a positive number of seconds, got {self.step_s}")
        if self.join_at_s is not None and not all(
            math.isfinite(t) and t >= 0 for t in self.join_at_s
        ):
            raise ValueError(f"join_at_s: must all be 0 or more seconds, got {self.join_at_s}")
        per_second("drop_per_min", self.drop_per_min)
        per_second("return_per_min", self.return_per_min)
        for o in self.outages:
            if o.at_s < 0 or (o.back_s is not None and not o.back_s > o.at_s):
                raise ValueError(f"outages: {o} must start at 0 s or later and end after it")
        if self.max_sim_s is not None and not self.max_sim_s > 0:
            raise ValueError(f"max_sim_s: must be positive, got {self.max_sim_s}")

    def checked(self, workers: int) -> ProtocolOptions:
        """These options for ``workers`` volunteers, or a ValueError naming the field."""
        for name in ("speeds", "join_at_s"):
            given = getattr(self, name)
            if given is not None and len(given) != workers:
                raise ValueError(f"{name}: {len(given)} given for {workers} volunteers")
        if bad := [o for o in self.outages if not 0 <= o.volunteer < workers]:
            raise ValueError(f"outages: no volunteer {bad[0].volunteer} among {workers}")
        return self


# ---------------------------------------------------------------- results


@dataclass(kw_only=True)
class ProtocolRound(RoundRecord):
    """A round as the hub closed it (``tokens``: all the steps' tokens so far)."""

    opened_at_s: float  # simulated seconds since the start
    closed_at_s: float
    close_code: str  # decide_close's code and sentence for the close
    close_reason: str
    extensions: int
    extension_reasons: list[str]  # decide_close's sentence for each extension
    leases: int  # leases handed out on the round


def round_fields(closed: Closed, *, tokens: int, now: datetime) -> dict[str, Any]:
    """A closed round as ``Recorder.close_round`` records it (a ``ProtocolRound``)."""
    effects, log = closed.effects, closed.log
    return {
        "round": closed.round.index,
        "tokens": tokens,
        # None when the guard rejected the step: nothing was aggregated
        "train_loss": math.nan if effects.train_loss is None else effects.train_loss,
        "accepted": effects.accepted,
        "update_norm": closed.update_norm,
        "opened_at_s": (closed.round.opened_at - EPOCH).total_seconds(),
        "closed_at_s": (now - EPOCH).total_seconds(),
        "close_code": log.close_code,
        "close_reason": log.close_reason,
        "extensions": closed.round.extensions,
        "extension_reasons": list(log.extension_reasons),
        "leases": len(log.leases),
    }


@dataclass
class VolunteerTotals:
    name: str
    speed: float
    accepted: int = 0  # uploads accepted (each reached an outer step, unless in flight)
    late: int = 0  # of which merged late into a later round (diloco.protocol.late)
    refused: int = 0  # uploads refused
    abandoned: int = 0  # trainings stopped by a heartbeat answer
    dropouts: int = 0
    compute_s: float = 0.0  # simulated seconds of training
    useful_s: float = 0.0  # of which went into an outer step
    transfer_s: float = 0.0  # simulated seconds uploading and downloading (with links)
    credit_flops: float = 0.0  # close_effects' credit for its contributions


@dataclass
class ProtocolTotals:
    stopped_because: str
    sim_time_s: float  # simulated time from the start to the last event handled
    compute_s: float  # volunteer-seconds of training, all volunteers
    transfer_s: float  # volunteer-seconds of uploads and downloads, all volunteers
    useful_s: float  # of which reached an outer step
    goodput: float  # useful_s / compute_s
    wasted_s: dict[str, float]  # the rest, by why: refused, abandoned, dropped, in_flight
    refused: dict[str, int]  # refused uploads by error code
    abandoned: int
    dropouts: int
    extensions: int  # deadline extensions, all rounds
    volunteers: list[VolunteerTotals]

    @classmethod
    def tally(
        cls,
        volunteers: list[VolunteerTotals],
        *,
        stopped_because: str,
        sim_time_s: float,
        wasted_s: dict[str, float],
        refused: dict[str, int],
        extensions: int,
    ) -> ProtocolTotals:
        """The run's totals: the volunteers' summed, with what the hub counted."""
        compute = sum(v.compute_s for v in volunteers)
        useful = sum(v.useful_s for v in volunteers)
        return cls(
            stopped_because=stopped_because,
            sim_time_s=sim_time_s,
            compute_s=compute,
            transfer_s=sum(v.transfer_s for v in volunteers),
            useful_s=useful,
            goodput=useful / compute if compute else 0.0,
            wasted_s=wasted_s,
            refused=refused,
            abandoned=sum(v.abandoned for v in volunteers),
            dropouts=sum(v.dropouts for v in volunteers),
            extensions=extensions,
            volunteers=volunteers,
        )
