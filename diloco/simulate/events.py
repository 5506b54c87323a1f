"""The discrete-event run of ``diloco simulate --mode protocol`` (see
:mod:`diloco.simulate.protocol_mode`): a simulated clock, the volunteers, the sweeper.

Time: datetimes from ``EPOCH``; events in a priority queue ordered by (time, order of
scheduling), so the same inputs give the same run and no wall clock is ever read.

Volunteers do what ``client.worker`` does, reacting to each of the hub's answers as
``diloco.protocol.volunteer`` says (the client's very table): join; train their lease's H
inner steps (``step_s / speed`` simulated seconds each; with ``size_h`` the hub sizes H to
the speed each reports, else it is the run's steps), heartbeating every
``heartbeat_every(heartbeat_interval_s)``; upload; join again. With ``[inner] overlap`` a
volunteer trains ahead from the end of its training (while its body travels, the round
closes and the next version comes down) on its last lease's data, as many steps as fit
before its next lease's version is here, up to the cap; they count as that lease's first
steps, and its claim's tokens are those of the steps left (``Volunteer.steps_ahead``,
``Volunteer.train_ahead``).
A join answered "already contributed" or "round closing" is tried again after the answer's
``retry_after_s`` (``WAIT``). A heartbeat whose answer abandons the lease ("round closed",
"no lease") stops the training at the end of the step in progress (unless that is the last
step: then the upload goes out and is refused), except while the run takes the work late
(``CARRY_ON``): then the volunteer finishes and uploads, and the hub merges it into the
open round; an upload answered "round closed" while still worth it (the round is closing)
is sent again as the table says (``SEND_AGAIN``).
A volunteer that drops out stops heartbeating, so its lease lapses ``lease_ttl_s`` after
its last heartbeat; when it comes back it joins again (its own lease renewed, if the round
is the same). Dropouts and returns are random (per-minute chances, seeded per volunteer)
or scripted (``outages``).

The sweeper ticks every ``sweep_interval_s`` and is woken at once by every accepted upload,
as the server's NOTIFY wakes it; a CLOSE is published ``close_s`` later.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta

import torch

from diloco.config import RunConfig
from diloco.data.text import Dataset
from diloco.model.architectures import build_model
from diloco.model.gpt import LanguageModel
from diloco.protocol.state import Action, LateGrant, Refusal, RunStatus, UploadClaim
from diloco.protocol.volunteer import Do, Request, heartbeat_every
from diloco.simulate.clock import EPOCH, EventClock
from diloco.simulate.dealing import Units
from diloco.simulate.hub import Hub, HubLease
from diloco.simulate.protocol_mode import (
    WASTE,
    ProtocolOptions,
    ProtocolRound,
    ProtocolTotals,
    per_second,
    round_fields,
)
from diloco.simulate.run import (
    Progress,
    Recorder,
    Runner,
    SimOptions,
    Trained,
)
from diloco.simulate.server import SIM_RUN_ID
from diloco.simulate.volunteer import Volunteer, build_volunteers
from diloco.simulate.work import upload_nbytes


def protocol_runner(proto: ProtocolOptions, opts: SimOptions) -> tuple[Runner, int]:
    """The runner for ``diloco.simulate.run.simulate`` and how many shards it needs."""
    proto = proto.checked(opts.workers)
    if opts.drop_prob:
        raise ValueError("drop_prob: protocol mode drops volunteers with drop_per_min instead")

    def run(
        cfg: RunConfig,
        opts: SimOptions,
        data: Dataset,
        model: LanguageModel,
        device: torch.device,
        progress: Progress | None,
    ) -> Trained:
        return _ProtocolRun(cfg, opts, proto, data, model, device, progress).run()

    return run, proto.hub.n_shards or opts.workers


class _ProtocolRun:
    def __init__(
        self,
        cfg: RunConfig,
        opts: SimOptions,
        proto: ProtocolOptions,
        data: Dataset,
        model: LanguageModel,
        device: torch.device,
        progress: Progress | None,
    ) -> None:
        self.cfg, self.proto, self.data = cfg, proto, data
        settings = proto.hub
        self.recorder = Recorder(cfg, opts, data, device, progress)
        self.hub = Hub(
            cfg,
            settings,
            model=model,
            opts=opts,
            n_shards=settings.n_shards or opts.workers,
            now=EPOCH,
            evaluate=Recorder(cfg, opts, data, device, None).evaluator(build_model(cfg.model)),
            score_sample=self.recorder.score_sample(),
            units=Units.of(data, cfg, opts.seed),
        )
        self.heartbeat_every = timedelta(seconds=heartbeat_every(cfg.rounds.heartbeat_interval_s))
        self.drop_rate = per_second("drop_per_min", proto.drop_per_min)
        self.return_rate = per_second("return_per_min", proto.return_per_min)
        self.volunteers = build_volunteers(cfg, opts, proto, device)
        self.by_name = {v.name: v for v in self.volunteers}
        self.clock = EventClock(EPOCH)
        self.stopped_because: str | None = None
        self.wasted = dict.fromkeys(WASTE, 0.0)  # seconds, by why
        self.refused: Counter[str] = Counter()  # uploads, by code
        self.extensions = self.bytes_up = self.downloads = self.tokens = 0
        # with links: how long an upload travels (every body of a run is the same size,
        # but for a few header bytes), and the model's size that transfers are scaled from
        self.n_params = sum(p.numel() for p in model.parameters())
        self.upload_bytes = upload_nbytes(cfg, model) if proto.links is not None else 0

    # ------------------------------------------------------------ the clock

    @property
    def now(self) -> datetime:
        return self.clock.now

    def _at(self, when: datetime, action: Callable[[], None]) -> None:
        self.clock.at(when, action)

    def _later(self, v: Volunteer, after: timedelta, action: Callable[[Volunteer], None]) -> None:
        """``action(v)`` after ``after``, unless ``v`` has moved on to something else."""
        task = v.task
        self._at(self.now + after, lambda: action(v) if v.task == task else None)

    def run(self) -> Trained:
        # the volunteers' first joins, the scripted outages, the sweeper's first tick
        for v, at in zip(
            self.volunteers, self.proto.join_at_s or [0.0] * len(self.volunteers), strict=True
        ):
            self._arrive(v, EPOCH + timedelta(seconds=at))
        for o in self.proto.outages:
            v = self.volunteers[o.volunteer]
            self._at(EPOCH + timedelta(seconds=o.at_s), functools.partial(self._go_offline, v))
            if o.back_s is not None:
                self._arrive(v, EPOCH + timedelta(seconds=o.back_s))
        self._at(EPOCH + timedelta(seconds=self.proto.hub.sweep_interval_s), self._tick)
        limit = (
            None
            if self.proto.max_sim_s is None
            else EPOCH + timedelta(seconds=self.proto.max_sim_s)
        )
        if self.clock.run(until=limit, stop=lambda: self.stopped_because is not None):
            self.stopped_because = f"time limit of {self.proto.max_sim_s:g} s"
        K = len(self.volunteers)
        up, down = self.bytes_up // K, self.downloads * self.hub.checkpoint_bytes // K
        if (ledger := self.hub.ledger) is None:
            return Trained(self.recorder.records, up, down, self._totals())
        report, x = self.hub.delta_report()
        return Trained(self.recorder.records, up, ledger.bytes // K, self._totals(), report, x)

    # ------------------------------------------------------------ volunteers coming and going

    def _arrive(self, v: Volunteer, when: datetime) -> None:
        v.arrivals += 1
        self._at(when, lambda: self._come_online(v))

    def _come_online(self, v: Volunteer) -> None:
        v.arrivals -= 1
        if v.online:
            return
        v.online, v.session, v.task = True, v.session + 1, v.task + 1
        if self.drop_rate:
            session, after = v.session, v.rng.expovariate(self.drop_rate)
            self._at(
                self.now + timedelta(seconds=after),
                lambda: self._go_offline(v) if v.session == session else None,
            )
        self._join(v)

    def _go_offline(self, v: Volunteer) -> None:
        """It stops: no more heartbeats (its lease lapses by itself), its work so far lost."""
        if not v.online:
            return
        if v.lease is not None:
            self._spend(v, self._trained(v), wasted="dropped")
        v.online, v.lease, v.session, v.task = False, None, v.session + 1, v.task + 1
        v.last = v.trained_at = None
        v.totals.dropouts += 1
        if self.return_rate:
            self._arrive(v, self.now + timedelta(seconds=v.rng.expovariate(self.return_rate)))

    # ------------------------------------------------------------ a volunteer's round

    def _join(self, v: Volunteer) -> None:
        rate = None
        if self.proto.size_h:  # it reports its speed, as a client does from its last round
            rate = self.cfg.tokens_per_step / v.step.total_seconds()
        fetched = 0 if self.hub.ledger is None else self.hub.ledger.bytes
        answer = self.hub.join(self.now, v.name, tokens_per_s=rate)
        if isinstance(answer, Refusal):
            reaction = v.react(Request.JOIN, answer)
            if reaction.do is Do.WAIT:
                self._later(v, timedelta(seconds=reaction.wait_s), self._join)
            elif reaction.do is not Do.STOP:  # STOP: the run is over
                raise RuntimeError(f"{v.name}: join refused: {answer.code}: {answer.reason}")
            return
        v.lease, new = answer
        v.granted(v.lease.round, self.cfg.rounds.max_staleness)
        self.downloads += new  # a renewed lease's checkpoint is in the client's cache
        if self.hub.ledger is not None:  # the deltas since the version it holds
            down = self.hub.ledger.bytes - fetched
        else:
            down = self.hub.checkpoint_bytes * new
        wait = self._transfer(v, down, upload=False) if down else timedelta(0)
        v.started, v.task = self.now + wait, v.task + 1  # it trains once θ is here
        v.ahead = v.steps_ahead(v.started, self.cfg)
        self._later(v, wait + v.steps_left * v.step, self._upload)
        self._later(v, self.heartbeat_every, self._heartbeat)

    def _transfer(self, v: Volunteer, nbytes: int, *, upload: bool) -> timedelta:
        """How long ``nbytes`` take over ``v``'s link (none: no time), counted as its
        transfer time."""
        links = self.proto.links
        if links is None:
            return timedelta(0)
        mbps = links.up_mbps if upload else links.down_mbps
        seconds = links.seconds(nbytes, mbps, self.n_params)
        v.totals.transfer_s += seconds
        return timedelta(seconds=seconds)

    def _trained(self, v: Volunteer) -> timedelta:
        """How long ``v`` has trained on its lease so far, the steps ahead included (not its
        download, not its upload)."""
        assert v.lease is not None
        now = max(timedelta(0), min(self.now - v.started, v.steps_left * v.step))
        return v.ahead * v.step + now

    def _upload(self, v: Volunteer) -> None:
        """H steps done: the body travels, then the hub takes it (``_finish``)."""
        v.trained_at = self.now  # it may train ahead from here (overlap)
        if self.proto.links is None:
            self._finish(v)
        else:
            self._later(v, self._transfer(v, self.upload_bytes, upload=True), self._finish)

    def _heartbeat(self, v: Volunteer) -> None:
        assert v.lease is not None
        answer = self.hub.heartbeat(self.now, v.name, v.lease.round)
        reaction = v.react(Request.HEARTBEAT, answer)
        if reaction.do is Do.CARRY_ON:  # renewed, or the work is merged late
            self._later(v, self.heartbeat_every, self._heartbeat)
            return
        if reaction.do is not Do.ABANDON:
            assert isinstance(answer, Refusal)
            raise RuntimeError(f"{v.name}: heartbeat refused: {answer.code}: {answer.reason}")
        # the client stops at the end of the step in progress, unless that is the last one
        # (then it uploads, and the upload is refused)
        done = max(0, -(-(self.now - v.started) // v.step))  # steps begun, ceil
        if done >= v.steps_left:
            return
        stop = max(self.now, v.started + done * v.step)  # or now, while it downloads
        spent = v.ahead * v.step + max(timedelta(0), stop - v.started)
        self._spend(v, spent, wasted="abandoned")
        v.totals.abandoned += 1
        v.lease, v.task, v.last, v.trained_at = None, v.task + 1, None, None
        self._later(v, stop - self.now, self._join)

    def _finish(self, v: Volunteer) -> None:
        """H steps done: upload, then join again."""
        lease, cfg = v.lease, self.cfg
        assert lease is not None
        spent = self._trained(v)  # not the waits after, nor the upload
        v.task += 1
        claim = UploadClaim(
            run_id=SIM_RUN_ID,
            round=lease.round,
            base_version=lease.round - 1,
            tokens=v.steps_left * cfg.tokens_per_step,  # the steps ahead read old data
            inner_steps=lease.inner_steps,
        )
        verdict = self.hub.admit_upload(v.name, lease.round, claim)
        reaction = v.react(Request.UPLOAD, verdict)
        if reaction.do is Do.SEND_AGAIN:  # the round is closing: merged once the next opens
            self._later(v, timedelta(seconds=reaction.wait_s), self._finish)
            return
        v.lease, last, v.last = None, v.last, None
        late = verdict if isinstance(verdict, LateGrant) else None
        if isinstance(verdict, Refusal):
            v.trained_at = None
            if reaction.do not in (Do.DROP, Do.REFUSED):  # an honest volunteer: a bug
                raise RuntimeError(f"{v.name}: upload refused: {verdict.code}: {verdict.reason}")
            refusal = verdict
            self._spend(v, spent, wasted="refused")
            self.refused[refusal.code] += 1
            v.totals.refused += 1
        else:
            self._store(v, lease, claim, spent, late, last)
        self._join(v)

    def _store(
        self,
        v: Volunteer,
        lease: HubLease,
        claim: UploadClaim,
        spent: timedelta,
        late: LateGrant | None,
        last: HubLease | None,
    ) -> None:
        """An admitted upload: its lease trained and the body stored at the hub."""
        cfg = self.cfg
        # The inner training happens here, once the upload is admitted, not when the
        # lease was granted: admission does not look at Δ, and Δ depends only on what
        # was fixed at the join (θ of the round's base version, which is still the
        # latest while the round is open; the lease's shard and seed) and on the
        # volunteer's AdamW state, which only its earlier trainings change. So work
        # that is refused, abandoned or lost costs no CPU. The one difference from the
        # client: its AdamW moments would also carry the steps of such wasted work.
        # Late work trains from its own base version, which the hub keeps.
        assert late is not None or self.hub.version == lease.round - 1
        secret = None if late is not None else self.hub.files.check_seed(lease.round)
        base = self.hub.params_of(lease.round - 1)
        upload, own = v.train_lease(lease, base, cfg, self.data, self.hub.units, last=last,
                                    secret=secret)  # fmt: skip
        assert upload.result.tokens == claim.tokens
        self.bytes_up += upload.nbytes
        refused = self.hub.store(v.name, lease.round, upload, spent, late, own=own)
        if refused is not None:  # an honest volunteer's body is never refused: a bug
            raise RuntimeError(f"{v.name}: upload refused: {refused.code}: {refused.reason}")
        self._spend(v, spent)
        v.totals.accepted += 1
        v.totals.late += late is not None
        self._at(self.now, self._sweep)  # the upload's NOTIFY wakes the sweeper

    def _spend(self, v: Volunteer, spent: timedelta, wasted: str | None = None) -> None:
        v.totals.compute_s += spent.total_seconds()
        if wasted is not None:
            self.wasted[wasted] += spent.total_seconds()

    # ------------------------------------------------------------ the sweeper and closes

    def _tick(self) -> None:
        self._sweep()
        if self.stopped_because is None and (why := self._stalled()):
            self.stopped_because = why
        elif self.stopped_because is None:
            self._at(self.now + timedelta(seconds=self.proto.hub.sweep_interval_s), self._tick)

    def _sweep(self) -> None:
        decision = self.hub.decide(self.now)
        if decision is None:
            return
        if decision.action is Action.EXTEND:
            self.extensions += 1
        elif decision.action is Action.CLOSE:
            self._at(self.now + timedelta(seconds=self.proto.hub.close_s), self._close)

    def _close(self) -> None:
        closed = self.hub.close(self.now)
        effects, log = closed.effects, closed.log
        for c in [*log.contributions, *log.late]:  # what went into the step was useful
            if c.contribution_id in effects.credit:
                totals = self.by_name[c.contributor].totals
                totals.useful_s += c.compute.total_seconds()
                totals.credit_flops += effects.credit[c.contribution_id]
        self.tokens += effects.tokens
        fields = round_fields(closed, tokens=self.tokens, now=self.now)
        self.recorder.close_round(self.hub.model, ProtocolRound, **fields)
        if self.hub.status is RunStatus.COMPLETED:
            self.stopped_because = "completed"

    def _stalled(self) -> str | None:
        """Why the open round can never close (too few volunteers left to reach quorum)."""
        return self.hub.stalled([v.name for v in self.volunteers if v.online or v.arrivals])

    def _totals(self) -> ProtocolTotals:
        # work in progress when the clock stopped, and accepted work no step has used yet
        for v in self.volunteers:
            if v.lease is not None:
                self._spend(v, self._trained(v), wasted="in_flight")
        if self.hub.current is not None:
            log = self.hub.logs[self.hub.current]
            for c in [*log.contributions, *log.late]:
                self.wasted["in_flight"] += c.compute.total_seconds()
        return ProtocolTotals.tally(
            [v.totals for v in self.volunteers],
            stopped_because=self.stopped_because or "no events left",
            sim_time_s=(self.now - EPOCH).total_seconds(),
            wasted_s=dict(self.wasted),
            refused={str(code): n for code, n in sorted(self.refused.items())},
            extensions=self.extensions,
        )
