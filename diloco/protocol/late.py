"""Late contributions: work whose round closed while it was being trained or uploaded.

Round i trains from version i − 1. When round r closes, a volunteer still training from
version r − 1 is not wasted: its upload, sent to round r's URL as any other, is merged
into the round open now, c, with its **staleness** s = c − r (the versions published
since its base), as long as 1 ≤ s ≤ ``[rounds] max_staleness``. Beyond that it is refused
with ``round_closed`` and the current round, as any upload to a closed round was before.

Its weight in the step (and so its credit) is discounted:

    weight = ⌈w / (1 + s)⌉        w = upload_weight(claimed tokens, lease tokens)

the polynomial staleness function of FedAsync (Xie et al., 2019, a = 1) and the
staleness-aware learning rate of Zhang et al. (2016): a Δ computed from version c − 1 − s
points where the model was s outer steps ago, so it counts for less the older it is, and
a fresh contribution (s = 0) keeps its whole weight. The ceiling keeps weights whole
tokens, at least 1, and exact when 1 + s divides w.

The upload keeps its own round (its row's ``round_index``, its lease, its header's round
and base version are r's), and records the round it was merged into; round c's outer step
takes c's own contributions and the late ones merged into it. Late work never counts
towards c's quorum or target: a round closes on fresh work.

Pure functions; the server (``server.rounds.ingest``) and the simulator
(``diloco.simulate.hub``) call them. The volunteer's side (finish work whose round closed
while it is still welcome: ``welcome_late``) is in ``diloco.protocol.volunteer``.
"""

from __future__ import annotations

from diloco.protocol.messages import ErrorCode
from diloco.protocol.state import LateGrant, Refusal, RoundState, RoundView, UploadFacts


def staleness_discount(staleness: int) -> float:
    """What a contribution ``staleness`` versions old counts for, per token: 1 / (1 + s)."""
    if staleness < 0:
        raise ValueError(f"staleness: must be at least 0, got {staleness}")
    return 1.0 / (1 + staleness)


def late_weight(weight: int, staleness: int) -> int:
    """The weight a contribution counts for in its step and in credit: ⌈w / (1 + s)⌉
    (``weight`` itself when fresh). Integer arithmetic: exact for any size of ``weight``."""
    if staleness < 0:
        raise ValueError(f"staleness: must be at least 0, got {staleness}")
    if weight <= 0:
        return max(0, weight)
    return -(-weight // (1 + staleness))


def round_closed(index: int, state: RoundState, current: int | None) -> Refusal:
    """The refusal of an upload or heartbeat for a round that is no longer open."""
    return Refusal(
        ErrorCode.ROUND_CLOSED,
        f"round {index} is {state}; the current round is {current}: join again",
        {"current_round": current},
    )


def admit_late(facts: UploadFacts, rnd: RoundView) -> LateGrant | Refusal:
    """An upload to round ``rnd``, which is not open, from a contributor with no
    contribution there yet, to an active run: merged late, or refused; the first matching
    rule wins.

    1. The run takes no late work (``max_staleness`` 0), or the round is still closing: it
       is ``round_closed`` (a closing round's late work is welcome once it has closed and
       the next round is open: send again shortly).
    2. No round is open right now (the run ended, or the round in progress is closing):
       ``round_closed`` with the current round.
    3. Staleness past ``max_staleness``: ``round_closed``, the current round named.
    4. Only the holder of a lease on the round may send work for it: ``no_lease``.
    5. Otherwise: merged into the open round with its staleness.
    """
    current = facts.current_round
    if facts.max_staleness < 1 or rnd.state is not RoundState.CLOSED:
        refusal = round_closed(rnd.index, rnd.state, current)
        if facts.max_staleness < 1:
            return refusal
        return Refusal(
            refusal.code,
            f"round {rnd.index} is {rnd.state}; its late work is merged into the next round "
            "once it opens: send it again shortly",
            refusal.extra,
        )
    if current is None or not facts.current_open:
        which = (
            "the run has no round in progress"
            if current is None
            else (f"round {current} is closing")
        )
        return Refusal(
            ErrorCode.ROUND_CLOSED,
            f"round {rnd.index} is closed and {which}: late work joins an open round only; "
            "send it again shortly",
            {"current_round": current},
        )
    staleness = current - rnd.index
    if staleness > facts.max_staleness:
        return Refusal(
            ErrorCode.ROUND_CLOSED,
            f"round {rnd.index} is closed and its work is {staleness} versions old, past this "
            f"run's max_staleness of {facts.max_staleness}; the current round is {current}: "
            "join again",
            {"current_round": current},
        )
    if not facts.lease_held:
        return Refusal(
            ErrorCode.NO_LEASE,
            f"you held no lease on round {rnd.index}: late work is merged only from the "
            "holder of a lease on its round",
        )
    return LateGrant(merged_into=current, staleness=staleness)
