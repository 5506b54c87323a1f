"""The server's side of a round, in the simulator: what ``server.rounds.ingest`` and
``server.rounds.outer_step`` do, on uploads held in memory.

- ``RoundDesk.admit``: an upload as the server takes it: the body decoded and checked
  (``diloco.wire.contribution``), every tensor decoded to finite values and measured
  (``diloco.outer.inspection.UploadInspector``), its header against the round (``admit_claim``),
  a replay of another's tensors refused (``admit_payload``), its weight capped at what
  a lease allows (``upload_weight``) and, for late work merged into this round from an
  earlier one (``origin``), discounted by its staleness (``late_weight``).
- ``RoundDesk.close``: the server's close itself (``diloco.outer.close.close_round``: the
  robust aggregate, the outer step, the int8 delta with error feedback, every step judged
  before it is published), on the admitted bodies written to files beside the run's
  versions (``diloco.simulate.versions``).

Both modes of ``diloco simulate`` that train through the wire format use it, so an attack
in the simulator meets the defences it meets on a server: the same checks at upload and
the same close. What differs is where the files live and the judging sample: the first
``[aggregation] judge_windows`` windows of the simulator's validation data.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime

from diloco.config import RunConfig
from diloco.model.architectures import parameter_shapes
from diloco.outer.checks import Check
from diloco.outer.close import CloseInputs, Evaluate, Upload, close_round, folding
from diloco.outer.inspection import UploadInspector
from diloco.outer.robust import Share, Source
from diloco.outer.scoring import Windows
from diloco.protocol.audit import audit_share, drawn
from diloco.protocol.late import late_weight
from diloco.protocol.messages import ErrorCode
from diloco.protocol.reputation import VERIFY_CODES, counted_weight, standing
from diloco.protocol.rules import admit_claim, admit_payload, upload_weight
from diloco.protocol.state import Refusal, RoundState, RoundView, StepVerdict, UploadClaim
from diloco.simulate.versions import Versions
from diloco.wire.contribution import ContributionDecoder, NonFiniteWireError, WireFormatError
from diloco.wire.exchange import codec_for

SIM_RUN_ID = "simulate"  # the run id in every simulated upload's header
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Admitted:
    source: Source
    contributor: str
    loss: float  # the contributor's mean inner loss, as its header says
    tokens: int  # its weight discounted by its staleness: what the round counts for it
    staleness: int = 0  # late work: versions published since its base (0: fresh)
    own: Windows | None = None  # its lease's scored windows (lease_picks; None: unscored)
    standing: float = 1.0  # its contributor's: the share of ``tokens`` step and credit take


@dataclass
class Standings:
    """Each contributor's record as the server counts it for its standing
    (``diloco.protocol.reputation``): contributions a step took, and those verification
    left out. Shared by a run's desks: each close adds to it."""

    verified: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)

    def of(self, contributor: str) -> float:
        return standing(self.verified.get(contributor, 0), self.failed.get(contributor, 0))

    def record(self, admitted: list[Admitted], stepped: Stepped) -> None:
        for a in admitted:
            check = stepped.checks.get(a.source.id)
            if a.source.id in stepped.shares:
                self.verified[a.contributor] = self.verified.get(a.contributor, 0) + 1
            elif check is not None and check.code in VERIFY_CODES:
                self.failed[a.contributor] = self.failed.get(a.contributor, 0) + 1


