"""What a closing round decides and what its close changes: the rules after ``decide_close``
(``diloco.protocol.rules`` 1-4), pure functions of their inputs as those are.

5. ``decide_after_exclusions``: a closing round some of whose contributions could not be
   read closes on the others if they still make quorum, else it reopens.
6. ``should_judge`` then ``judge_step``: the guard, commit or discard: every step is
   evaluated on a small fixed sample before it is published, and one that is not finite
   or raises that loss too far is never published; ``decide_after_guard`` when the one it
   blamed leaves too few.
7. ``close_effects``: what a close changes besides the checkpoint (counts, loss, credit,
   the run's completion, the next round); ``close_retry_at`` when a failed close is tried
   again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from diloco.protocol.state import (
    Action,
    Aggregated,
    CloseEffects,
    Decision,
    NextRound,
    RetryPolicy,
    RunStatus,
    StepVerdict,
    require_aware,
)

# Training a transformer costs about 6 FLOPs per parameter per token (forward 2, backward 4)
TRAIN_FLOPS_PER_PARAM_TOKEN = 6


def decide_after_exclusions(
    round: int, *, kept: int, excluded: Mapping[str, str], quorum: int
) -> Decision:
    """A round decided to close, but some contributions' stored blobs could not be read
    (``excluded``: contribution id → why). It closes on the ``kept`` others while they make
    quorum; below quorum it reopens, to wait for more."""
    names = ", ".join(f"{cid} ({why})" for cid, why in sorted(excluded.items()))
    left_out = f"{len(excluded)} contribution{'' if len(excluded) == 1 else 's'} left out: {names}"
    if kept >= quorum:
        reason = f"round {round}: {left_out}; closing with the {kept} others (quorum {quorum})"
        return Decision(action=Action.CLOSE, reason=reason, code="excluded_quorum")
    reason = (
        f"round {round}: {left_out}; {kept} left, below quorum {quorum}: reopened to wait for more"
    )
    return Decision(action=Action.KEEP_OPEN, reason=reason, code="excluded_below_quorum")


def decide_after_guard(
    round: int, *, kept: int, left_out: Mapping[str, str], quorum: int
) -> Decision:
    """The guard discarded a step and, with the contribution it blamed left out for good,
    fewer than ``quorum`` are ``kept``: the round reopens to wait for more (the left-out
    ones never count again), instead of trying the same step again. Each discarded step
    leaves one contribution out, so a close ends within as many tries as it has uploads."""
    names = ", ".join(f"{cid} ({why})" for cid, why in sorted(left_out.items()))
    return Decision(
        action=Action.KEEP_OPEN,
        reason=f"round {round}: left out for good: {names}; {kept} left, below quorum "
        f"{quorum}: reopened to wait for more",
        code="guard_below_quorum",
    )


# ---------------------------------------------------------------- 5b. the guard


def should_judge(*, finite: bool, judge_windows: int) -> bool:
    """Whether a step is evaluated before it is published: every finite one, on the run's
    judging sample of ``judge_windows`` eval windows (``[aggregation] judge_windows``; 0
    turns judging off: steps are published at once and only a non-finite one is caught).
    A step that is not finite is discarded without an eval."""
    return finite and judge_windows > 0


def judge_step(
    base_loss: float | None, new_loss: float | None, *, finite: bool, max_loss_ratio: float
) -> StepVerdict:
    """Commit or discard an outer step (torchft's ``should_commit``). A step whose
    parameters or momentum are not all finite is discarded; so is one whose eval loss is
    more than ``max_loss_ratio`` times the base version's (when that is known)."""
    if not finite or new_loss is None or not math.isfinite(new_loss):
        return StepVerdict(False, "non_finite", "the step's parameters are not all finite")
    if base_loss is not None and math.isfinite(base_loss) and new_loss > base_loss * max_loss_ratio:
        return StepVerdict(
            False,
            "loss_rise",
            f"eval loss would rise from {base_loss:.4f} to {new_loss:.4f}, past "
            f"{max_loss_ratio:g}x the base version's",
        )
    return StepVerdict(True, "ok", f"eval loss {new_loss:.4f}")


# ---------------------------------------------------------------- 5. what a close changes


def step_totals(aggregated: Sequence[Aggregated]) -> tuple[int, float | None]:
    """The tokens a step's contributions count for (their weights, late ones discounted)
    and its train loss: the contributors' mean losses weighted by those tokens (None
    without any). A close records them on the round; an open round shows them so far."""
    tokens = sum(a.tokens for a in aggregated)
    return tokens, sum(a.loss * a.tokens for a in aggregated) / tokens if tokens else None


def close_effects(
    now: datetime,
    *,
    round: int,
    run_status: RunStatus,
    aggregated: Sequence[Aggregated],
    n_params: int,
    max_rounds: int,
    timeout_s: float,
) -> CloseEffects:
    """Counts, loss, credit, the run's status and the next round, for a round whose outer
    step is being published with the contributions ``aggregated``.

    - Credit is the training compute that went into the step: tokens × 6 × n_params FLOPs
      for each aggregated contribution, times its contributor's standing (rounded up in
      tokens: ``reputation.counted_weight``), and nothing for anything else.
    - The train loss is the contributors' mean losses weighted by their tokens.
    - The last round (``max_rounds``) completes an active or paused run. A cancelled run
      stays cancelled (a cancel is never overwritten) and opens no further round.
    - Otherwise round + 1 opens now, with a full ``timeout_s`` (a paused run's round waits;
      resuming gives it a fresh deadline).
    """
    require_aware("now", now)
    tokens, loss = step_totals(aggregated)
    flops_per_token = float(TRAIN_FLOPS_PER_PARAM_TOKEN * n_params)
    credit = {
        a.contribution_id: math.ceil(a.tokens * a.standing) * flops_per_token for a in aggregated
    }
    step = f"round {round} closed with {len(aggregated)} contributions ({tokens:,} tokens)"
    if run_status is RunStatus.CANCELLED:
        summary = f"{step}; the run was cancelled meanwhile, so no round follows"
        return CloseEffects(len(aggregated), tokens, loss, credit, run_status, None, summary)
    if round >= max_rounds:
        summary = f"{step}; that was the last of {max_rounds} rounds: the run is completed"
        return CloseEffects(
            len(aggregated), tokens, loss, credit, RunStatus.COMPLETED, None, summary
        )
    following = NextRound(round + 1, now, now + timedelta(seconds=timeout_s))
    summary = f"{step}; round {round + 1} opens"
    return CloseEffects(len(aggregated), tokens, loss, credit, run_status, following, summary)


def close_retry_at(now: datetime, attempts: int, policy: RetryPolicy) -> datetime:
    """When a round whose close failed ``attempts`` times in a row is tried again."""
    require_aware("now", now)
    if attempts < 1:
        raise ValueError(f"attempts counts from 1, got {attempts}")
    delay = min(policy.max_s, policy.base_s * 2.0 ** min(attempts - 1, 60))
    return now + timedelta(seconds=delay)
