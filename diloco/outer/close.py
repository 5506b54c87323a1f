"""A round's close: robust aggregate, outer step, compressed delta, judged before it is published.

The one implementation of the close. The server (``server.rounds.outer_step``) calls
``close_round`` on the files it staged and publishes what it commits; ``diloco simulate``
calls it on files it wrote with the real wire encoder in a temp dir of its own
(``diloco.simulate.server``). Only where the files live and how the judge evaluates
differ.

- The contributions are read back from their files, chunk by chunk (``diloco.outer.chunked``),
  and combined as the run's ``[aggregation]`` says (``diloco.outer.robust``: clipped to a
  multiple of the round's median norm by default), each weighted by the tokens it counts
  for. ``mean`` and ``clipped_mean`` take one pass that sums, steps and writes the new
  version; ``centered_clip`` needs the clipped mean first (one more pass, and the model's
  size in memory for it).
- The version's files: parameters, outer state (momentum and delta residual), and the
  delta from the base version in the run's download codec (``diloco.wire.delta``): the
  published parameters are the base's plus the decoded delta, and what the compression
  left out is carried in the residual. Memory stays a few chunks a contribution: nothing
  of the model's size is held but by ``centered_clip``. The close's pass writes the delta
  alone and takes the parameters' sha256 without writing them: the parameters and the
  outer state are written by a second pass over the same inputs, off the critical path
  (``diloco.outer.rebuild.Rest``), checked against the first.
- Every step is judged before anything is published (``diloco.protocol.rules``:
  ``should_judge`` then ``judge_step``): one that is not finite, or whose loss on the
  run's small fixed judging sample (``[aggregation] judge_windows``; the step measured as
  the base's parameters plus the decoded delta, as a returning volunteer applies it) passes
  ``max_loss_ratio`` times the base version's, is discarded and the contribution farthest
  from the aggregate left out for good; the step is tried again without it while the
  others make quorum, else the round is reopened to wait for more (``decide_after_guard``):
  a close never tries the same failing step twice, and ends within as many tries as it has
  uploads. The full eval of a published version is the caller's, later.
- A contribution whose file cannot be read (missing, damaged: its trailer digest fails)
  is left out with the reason and the pass started over without it;
  ``decide_after_exclusions`` then says whether the others still make a step.

Given the same inputs it writes the same bytes, so a close that a crash interrupts is
simply done again, and a version whose parameters and outer state were lost before they
were committed is rebuilt by running its last try again (``diloco.outer.rebuild``). The
close commits the delta (what a returning volunteer needs) and hands back what writes the
parameters and the outer state (``Closed.pending``): the caller runs it and commits them
off its critical path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from diloco.outer.attempt import (
    Base,
    CloseInputs,
    Folding,
    StageClock,
    Tried,
    Upload,
    VersionPaths,
    folding,
    open_base,
    try_step,
)
from diloco.outer.checks import Check, check_uploads
from diloco.outer.rebuild import Rest
from diloco.outer.robust import Share, SourceUnreadable
from diloco.outer.scoring import Score, Scorer, chosen
from diloco.protocol.outcome import (
    decide_after_exclusions,
    decide_after_guard,
    judge_step,
    should_judge,
)
from diloco.protocol.state import Action, Decision, StepVerdict

log = logging.getLogger("diloco.rounds")

__all__ = [
    "CloseInputs", "Closed", "Evaluate", "Folding", "Rest", "Upload", "VersionPaths", "close_round",
    "folding",
]  # fmt: skip

# a version's loss on the run's judging sample: the parameters file, stepped by the delta
# file when one is given (θ + decode(q), as a returning volunteer applies it)
Evaluate = Callable[[Path, Path | None], float]


@dataclass(frozen=True)
class Closed:
    excluded: dict[str, str]  # upload id -> why it was left out (unreadable, guard)
    exclusion_codes: dict[str, str]  # upload id -> blob_unreadable | guard
    # decide_after_exclusions' verdict when a blob was unreadable (None: none was), or
    # decide_after_guard's when the guard left too few for a step
    decision: Decision | None
    committed: bool  # False: no step (below quorum once the unreadable or blamed left out)
    params_sha256: str | None  # the new version's files, when committed
    delta_sha256: str | None
    update_norm: float | None  # ‖θ_new − θ_base‖, the published change
    judge_loss: float | None  # the published step's loss on the judging sample (None: unjudged)
    base_judge_loss: float | None  # the base's, measured here (None: given, or not needed)
    verdict: StepVerdict | None  # the guard's word on the published step
    shares: dict[str, Share]  # what each aggregated contribution put in
    # by stage: load, pass (and its parts pass_read, pass_sum, pass_step, pass_write),
    # judge, write (the delta's fsync and rename); tries added up
    seconds: dict[str, float]
    checks: dict[str, Check]  # every upload's, from the last try that had it in its pass
    # the published change θ_new − θ_base where the round sampled (check_seed), for the next
    # rounds' copy check; None when not committed
    change_sample: torch.Tensor | None
    folded: int = 0  # of the published step's uploads, those summed on arrival
    # when committed: the delta is committed (fsync, rename); the parameters and the outer
    # state are the caller's to write and commit, off its critical path (``Rest.write``,
    # then ``Outputs.commit_rest``)
    pending: Rest | None = None


def close_round(
    inputs: CloseInputs,
    *,
    evaluate: Evaluate,
    base_judge_loss: float | None = None,
    hit: Callable[[str], None] = lambda point: None,
) -> Closed:
    """Aggregate, step under the guard and commit ``inputs.out`` (module docstring).
    ``evaluate``: a version's loss on the run's judging sample (the same tokens every
    call; ``Evaluate``); ``base_judge_loss``: the base version's, when the caller knows it;
    ``hit``: the close's fault points (``close.aggregate``, ``close.step``,
    ``close.eval``). Not committed, with a decision to reopen, when too few are left."""
    clock = StageClock()
    base = open_base(inputs)
    try:
        clock.lap("load")
        return _close(inputs, base, clock, evaluate, base_judge_loss, hit)
    finally:
        base.close()


def _close(
    inputs: CloseInputs,
    base: Base,
    clock: StageClock,
    evaluate: Evaluate,
    base_loss: float | None,
    hit: Callable[[str], None],
) -> Closed:
    out = _LeftOut()
    decision, measured_base = None, None
    policy = inputs.cfg.aggregation
    scoring = _Scoring.of(inputs)
    while True:
        kept = [u for u in inputs.uploads if u.id not in out.reasons]
        if out.unreadable:
            decision = decide_after_exclusions(
                inputs.version,
                kept=len(kept) + len(out.reasons) - len(out.unreadable),
                excluded=out.unreadable,
                quorum=inputs.quorum,
            )
            if decision.action is not Action.CLOSE:
                return out.not_committed(decision, None, measured_base, None, clock)
        try:
            tried = try_step(inputs, base, kept, clock, full=False)
        except SourceUnreadable as err:
            out.leave(err.source_id, "blob_unreadable", err.reason)
            log.warning("run %s round %d: %s", inputs.run_id, inputs.version, err)
            continue
        hit("close.aggregate")
        hit("close.step")
        if failed := _vet(inputs, kept, tried, out, scoring, clock):
            tried.out.abort()
            for i, (code, reason) in failed.items():
                out.leave(i, code, reason)
            why = "; ".join(f"{i}: {reason}" for i, (_, reason) in failed.items())
            log.warning("run %s round %d: left out %s", inputs.run_id, inputs.version, why)
            if len(kept) - len(failed) < inputs.quorum:
                decision = out.below_quorum(inputs, len(kept) - len(failed))
                return out.not_committed(decision, None, measured_base, None, clock)
            continue
        result, loss = tried.result, None
        if should_judge(finite=result.finite, judge_windows=policy.judge_windows):
            if base_loss is None:
                measured_base = base_loss = evaluate(inputs.base_params, None)
            loss = evaluate(inputs.base_params, tried.out.delta.temp_path)
            clock.lap("judge")
        verdict = (
            judge_step(base_loss, loss, finite=result.finite, max_loss_ratio=policy.max_loss_ratio)
            if loss is not None or not result.finite
            else StepVerdict(True, "ok", "published unjudged; eval loss pending")
        )
        hit("close.eval")
        if verdict.ok:
            break
        tried.out.abort()
        culprit = max(kept, key=lambda u: _farthest_first(tried.shares[u.id].distance))
        out.leave(culprit.id, "guard", f"the step with it was discarded ({verdict.reason})")
        if len(kept) - 1 < inputs.quorum:  # reopened, never the same step again
            decision = out.below_quorum(inputs, len(kept) - 1)
            return out.not_committed(decision, loss, measured_base, verdict, clock)
        log.warning(
            "run %s round %d: %s; trying again without %s",
            inputs.run_id, inputs.version, verdict.reason, culprit.id,
        )  # fmt: skip
    return out.committed(inputs, kept, tried, decision, (loss, measured_base, verdict), clock)


@dataclass
class _LeftOut:
    """The uploads a close left out, why (``reasons``) and under which code: blob_unreadable,
    guard, or a check's (``diloco.outer.checks``); and every upload's latest checks."""

    reasons: dict[str, str] = field(default_factory=dict)
    codes: dict[str, str] = field(default_factory=dict)
    checks: dict[str, Check] = field(default_factory=dict)
    scores: dict[str, Score] = field(default_factory=dict)  # diloco.outer.scoring

    @property
    def unreadable(self) -> dict[str, str]:
        return {i: r for i, r in self.reasons.items() if self.codes[i] == "blob_unreadable"}

    def leave(self, upload_id: str, code: str, reason: str) -> None:
        self.reasons[upload_id] = reason
        self.codes[upload_id] = code

    def below_quorum(self, inputs: CloseInputs, kept: int) -> Decision:
        judged = {i: r for i, r in self.reasons.items() if self.codes[i] != "blob_unreadable"}
        return decide_after_guard(inputs.version, kept=kept, left_out=judged, quorum=inputs.quorum)

    def not_committed(
        self,
        decision: Decision,
        loss: float | None,
        measured_base: float | None,
        verdict: StepVerdict | None,
        clock: StageClock,
    ) -> Closed:
        return Closed(
            dict(self.reasons), dict(self.codes), decision, False, None, None, None, loss,
            measured_base, verdict, {}, clock.seconds, self.final_checks(), None,
        )  # fmt: skip

    def committed(
        self,
        inputs: CloseInputs,
        kept: list[Upload],
        tried: Tried,
        decision: Decision | None,
        judged: tuple[float | None, float | None, StepVerdict],
        clock: StageClock,
    ) -> Closed:
        """Commit the try's delta first (what returning volunteers need); the parameters and
        the outer state are the caller's to write (``Rest``). ``judged``: the step's judging
        loss, the base's when measured here, and the guard's verdict."""
        try:
            params_sha, delta_sha = tried.out.commit_delta()
        finally:
            tried.out.abort()  # what was not committed: the parameters were only digested
        clock.lap("write")
        sizes = tried.out.params.nbytes, tried.out.delta.nbytes
        loss, measured_base, verdict = judged
        return Closed(
            dict(self.reasons), dict(self.codes), decision, True, params_sha, delta_sha,
            math.sqrt(tried.result.change_sq), loss, measured_base, verdict, tried.shares,
            clock.seconds, self.final_checks(), tried.change_sample, tried.folded,
            Rest(inputs, kept, params_sha, delta_sha, *sizes),
        )  # fmt: skip

    def final_checks(self) -> dict[str, Check]:
        """Each upload's latest checks, with its score where it was scored."""
        out = dict(self.checks)
        for i, score in self.scores.items():
            check = replace(
                out[i],
                own_gain=score.own_gain,
                other_gain=score.other_gain,
                own_alignment=score.own_alignment,
            )
            if score.failed:
                check = replace(check, code="no_gain", reason=score.reason())
            out[i] = check
        return out


