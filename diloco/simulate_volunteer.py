"""A volunteer of ``diloco simulate --mode protocol`` (:mod:`diloco.simulate_events`): its
state, and how it reacts to the hub's answers, as the client (``client.worker``) does."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import torch

from diloco.architectures import build_model
from diloco.config import RunConfig
from diloco.protocol.late import welcome_late
from diloco.protocol.messages import ErrorCode
from diloco.protocol.state import Refusal
from diloco.simulate import SimOptions
from diloco.simulate_hub import HubLease
from diloco.simulate_protocol import ProtocolOptions, VolunteerTotals
from diloco.train import InnerTrainer

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)  # the simulated clock starts here
# the client's reactions (client.worker): what ends a lease, how long it waits to rejoin
LOST_LEASE_CODES = frozenset({ErrorCode.ROUND_CLOSED, ErrorCode.NO_LEASE, ErrorCode.RUN_NOT_ACTIVE})
RETRY_JOIN_CODES = frozenset({ErrorCode.ALREADY_CONTRIBUTED, ErrorCode.ROUND_CLOSING})
CLIENT_MIN_WAIT_S, CLIENT_MAX_WAIT_S, CLIENT_MIN_HEARTBEAT_S = 0.5, 120.0, 1.0


@dataclass
class Volunteer:
    index: int
    name: str
    step: timedelta  # one inner step at this volunteer's speed
    trainer: InnerTrainer  # its model and AdamW, kept across rounds as the client keeps them
    rng: random.Random  # its dropouts and returns
    totals: VolunteerTotals
    online: bool = False
    session: int = 0  # bumped on going offline or online: stale random dropouts are ignored
    task: int = 0  # bumped when what it does changes: stale timers are ignored
    lease: HubLease | None = None
    started: datetime = EPOCH  # when it began training for `lease`
    arrivals: int = 0  # scheduled comings online not yet happened


def still_welcome(round: int, answer: Refusal, max_staleness: int) -> bool:
    """A "round closed" answer about work for ``round`` that the run still takes late: the
    volunteer finishes its steps and uploads (again, after ``LATE_RETRY_S``, while the
    round is closing) instead of abandoning it."""
    return welcome_late(round, answer.code, answer.extra.get("current_round"), max_staleness)


def build_volunteers(
    cfg: RunConfig, opts: SimOptions, proto: ProtocolOptions, device: torch.device
) -> list[Volunteer]:
    """Every volunteer's model and AdamW, built now and in order (as diloco mode builds its
    workers'), so that the global RNG is drawn from in the same order."""
    speeds = proto.speeds or (1.0,) * opts.workers
    return [
        Volunteer(
            index=i,
            name=f"v{i}",
            step=timedelta(seconds=proto.step_s / speed),
            trainer=InnerTrainer(
                build_model(cfg.model),
                cfg.inner,
                total_steps=cfg.total_inner_steps,
                device=device,
            ),
            rng=random.Random(opts.seed * 1_000_003 + 20_000 + i),
            totals=VolunteerTotals(name=f"v{i}", speed=float(speed)),
        )
        for i, speed in enumerate(speeds)
    ]
