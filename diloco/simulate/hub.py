"""The hub of ``diloco simulate --mode protocol``: the server's round bookkeeping, in memory,
deciding with the protocol's rules exactly where and in the order the server does.

One method per server path (read them side by side):

- ``join``: ``server.rounds.leases.join``: ``admit_join``; a new lease takes the round's
  next ordinal and ``assign_lease`` says its shard and seed, ``size_lease`` its H from the
  speed the volunteer reports (none: the run's steps); on a prepared dataset it takes a
  data unit as ``coverage.PICK_UNIT`` does (:class:`diloco.simulate.dealing.Units`, counted
  trained when its upload is stored); a held lease is renewed.
- ``heartbeat``: ``server.rounds.leases.heartbeat``: ``admit_heartbeat``.
- ``admit_upload`` then ``store``: ``server.rounds.ingest.receive``: ``admit_upload``
  before the body is read, ``admit_claim`` on its header, the body checked (finite once
  decoded, not a replay, its weight capped: ``diloco.simulate.server.RoundDesk``), then
  the row. The caller wakes the sweeper afterwards, as the server's NOTIFY does. Work
  for a round that closed is merged late into the open round when ``admit_late`` says
  so, discounted by its staleness (``diloco.protocol.late``); it trains from its own
  base version, which the hub keeps for ``max_staleness`` versions.
- ``decide``: ``server.rounds.sweeper.Sweeper._decide``: ``decide_close`` on the open
  round; CLOSE marks it closing, EXTEND moves its deadline and counts the extension.
- ``close``: ``server.rounds.closing`` and ``outer_step``: the round's contributions in the
  order they arrived, written to files as the server stores them, then the server's own
  close (``diloco.outer.close``: robust aggregate, Nesterov step, int8 delta with error
  feedback, every step judged before it is published; the versions in a temp dir of the
  hub's, :mod:`diloco.simulate.versions`), then ``close_effects`` (counts, loss, credit,
  the next round). A step the guard rejects is not published (the server would retry the
  round with backoff; here it closes without a step, and the version is unchanged).
  Leases download θ, the published parameters; with delta downloads they are counted as
  the deltas since the version a volunteer holds (:mod:`diloco.simulate.downloads`).

What the simulator leaves out: no blob is ever unreadable (no exclusions), no close fails
(no retries), no run is paused or cancelled.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import torch
from safetensors.torch import save as safetensors_save

from diloco.config import RunConfig
from diloco.model.gpt import LanguageModel
from diloco.outer.close import Evaluate
from diloco.outer.scoring import Windows
from diloco.protocol.outcome import close_effects
from diloco.protocol.rules import (
    admit_claim,
    admit_heartbeat,
    admit_join,
    admit_upload,
    assign_lease,
    decide_close,
)
from diloco.protocol.sizing import StepBounds, size_lease
from diloco.protocol.state import (
    Action,
    Aggregated,
    ClosePolicy,
    ContributionView,
    Decision,
    HeartbeatFacts,
    HeartbeatGrant,
    JoinFacts,
    LateGrant,
    LeasePolicy,
    Refusal,
    RoundState,
    RoundView,
    RunStatus,
    UploadClaim,
    UploadFacts,
    UploadVerdict,
)
from diloco.simulate.dealing import Units
from diloco.simulate.downloads import DeltaReport, Ledger
from diloco.simulate.rows import Closed, HubLease, HubSettings, RoundLog, Stored
from diloco.simulate.run import SimOptions
from diloco.simulate.server import SIM_RUN_ID, RoundDesk, Standings
from diloco.simulate.versions import Versions
from diloco.simulate.work import Upload
from diloco.train import load_parameters, parameters_of

__all__ = ["Closed", "Hub", "HubLease", "HubSettings", "RoundLog", "Stored"]

# ---------------------------------------------------------------- the hub


class Hub:
    def __init__(
        self,
        cfg: RunConfig,
        settings: HubSettings,
        *,
        model: LanguageModel,
        opts: SimOptions,
        n_shards: int,
        now: datetime,
        evaluate: Evaluate,
        score_sample: Windows | None = None,
        units: Units | None = None,
    ) -> None:
        self.cfg, self.settings, self.model, self.run_seed = cfg, settings, model, opts.seed
        self.units = units  # a dataset run's data units, dealt as PICK_UNIT deals them
        self.evaluate = evaluate  # the guard's judge: a version's judging loss
        self.score_sample = score_sample  # the scoring's shared windows (Recorder.score_sample)
        # the very policies the server builds (diloco.protocol.state)
        self.closing = ClosePolicy.of(cfg.rounds)
        self.leasing = LeasePolicy.of(
            ttl_s=cfg.rounds.lease_ttl_s,
            n_shards=n_shards,
            sweep_interval_s=settings.sweep_interval_s,
        )
        self.status = RunStatus.ACTIVE
        # version 0: the model's parameters and an outer state with no momentum yet
        self.files = Versions(
            cfg, parameters_of(model), run_id=SIM_RUN_ID, delta_dir=opts.delta_dir
        )
        self.version = 0
        self.history: list[float] = []  # aggregated norms: the clipping's reference
        self.standings = Standings()  # each volunteer's standing, as the server keeps it
        self.checkpoint_bytes = len(safetensors_save(self.files.theta))
        # delta downloads: what each volunteer holds, and the deltas since
        self.ledger = (
            Ledger(self.files.sizes, self.checkpoint_bytes) if opts.downloads == "delta" else None
        )
        self.n_params = model.num_parameters()
        self.rounds: dict[int, RoundView] = {}
        self.logs: dict[int, RoundLog] = {}
        self.current: int | None = None  # the round in progress (open or closing)
        # θ of the versions late work may still train from: the latest max_staleness + 1
        self.versions = {0: {n: t.clone() for n, t in self.params.items()}}
        self._open(1, now, now + timedelta(seconds=cfg.rounds.timeout_s))

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """θ of the latest version: what a lease downloads."""
        return self.files.theta

    def params_of(self, version: int) -> dict[str, torch.Tensor]:
        """θ of ``version``: what a lease on round ``version + 1`` trained from."""
        return self.versions[version]

    def _open(self, index: int, opened_at: datetime, deadline: datetime) -> None:
        self.rounds[index] = RoundView(index, opened_at, deadline, RoundState.OPEN)
        self.logs[index] = RoundLog(RoundDesk(self.cfg, self.rounds[index], self.standings))
        self.current = index

    def _current_view(self) -> RoundView | None:
        return None if self.current is None else self.rounds[self.current]

    # ------------------------------------------------------------ leases

    def join(
        self, now: datetime, who: str, tokens_per_s: float | None = None
    ) -> tuple[HubLease, bool] | Refusal:
        """A lease on the open round (and whether it is new), or the rule's refusal; a new
        lease's H is sized to ``tokens_per_s``, the speed the volunteer reports."""
        rnd = self._current_view()
        log = None if rnd is None else self.logs[rnd.index]
        held = None if log is None else log.leases.get(who)
        facts = JoinFacts(
            run_status=self.status,
            round=rnd,
            contributed=log is not None and log.contribution_of(who) is not None,
            lease=None if held is None else held.view(),
        )
        grant = admit_join(now, facts, self.leasing)
        if isinstance(grant, Refusal):
            return grant
        assert rnd is not None and log is not None  # a grant names the open round
        if not grant.new_lease:
            assert held is not None
            held.last_heartbeat, held.expires_at = now, grant.expires_at
            return held, False
        # the round's lease counter is the ordinal that picks shard and seed
        ordinal = len(log.leases)
        assignment = assign_lease(
            ordinal, round=rnd.index, run_seed=self.run_seed, n_shards=self.leasing.n_shards
        )
        sized = size_lease(
            now,
            rnd.deadline,
            StepBounds.of(self.cfg.inner),
            tokens_per_step=self.cfg.tokens_per_step,
            reported=tokens_per_s,
        )
        lease = HubLease(
            who,
            rnd.index,
            assignment.shard,
            assignment.seed,
            now,
            grant.expires_at,
            sized.steps,
            None if self.units is None else self.units.pick(),
        )
        log.leases[who] = lease
        if self.ledger is not None:  # it downloads θ: the deltas since the version it holds
            self.ledger.fetch(who, self.version)
        return lease, True

    def heartbeat(self, now: datetime, who: str, index: int) -> HeartbeatGrant | Refusal:
        log = self.logs.get(index)
        facts = HeartbeatFacts(
            run_status=self.status,
            round=self.rounds.get(index),
            current_round=self.current,
            lease_held=log is not None and who in log.leases,
        )
        grant = admit_heartbeat(now, facts, ttl_s=self.cfg.rounds.lease_ttl_s)
        if isinstance(grant, HeartbeatGrant):
            assert log is not None
            lease = log.leases[who]
            lease.last_heartbeat, lease.expires_at = now, grant.expires_at
        return grant

    # ------------------------------------------------------------ uploads

    def admit_upload(self, who: str, index: int, claim: UploadClaim) -> Refusal | LateGrant | None:
        """``admit_upload`` before the body, then ``admit_claim`` on its header; None: the
        upload is welcome and ``store`` may record it; a ``LateGrant``: welcome late,
        merged into the open round."""
        rnd, log = self.rounds.get(index), self.logs.get(index)
        existing = None if log is None else log.contribution_of(who)
        current = self._current_view()
        facts = UploadFacts(
            run_status=self.status,
            round=rnd,
            current_round=self.current,
            existing_sha256=None if existing is None else existing.contribution_id,
            lease_held=log is not None and who in log.leases,
            current_open=current is not None and current.state is RoundState.OPEN,
            max_staleness=self.cfg.rounds.max_staleness,
        )
        verdict = admit_upload(facts)
        if isinstance(verdict, Refusal):
            return verdict
        if verdict is UploadVerdict.RETRY:  # simulated volunteers upload once per lease
            raise RuntimeError(f"{who} uploaded twice to round {index}")
        assert rnd is not None
        refusal = admit_claim(claim, run_id=SIM_RUN_ID, round=rnd)
        return refusal or (verdict if isinstance(verdict, LateGrant) else None)

    def store(
        self,
        who: str,
        index: int,
        upload: Upload,
        compute: timedelta,
        late: LateGrant | None = None,
        *,
        own: Windows | None = None,
    ) -> Refusal | None:
        """The body, checked as the server checks it (finite once decoded, not a replay),
        then stored; or the refusal. Late work (``late``) is checked against its own round
        and joins the open round's step with its discounted weight; either is weighed by
        its own lease's H."""
        inner_steps = self.logs[index].leases[who].inner_steps
        if late is None:
            log = self.logs[index]
            cid = f"con_{index}_{len(log.contributions) + 1}"
            admitted = log.desk.admit(cid, who, upload.chunks, inner_steps, own=own)
        else:
            log = self.logs[late.merged_into]
            cid = f"con_{index}_late_{len(log.late) + 1}"
            admitted = log.desk.admit(
                cid,
                who,
                upload.chunks,
                inner_steps,
                origin=self.rounds[index],
                staleness=late.staleness,
            )
        if isinstance(admitted, Refusal):
            return admitted
        unit = self.logs[index].leases[who].unit
        if self.units is not None and unit is not None:  # its unit is covered
            self.units.trained(unit)
        (log.contributions if late is None else log.late).append(Stored(cid, who, upload, compute))
        return None

    # ------------------------------------------------------------ the sweeper

    def decide(self, now: datetime) -> Decision | None:
        """``decide_close`` on the open round, persisted as the sweeper does; None when no
        round is open (being closed, or the run is over)."""
        rnd = self._current_view()
        if rnd is None or rnd.state is not RoundState.OPEN or self.status is not RunStatus.ACTIVE:
            return None
        log = self.logs[rnd.index]
        contributions = [
            ContributionView(c.contributor, True, c.upload.result.tokens, rnd.base_version)
            for c in log.contributions
        ]
        leases = [lease.view() for lease in log.leases.values()]
        decision = decide_close(now, rnd, contributions, leases, self.closing)
        if decision.action is Action.CLOSE:
            self.rounds[rnd.index] = dataclasses.replace(rnd, state=RoundState.CLOSING)
            log.close_code, log.close_reason = decision.code, decision.reason
        elif decision.action is Action.EXTEND:
            assert decision.new_deadline is not None
            self.rounds[rnd.index] = dataclasses.replace(
                rnd, deadline=decision.new_deadline, extensions=rnd.extensions + 1
            )
            log.extension_reasons.append(decision.reason)
        return decision

    def accepted(self) -> int:
        """Contributions to the round in progress so far."""
        return 0 if self.current is None else len(self.logs[self.current].contributions)

    # ------------------------------------------------------------ closing

    def stalled(self, around: list[str]) -> str | None:
        """Why the open round can never close: too few of the volunteers still ``around``
        (online, or coming back) have not contributed to it to reach its quorum."""
        index = self.current
        if index is None:
            return None
        log = self.logs[index]
        possible = sum(1 for who in around if log.contribution_of(who) is None)
        accepted, quorum = len(log.contributions), self.closing.quorum
        if accepted + possible >= quorum:
            return None
        return (
            f"stalled: round {index} has {accepted} of quorum {quorum} accepted and "
            f"only {possible} volunteer(s) left who could still contribute"
        )

    def close(self, now: datetime) -> Closed:
        """Aggregate, step and publish the closing round; open the next one, if any."""
        assert self.current is not None
        rnd, log = self.rounds[self.current], self.logs[self.current]
        assert rnd.state is RoundState.CLOSING
        stepped = log.desk.close(
            self.files,
            evaluate=self.evaluate,
            history=self.history,
            quorum=self.cfg.rounds.quorum,
            score_sample=self.score_sample,
        )
        # a rejected step publishes nothing new: the version is unchanged, nobody is credited
        in_step = stepped.shares
        norms = [share.norm for share in in_step.values()]
        self.history = [*self.history, *norms][-self.cfg.aggregation.history :]
        assert self.files.version == rnd.index
        load_parameters(self.model, self.params)
        self.version = rnd.index
        self.versions[self.version] = {n: t.clone() for n, t in self.params.items()}
        for old in [v for v in self.versions if v < self.version - self.cfg.rounds.max_staleness]:
            del self.versions[old]
        by_id = {a.source.id: a for a in log.desk.admitted}
        aggregated = [
            Aggregated(cid, a.contributor, a.tokens, a.loss, a.standing)
            for cid, a in ((cid, by_id[cid]) for cid in in_step)
        ]
        effects = close_effects(
            now,
            round=rnd.index,
            run_status=self.status,
            aggregated=aggregated,
            n_params=self.n_params,
            max_rounds=self.cfg.rounds.max_rounds,
            timeout_s=self.cfg.rounds.timeout_s,
        )
        closed = dataclasses.replace(rnd, state=RoundState.CLOSED)
        self.rounds[rnd.index] = closed
        self.status = effects.run_status
        self.current = None
        if effects.next_round is not None:
            following = effects.next_round
            self._open(following.index, following.opened_at, following.deadline)
        return Closed(closed, log, effects, stepped.update_norm or 0.0)

    def delta_report(self) -> tuple[DeltaReport, dict[str, torch.Tensor]]:
        """What delta downloads cost, and x = θ + r (the exact outer iterate), at the end."""
        assert self.ledger is not None
        files = self.files
        last = files.sizes.get(files.version, 0)
        report = DeltaReport(self.checkpoint_bytes, last, residual_norms=list(files.residual_norms))
        return report, files.exact()