@dataclass
class RoundDesk:
    """One round's uploads, admitted one by one, then closed; ``standings``: the run's
    (each upload weighs by its contributor's, the close records its outcome there)."""

    cfg: RunConfig
    round: RoundView
    standings: Standings = field(default_factory=Standings)
    admitted: list[Admitted] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)  # by error code
    _payloads: set[str] = field(default_factory=set)

    def admit(
        self,
        source_id: str,
        contributor: str,
        chunks: list[bytes],
        inner_steps: int | None = None,
        *,
        origin: RoundView | None = None,
        staleness: int = 0,
        own: Windows | None = None,
    ) -> Admitted | Refusal:
        """An upload for a lease of ``inner_steps`` (None: the run's steps), checked and
        weighed as the server does, or refused. ``origin``: the round a late upload was
        trained for (its header is checked against that round), merged into this one
        ``staleness`` versions on. ``own``: the windows of its lease's data the close's
        scoring reads (``diloco.outer.scoring``)."""
        shapes, codec = _model(self.cfg)
        decoder = ContributionDecoder(shapes, codec=codec)
        inspector = UploadInspector(codec)
        try:
            for chunk in chunks:
                for name, encoded in decoder.feed(chunk):
                    inspector.add(name, encoded)
            decoder.finish()
        except NonFiniteWireError as err:
            return self._refuse(Refusal(ErrorCode.NON_FINITE, str(err)))
        except WireFormatError as err:
            return self._refuse(Refusal(ErrorCode.MALFORMED_UPLOAD, str(err)))
        assert decoder.header is not None
        meta = decoder.header.meta
        claim = UploadClaim(
            SIM_RUN_ID, meta.round, meta.base_version, meta.tokens, meta.inner_steps
        )
        refusal = admit_claim(claim, run_id=SIM_RUN_ID, round=origin or self.round)
        refusal = refusal or admit_payload(inspector.payload_sha256 in self._payloads)
        if refusal is not None:
            return self._refuse(refusal)
        self._payloads.add(inspector.payload_sha256)
        weight = upload_weight(meta.tokens, self.cfg.lease_tokens_for(inner_steps))
        earned = self.standings.of(contributor)
        counted = counted_weight(weight, staleness, earned)  # in the step and in credit
        source = Source(source_id, float(counted), inspector.norm, lambda: chunks)
        tokens = late_weight(weight, staleness)
        admitted = Admitted(source, contributor, meta.loss, tokens, staleness, own, earned)
        self.admitted.append(admitted)
        return admitted

    def _refuse(self, refusal: Refusal) -> Refusal:
        self.refused[str(refusal.code)] = self.refused.get(str(refusal.code), 0) + 1
        return refusal

    def drawn(self, check_seed: int) -> list[str]:
        """The uploads the round's secret draws for an audit, as the server draws each one
        as it arrives (``server.rounds.audit_draw.draw``: ``audit_share`` of its
        contributor's standing; the simulator replays none of them)."""
        a = self.cfg.audit

        def share(contributor: str) -> float:
            return audit_share(a.fraction, self.standings.of(contributor), newcomers=a.newcomers)

        ups = self.admitted
        return [u.source.id for u in ups if drawn(check_seed, u.contributor, share(u.contributor))]

    def close(
        self,
        versions: Versions,
        *,
        evaluate: Evaluate,
        history: list[float],
        quorum: int = 1,
        score_sample: Windows | None = None,
    ) -> Stepped:
        """The server's close on the admitted uploads, from ``versions``' latest version;
        it publishes this round's version there (an unchanged one when the guard rejects
        every step, or when nothing was admitted). ``evaluate``: a version's loss on the
        judging sample (``diloco.outer.close.Evaluate``); ``score_sample``: the windows
        every scored upload is also measured on (None: no scoring)."""
        index = self.round.index
        if not self.admitted:
            versions.unchanged(index)
            return Stepped({}, None, None, {}, {})
        folder = versions.root / f"uploads-{index}"
        folder.mkdir(exist_ok=True)
        uploads: list[Upload] = []
        for a in self.admitted:
            path = folder / f"{len(uploads)}.upload"
            with open(path, "wb") as f:
                for chunk in a.source.chunks():
                    f.write(chunk)
            uploads.append(Upload(a.source.id, path, a.source.weight, a.source.norm, a.own))
        inputs = CloseInputs(
            run_id=SIM_RUN_ID,
            version=index,
            cfg=self.cfg,
            base_params=versions.latest.params,
            base_state=versions.latest.state,
            uploads=uploads,
            history=list(history),
            quorum=quorum,
            out=versions.paths(index),
            check_seed=versions.check_seed(index),
            recent=list(versions.recent),
            score_sample=score_sample,
            fold=folding(self.cfg, history),
        )
        try:
            closed = close_round(inputs, evaluate=evaluate, base_judge_loss=versions.judge_loss)
            if closed.pending is not None:  # the server writes them after publishing
                closed.pending.write().commit_rest()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if closed.base_judge_loss is not None:
            versions.judge_loss = closed.base_judge_loss
        left_out = {  # by the guard or the checks (diloco.outer.checks)
            i: why
            for i, why in closed.excluded.items()
            if closed.exclusion_codes[i] != "blob_unreadable"
        }
        if not closed.committed:  # the server reopens the round; the simulator moves on
            versions.unchanged(index)
            stepped = Stepped({}, None, None, left_out, closed.checks, rejected=closed.verdict)
        else:
            versions.published(index, closed.judge_loss, closed.change_sample)
            stepped = Stepped(
                closed.shares, closed.update_norm, closed.judge_loss, left_out, closed.checks
            )
        self.standings.record(self.admitted, stepped)
        return stepped


@dataclass
class Stepped:
    """What a simulated close did: the step published (its contributions' shares), or
    none (``rejected``: the guard's last verdict)."""

    shares: dict[str, Share]  # by upload id: what each aggregated contribution put in
    update_norm: float | None  # ‖θ_new − θ_base‖ (None: no step)
    judge_loss: float | None  # the step's loss on the judging sample
    left_out: dict[str, str]  # upload id -> why the guard or the checks left it out
    checks: dict[str, Check]  # every upload's (diloco.outer.checks)
    rejected: StepVerdict | None = None


def open_round(cfg: RunConfig, index: int, standings: Standings) -> RoundDesk:
    """A desk for round ``index`` of diloco mode (which has no clock: the times are moot)."""
    return RoundDesk(cfg, RoundView(index, EPOCH, EPOCH, RoundState.OPEN), standings)


def _model(cfg: RunConfig) -> tuple[dict[str, tuple[int, ...]], dict]:
    shapes = parameter_shapes(cfg.model)
    return shapes, codec_for(cfg.compression).describe()
