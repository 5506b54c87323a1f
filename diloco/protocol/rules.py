"""The round protocol, in one place: pure functions of (now, state, policy).

A round's life, top to bottom in this file:

1. ``admit_join``: a volunteer asks for work; it gets a lease on the open round (a new one,
   or its old one renewed) or a refusal with a code. ``assign_lease`` says which shard and
   seed a new lease trains on.
2. ``admit_heartbeat``: a lease is kept alive while its holder trains.
3. ``admit_upload`` before the body is read, ``admit_claim`` once its header is, and
   ``admit_retry`` for a second upload of the same contributor: accept, idempotent retry,
   or refuse with a code. An upload to a round that closed may be merged late into the
   open round, discounted by its staleness (``diloco.protocol.late``).
4. ``decide_close``: the sweeper asks about each open round: close, extend or wait.
5-7. What a closing round decides after that (the guard, exclusions) and what its close
   changes (counts, loss, credit, the next round): ``diloco.protocol.outcome``.

Between 3 and 4, ``upload_weight`` and ``admit_payload`` say what an accepted upload is
worth and refuse a replay of someone else's tensors.

No clock, database or network here. The server's services fetch the facts, call a rule
and persist what it returns; ``diloco simulate --mode protocol`` drives the same rules with
a simulated clock. Table tests with a fixed ``now`` pin every rule and its sentence
(torchft's ``quorum_compute`` is the model).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from datetime import datetime, timedelta

from diloco.protocol.late import admit_late, round_closed
from diloco.protocol.messages import ErrorCode
from diloco.protocol.state import (
    Action,
    ClosePolicy,
    ContributionView,
    Decision,
    HeartbeatFacts,
    HeartbeatGrant,
    JoinFacts,
    JoinGrant,
    LateGrant,
    LeaseAssignment,
    LeasePolicy,
    LeaseView,
    Refusal,
    RoundState,
    RoundView,
    RunStatus,
    UploadClaim,
    UploadFacts,
    UploadVerdict,
    require_aware,
)


def _not_active(status: RunStatus, run: str = "the run") -> Refusal:
    advice = {
        RunStatus.PAUSED: "wait for its owner to resume it",
        RunStatus.COMPLETED: "it has finished; join another run",
        RunStatus.CANCELLED: "its owner stopped it; join another run",
    }.get(status, "")
    return Refusal(
        ErrorCode.RUN_NOT_ACTIVE, f"{run} is {status}: {advice}".rstrip(": "), {"status": status}
    )


# ---------------------------------------------------------------- 1. joining


def admit_join(now: datetime, facts: JoinFacts, policy: LeasePolicy) -> JoinGrant | Refusal:
    """A lease on the run's open round, or why not; the first matching rule wins.

    1. Only an active run hands out work (a paused run's volunteers wait, others stop).
    2. No round in progress, or one being closed: join again shortly.
    3. One contribution per contributor per round: wait for the next round.
    4. A contributor that already holds a lease on the round gets it back, renewed, with
       its shard and seed (a restarted volunteer resumes the same work).
    """
    require_aware("now", now)
    if facts.run_status is not RunStatus.ACTIVE:
        return _not_active(facts.run_status)
    rnd = facts.round
    retry = {"retry_after_s": policy.retry_after_s}
    if rnd is None or rnd.state is not RoundState.OPEN:
        which = "no round is open" if rnd is None else f"round {rnd.index} is closing"
        return Refusal(ErrorCode.ROUND_CLOSING, f"{which} right now; join again shortly", retry)
    if facts.contributed:
        return Refusal(
            ErrorCode.ALREADY_CONTRIBUTED,
            f"you already contributed to round {rnd.index}; the next round opens when it closes",
            retry,
        )
    return JoinGrant(
        round=rnd.index,
        base_version=rnd.base_version,
        expires_at=now + timedelta(seconds=policy.ttl_s),
        new_lease=facts.lease is None,
    )


def assign_lease(ordinal: int, *, round: int, run_seed: int, n_shards: int) -> LeaseAssignment:
    """The ``ordinal``-th lease of a round (from 0) trains on shard ``ordinal mod n_shards``
    with a seed derived from (run seed, round, ordinal): a run with a pinned seed hands out
    the same (shard, seed) pairs in the same order every time."""
    if ordinal < 0 or n_shards < 1:
        raise ValueError(f"ordinal must be >= 0 and n_shards >= 1, got {ordinal}, {n_shards}")
    digest = hashlib.blake2b(f"{run_seed}:{round}:{ordinal}".encode(), digest_size=8).digest()
    return LeaseAssignment(shard=ordinal % n_shards, seed=int.from_bytes(digest, "little") >> 2)


# ---------------------------------------------------------------- 2. heartbeats


def admit_heartbeat(
    now: datetime, facts: HeartbeatFacts, *, ttl_s: float
) -> HeartbeatGrant | Refusal:
    """Keep a lease alive for ``ttl_s`` more seconds, or say why its holder should stop
    training for it: a round the run does not have is answered as the upload's
    ``admit_upload`` answers it, and a lease this contributor does not hold on the round
    is ``no_lease``, as an upload's and a release's are."""
    require_aware("now", now)
    rnd = facts.round
    if rnd is None:
        return Refusal(
            ErrorCode.ROUND_CLOSED,
            f"the run has no such round; the current round is {facts.current_round}",
            {"current_round": facts.current_round},
        )
    if facts.run_status is not RunStatus.ACTIVE:
        return _not_active(facts.run_status)
    if rnd.state is not RoundState.OPEN:
        return round_closed(rnd.index, rnd.state, facts.current_round)
    if not facts.lease_held:
        return Refusal(
            ErrorCode.NO_LEASE, f"you hold no such lease on round {rnd.index}: join again"
        )
    return HeartbeatGrant(expires_at=now + timedelta(seconds=ttl_s))


# ---------------------------------------------------------------- 3. uploads


def admit_upload(facts: UploadFacts) -> UploadVerdict | LateGrant | Refusal:
    """Before reading an upload's body: is this contributor's upload welcome here?

    A contributor that already has a contribution in the round is answered as a retry
    whatever happened since (an identical body gets the same receipt; ``admit_retry``).
    Otherwise the run must be active, and the contributor must hold a lease on the round.
    An open round takes the upload; one that closed takes it late (``admit_late``: merged
    into the open round, discounted, while within the run's ``max_staleness``); a closing
    round refuses at once.
    """
    rnd = facts.round
    if rnd is None:
        return Refusal(
            ErrorCode.ROUND_CLOSED,
            f"the run has no such round; the current round is {facts.current_round}",
            {"current_round": facts.current_round},
        )
    if facts.existing_sha256 is not None:
        return UploadVerdict.RETRY
    if facts.run_status is not RunStatus.ACTIVE:
        return _not_active(facts.run_status)
    if rnd.state is not RoundState.OPEN:
        return admit_late(facts, rnd)
    if not facts.lease_held:
        return Refusal(
            ErrorCode.NO_LEASE, f"you hold no lease on round {rnd.index}: join the run first"
        )
    return UploadVerdict.ACCEPT


def admit_claim(claim: UploadClaim, *, run_id: str, round: RoundView) -> Refusal | None:
    """An upload's header against the URL it was sent to and the round's base version."""
    if claim.run_id != run_id or claim.round != round.index:
        return Refusal(
            ErrorCode.HEADER_MISMATCH,
            f"the body is for run {claim.run_id!r} round {claim.round}, "
            f"but was sent to run {run_id!r} round {round.index}",
        )
    if claim.base_version != round.base_version:
        return Refusal(
            ErrorCode.BASE_VERSION_MISMATCH,
            f"the contribution was trained from version {claim.base_version}, round "
            f"{round.index} trains from version {round.base_version}: download it and train "
            "again",
            {"expected": round.base_version},
        )
    if claim.tokens < 1 or claim.inner_steps < 1:
        return Refusal(ErrorCode.MALFORMED_UPLOAD, "tokens and inner_steps must be at least 1")
    return None


def admit_retry(
    existing_sha256: str, sha256: str, *, contribution_id: str, round: int
) -> Refusal | None:
    """A second upload by the same contributor to the same round: the same bytes are an
    idempotent retry (None: answer with the stored receipt), other bytes a conflict."""
    if existing_sha256 == sha256:
        return None
    return Refusal(
        ErrorCode.DUPLICATE_CONTRIBUTION,
        f"you already contributed {contribution_id} to round {round} with a different body; "
        "one contribution per round",
    )


def upload_weight(claimed_tokens: int, lease_tokens: int) -> int:
    """What a contribution counts for in the step, and in credit: the tokens it claims, but
    never more than its lease's work can hold (H steps of batch x block). A volunteer's
    claim is not trusted: claiming 10^12 tokens weighs as much as an honest round."""
    return max(0, min(claimed_tokens, lease_tokens))


def admit_payload(replayed: bool) -> Refusal | None:
    """The same tensors (the decoded payload's digest) already in the round from another
    contributor: a replay of someone else's work, refused. (The same contributor's second
    upload never gets here: ``admit_retry`` answers it.)"""
    if not replayed:
        return None
    return Refusal(
        ErrorCode.REPLAYED_UPLOAD,
        "another contributor already contributed these very tensors to this round: a "
        "contribution must be your own work",
    )


# ---------------------------------------------------------------- 4. closing


def decide_close(
    now: datetime,
    round: RoundView,
    contributions: Sequence[ContributionView],
    leases: Sequence[LeaseView],
    policy: ClosePolicy,
) -> Decision:
    """Decide whether `round` closes now; the first matching rule wins.

    1. A round that is not open is being (or was) closed by someone: nothing to decide.
    2. Target reached: close at once, live leases or not; more work would be wasted.
    3. Quorum reached and no live lease outstanding: nobody else is about to deliver, so
       waiting for the deadline would only idle the volunteers.
    4. Deadline passed with quorum: close with what arrived.
    5. Deadline passed below quorum: extend by `policy.extension`, since the accepted
       contributions (same base) stay valid; once `max_extensions` is used up, keep waiting.
    6. Otherwise wait.

    Accepted contributions count once per contributor (a retry must not count twice), and an
    excluded one not at all. A lease is outstanding when it is live and its holder has no
    contribution yet: a rejected upload may be retried while the lease lives, and the
    deadline bounds that wait.
    """
    require_aware("now", now)
    if round.state is not RoundState.OPEN:
        reason = f"round {round.index} is {round.state}, not open: nothing to decide"
        return Decision(action=Action.KEEP_OPEN, reason=reason, code="not_open")

    contributed = {c.contributor_id for c in contributions if c.accepted}
    accepted = len({c.contributor_id for c in contributions if c.accepted and not c.excluded})
    outstanding = {lease.contributor_id for lease in leases if lease.is_live(now)} - contributed
    quorum = policy.quorum

    if policy.target is not None and accepted >= policy.target:
        reason = f"target reached: {accepted} of target {policy.target} accepted contributions"
        return Decision(action=Action.CLOSE, reason=reason, code="target")
    if accepted >= quorum and not outstanding:
        reason = f"quorum reached ({accepted} of {quorum}) and no live lease outstanding"
        return Decision(action=Action.CLOSE, reason=reason, code="quorum_no_live_leases")
    if now >= round.deadline and accepted >= quorum:
        reason = f"deadline passed with quorum: {accepted} accepted, quorum {quorum}"
        return Decision(action=Action.CLOSE, reason=reason, code="deadline_quorum")
    if now >= round.deadline:
        below = f"deadline passed below quorum: {accepted} of {quorum} accepted"
        limit = policy.max_extensions
        if limit is not None and round.extensions >= limit:
            reason = f"{below}; extension limit {limit} reached, so the round waits for quorum"
            return Decision(action=Action.KEEP_OPEN, reason=reason, code="deadline_below_quorum")
        seconds = policy.extension.total_seconds()
        reason = f"{below}; deadline extended by {seconds:g} s (extension {round.extensions + 1})"
        return Decision(
            action=Action.EXTEND,
            reason=reason,
            new_deadline=now + policy.extension,
            code="deadline_below_quorum",
        )

    left = math.ceil((round.deadline - now).total_seconds())  # never "0 s" before it passes
    leases_text = f"{len(outstanding)} live lease{'' if len(outstanding) == 1 else 's'}"
    reason = f"waiting: {accepted} of quorum {quorum} accepted, {leases_text}, deadline in {left} s"
    return Decision(action=Action.KEEP_OPEN, reason=reason, code="waiting")
