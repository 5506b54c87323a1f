"""How often a volunteer heartbeats: the server's advice, and the volunteer's schedule.

The server tells each volunteer how often to heartbeat, in its lease (join) and in every
heartbeat's answer (``heartbeat_interval_s``), by :func:`advise_interval`: the run's own
``[rounds] heartbeat_interval_s``, lengthened when the hub's live leases would together
send more heartbeats a second than the hub's budget (``DILOCO_HEARTBEAT_BUDGET_PER_S``),
but never so far that a lease hears fewer than ``HEARTBEATS_PER_TTL`` heartbeats within
its ``lease_ttl_s``:

    interval = max(configured, min(ceil_to_step(live_leases / budget_per_s), ttl / 3))

So the hub is offered at most ``budget_per_s`` heartbeats a second while ``live_leases ≤
budget_per_s × ttl / 3`` (5,000 leases at the defaults: 500 a second, 30 s); past that,
the TTL's bound wins and the hub needs more API processes (a larger budget) or its runs
a longer ``lease_ttl_s``. A run whose own interval is longer still keeps its own.

The volunteer (``client.worker``; ``bench/load.py``'s simulated ones) follows the latest
advice with :func:`next_heartbeat`: unchanged, it heartbeats every interval; changed, its
next heartbeat comes at a random point of the new interval, so that the many volunteers
who hear a change within the same few seconds spread their heartbeats over the new
interval instead of keeping the burst they came in.

Plain numbers in and out: no clock, no HTTP, no randomness of its own (the caller draws).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from diloco.protocol.volunteer import heartbeat_every

HEARTBEATS_PER_TTL = 3  # a live lease hears at least this many heartbeats before it lapses
STEP_S = 0.5  # a load-driven interval is a multiple of this: small changes in load change nothing


def advise_interval(
    *, configured_s: float, ttl_s: float, live_leases: int, budget_per_s: float
) -> float:
    """Seconds between two heartbeats that the server asks of a run's volunteers, given the
    run's ``[rounds] heartbeat_interval_s`` and ``lease_ttl_s``, the hub's live leases and
    its heartbeat budget (heartbeats a second)."""
    if configured_s <= 0 or ttl_s <= 0 or budget_per_s <= 0 or live_leases < 0:
        raise ValueError(
            f"advise_interval: configured_s, ttl_s and budget_per_s must be positive and "
            f"live_leases not negative, got {configured_s}, {ttl_s}, {budget_per_s}, "
            f"{live_leases}"
        )
    by_load = math.ceil(live_leases / budget_per_s / STEP_S) * STEP_S
    return max(configured_s, min(by_load, ttl_s / HEARTBEATS_PER_TTL))


def next_heartbeat(current_s: float, advised_s: float | None, draw: float) -> tuple[float, float]:
    """(the interval to follow, seconds until the next heartbeat), once a heartbeat was
    answered. ``current_s``: the interval followed so far; ``advised_s``: the answer's
    advice (None: a server from before the advice, or no answer: keep ``current_s``);
    ``draw``: a uniform random number in [0, 1). Unchanged advice: one interval. Changed:
    ``draw`` of the new interval, no sooner than the client's floor
    (``diloco.protocol.volunteer.heartbeat_every``)."""
    if not 0.0 <= draw < 1.0:
        raise ValueError(f"next_heartbeat: draw must be in [0, 1), got {draw}")
    if advised_s is None:
        return current_s, current_s
    interval = heartbeat_every(advised_s)
    if interval == current_s:
        return interval, interval
    return interval, heartbeat_every(draw * interval)


def advised(answer: object) -> float | None:
    """The ``heartbeat_interval_s`` of a heartbeat's (or a lease's) JSON answer; None when
    it has none that is a positive finite number (a server from before the advice)."""
    value = answer.get("heartbeat_interval_s") if isinstance(answer, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None