@dataclass
class _Scoring:
    """Which uploads the close scores by the loss, and the scorer, loaded when first needed."""

    chosen: set[str]
    scorer: Scorer | None = None

    @classmethod
    def of(cls, inputs: CloseInputs) -> _Scoring | None:
        if inputs.score_sample is None or inputs.cfg.aggregation.score_windows == 0:
            return None
        # scored on arrival, or with its lease's windows to score it by now
        with_data = [u.id for u in inputs.uploads if u.own is not None or u.score is not None]
        scored = {u.id for u in inputs.uploads if u.score is not None}
        return cls(chosen(with_data, inputs.check_seed) | scored)

    def score(self, inputs: CloseInputs, upload: Upload) -> Score:
        if upload.score is not None:  # taken on arrival
            return upload.score
        if self.scorer is None:
            assert inputs.score_sample is not None
            self.scorer = Scorer(inputs.cfg, inputs.base_params, inputs.score_sample)
        assert upload.own is not None
        return self.scorer.score(upload.path, upload.own)


def _vet(
    inputs: CloseInputs,
    kept: list[Upload],
    tried: Tried,
    out: _LeftOut,
    scoring: _Scoring | None,
    clock: StageClock,
) -> dict[str, tuple[str, str]]:
    """The uploads this try must leave out, with their code and reason: the cheap checks'
    failures (``diloco.outer.checks``); when there are none, the scored uploads whose own
    data's loss they do not lower (``diloco.outer.scoring``; each upload scored once)."""
    checks = check_uploads(tried.figures)
    out.checks |= checks
    clock.lap("checks")
    if failed := {i: (str(c.code), c.reason) for i, c in checks.items() if c.code is not None}:
        return failed
    if scoring is None:
        return {}
    for u in kept:
        if u.id in scoring.chosen and u.id not in out.scores:
            out.scores[u.id] = scoring.score(inputs, u)
    clock.lap("score")
    return {
        u.id: ("no_gain", out.scores[u.id].reason())
        for u in kept
        if u.id in out.scores and out.scores[u.id].failed
    }


def _farthest_first(distance: float) -> float:
    """The guard blames the contribution farthest from the aggregate; a distance that is
    not a number (a non-finite step) counts as the farthest."""
    return distance if not math.isnan(distance) else math.inf
