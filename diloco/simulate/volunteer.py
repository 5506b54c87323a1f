"""A volunteer of ``diloco simulate --mode protocol`` (:mod:`diloco.simulate.events`): its
state, and its reactions to the hub's answers: ``diloco.protocol.volunteer``'s, the very
table the client (``client.worker``) follows."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import torch

from diloco.config import RunConfig
from diloco.data.text import Dataset
from diloco.model.architectures import build_model
from diloco.outer.scoring import Windows, lease_windows
from diloco.protocol.state import Refusal
from diloco.protocol.volunteer import Answer, Reaction, Request, VolunteerState, step
from diloco.simulate.clock import EPOCH
from diloco.simulate.dealing import Batch, Units, lease_batches
from diloco.simulate.hub import HubLease
from diloco.simulate.protocol_mode import ProtocolOptions, VolunteerTotals
from diloco.simulate.run import SimOptions
from diloco.simulate.work import Upload, train_upload
from diloco.train import Ahead, InnerTrainer, train_ahead


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
    started: datetime = EPOCH  # when it began training for `lease` (after the steps ahead)
    # overlap ([inner] overlap): its last accepted lease, and when its training ended; it
    # may train ahead from then on that lease's data (None: it cannot: it just came, or its
    # last work was refused or dropped, so its model holds no round's end to go on from)
    last: HubLease | None = None
    trained_at: datetime | None = None
    ahead: int = 0  # steps taken ahead that count toward `lease`
    arrivals: int = 0  # scheduled comings online not yet happened
    state: VolunteerState = field(default_factory=VolunteerState)  # what its reactions recall

    def react(self, to: Request, answer: object) -> Reaction:
        """Its reaction to the hub's answer to ``to`` (``diloco.protocol.volunteer``, as
        the client's): a ``Refusal``, or anything else for a success."""
        if isinstance(answer, Refusal):
            said = Answer(to, code=answer.code, body=answer.extra)
        else:
            said = Answer(to)
        self.state, reaction = step(self.state, said)
        return reaction

    @property
    def steps_left(self) -> int:
        """The steps of its lease still to train once its version is here."""
        assert self.lease is not None
        return max(1, self.lease.inner_steps - self.ahead)

    def steps_ahead(self, start: datetime, cfg: RunConfig) -> int:
        """The steps it took ahead (``[inner] overlap``) between the end of its last
        accepted round's training and ``start``, when its new lease's version is here: as
        many as fit, up to the cap (the client stops at the cap or when the version lands)."""
        if self.last is None or self.trained_at is None:
            return 0
        fit = int((start - self.trained_at) / self.step)
        return min(cfg.inner.ahead_cap(self.last.inner_steps), fit)

    def train_ahead(
        self, last: HubLease | None, cfg: RunConfig, data: Dataset, units: Units | None
    ) -> Ahead | None:
        """Its ``ahead`` steps from its end of ``last`` on that lease's data (as the client
        does, from the step after ``last``'s nominal H), trained when its upload is admitted,
        lazily as the rest of the round is."""
        if not self.ahead:
            return None
        assert last is not None
        again = lease_batches(data, cfg, last.assignment, units, last.unit, ahead=True)
        start = last.round * cfg.inner.steps
        return train_ahead(self.trainer, self.ahead, start_step=start, next_batch=again)

    def train_lease(
        self,
        lease: HubLease,
        base: dict[str, torch.Tensor],
        cfg: RunConfig,
        data: Dataset,
        units: Units | None,
        *,
        last: HubLease | None,
        secret: int | None,
    ) -> tuple[Upload, Windows | None]:
        """Its ``lease`` trained from ``base`` (after its steps ahead from its end of
        ``last``, its lease before), and the windows of the lease's stream the close scores
        it on, read again as the server does (``secret``: the round's check seed; None:
        not scored, late work)."""

        def stream() -> Callable[[], Batch]:
            return lease_batches(data, cfg, lease.assignment, units, lease.unit)

        upload = train_upload(
            self.trainer, base, cfg=cfg, round=lease.round, next_batch=stream(),
            steps=lease.inner_steps, ahead=self.train_ahead(last, cfg, data, units),
        )  # fmt: skip
        self.last = lease
        if secret is None or not cfg.aggregation.score_windows:
            return upload, None
        own = lease_windows(stream(), cfg, steps=lease.inner_steps, secret=secret,
                            lease=lease.assignment.seed)  # fmt: skip
        return upload, own

    def granted(self, round: int, max_staleness: int) -> None:
        """It holds a lease on ``round`` of a run that merges work ``max_staleness`` late."""
        answer = Answer(Request.JOIN, body={"round": round, "max_staleness": max_staleness})
        self.state, _ = step(self.state, answer)


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
