"""Table tests for the round protocol's rules other than decide_close (test_protocol_close):
joining, heartbeats, admitting an upload, exclusions, what a close changes, retries.
A fixed `now`; each rule's sentence is pinned, since the dashboard and the API show it."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from diloco.protocol.messages import ErrorCode
from diloco.protocol.outcome import (
    TRAIN_FLOPS_PER_PARAM_TOKEN,
    close_effects,
    close_retry_at,
    decide_after_exclusions,
    decide_after_guard,
    judge_step,
    should_judge,
)
from diloco.protocol.rules import (
    admit_claim,
    admit_heartbeat,
    admit_join,
    admit_payload,
    admit_retry,
    admit_upload,
    assign_lease,
    upload_weight,
)
from diloco.protocol.state import (
    Action,
    Aggregated,
    HeartbeatFacts,
    HeartbeatGrant,
    JoinFacts,
    JoinGrant,
    LeasePolicy,
    LeaseView,
    NextRound,
    Refusal,
    RetryPolicy,
    RoundState,
    RoundView,
    RunStatus,
    StepVerdict,
    UploadClaim,
    UploadFacts,
    UploadVerdict,
)

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
LEASES = LeasePolicy(ttl_s=30, n_shards=4, retry_after_s=2.0)
OPEN = RoundView(7, opened_at=NOW - timedelta(minutes=5), deadline=NOW, state=RoundState.OPEN)
CLOSING = RoundView(7, opened_at=OPEN.opened_at, deadline=NOW, state=RoundState.CLOSING)
CLOSED = RoundView(7, opened_at=OPEN.opened_at, deadline=NOW, state=RoundState.CLOSED)
HELD = LeaseView("alice", last_heartbeat=NOW, expires_at=NOW + timedelta(seconds=5), shard=3)


def refusal(code: ErrorCode, reason: str, **extra: object) -> Refusal:
    return Refusal(code, reason, extra)


# ---------------------------------------------------------------- joining

JOINS = [
    pytest.param(
        JoinFacts(RunStatus.ACTIVE, OPEN, contributed=False, lease=None),
        JoinGrant(round=7, base_version=6, expires_at=NOW + timedelta(seconds=30), new_lease=True),
        id="an_open_round_hands_out_a_new_lease",
    ),
    pytest.param(
        JoinFacts(RunStatus.ACTIVE, OPEN, contributed=False, lease=HELD),
        JoinGrant(round=7, base_version=6, expires_at=NOW + timedelta(seconds=30), new_lease=False),
        id="a_held_lease_is_renewed_not_replaced",
    ),
    pytest.param(
        JoinFacts(RunStatus.PAUSED, OPEN, contributed=False, lease=None),
        refusal(
            ErrorCode.RUN_NOT_ACTIVE,
            "the run is paused: wait for its owner to resume it",
            status=RunStatus.PAUSED,
        ),
        id="a_paused_run_hands_out_nothing",
    ),
    pytest.param(
        JoinFacts(RunStatus.CANCELLED, OPEN, contributed=False, lease=None),
        refusal(
            ErrorCode.RUN_NOT_ACTIVE,
            "the run is cancelled: its owner stopped it; join another run",
            status=RunStatus.CANCELLED,
        ),
        id="a_cancelled_run_hands_out_nothing",
    ),
    pytest.param(
        JoinFacts(RunStatus.ACTIVE, CLOSING, contributed=False, lease=None),
        refusal(
            ErrorCode.ROUND_CLOSING,
            "round 7 is closing right now; join again shortly",
            retry_after_s=2.0,
        ),
        id="a_closing_round_says_come_back_shortly",
    ),
    pytest.param(
        JoinFacts(RunStatus.ACTIVE, None, contributed=False, lease=None),
        refusal(
            ErrorCode.ROUND_CLOSING,
            "no round is open right now; join again shortly",
            retry_after_s=2.0,
        ),
        id="no_round_in_progress_says_come_back_shortly",
    ),
    pytest.param(
        JoinFacts(RunStatus.ACTIVE, OPEN, contributed=True, lease=HELD),
        refusal(
            ErrorCode.ALREADY_CONTRIBUTED,
            "you already contributed to round 7; the next round opens when it closes",
            retry_after_s=2.0,
        ),
        id="one_contribution_per_contributor_per_round",
    ),
]


@pytest.mark.parametrize(("facts", "expected"), JOINS)
def test_admit_join(facts: JoinFacts, expected: object) -> None:
    assert admit_join(NOW, facts, LEASES) == expected


def test_leases_go_round_robin_over_the_shards_with_reproducible_distinct_seeds() -> None:
    # Execute: eight leases of one round, twice, and the first of another round and run
    first = [assign_lease(i, round=7, run_seed=1234, n_shards=4) for i in range(8)]
    again = [assign_lease(i, round=7, run_seed=1234, n_shards=4) for i in range(8)]
    other_round = assign_lease(0, round=8, run_seed=1234, n_shards=4)
    other_run = assign_lease(0, round=7, run_seed=1235, n_shards=4)

    # Assert
    assert [a.shard for a in first] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert first == again
    assert len({a.seed for a in first}) == 8
    assert other_round.seed != first[0].seed and other_run.seed != first[0].seed
    assert all(0 <= a.seed < 1 << 62 for a in first)


def test_assign_lease_refuses_a_negative_ordinal() -> None:
    with pytest.raises(ValueError, match="ordinal"):
        assign_lease(-1, round=1, run_seed=0, n_shards=4)


# ---------------------------------------------------------------- heartbeats

BEATS = [
    pytest.param(
        HeartbeatFacts(RunStatus.ACTIVE, OPEN, current_round=7, lease_held=True),
        HeartbeatGrant(expires_at=NOW + timedelta(seconds=30)),
        id="a_held_lease_on_an_open_round_is_renewed",
    ),
    pytest.param(
        HeartbeatFacts(RunStatus.ACTIVE, None, current_round=7, lease_held=False),
        refusal(
            ErrorCode.ROUND_CLOSED,
            "the run has no such round; the current round is 7",
            current_round=7,
        ),
        id="an_unknown_round_is_answered_as_an_uploads_is",
    ),
    pytest.param(
        HeartbeatFacts(RunStatus.PAUSED, OPEN, current_round=7, lease_held=True),
        refusal(
            ErrorCode.RUN_NOT_ACTIVE,
            "the run is paused: wait for its owner to resume it",
            status=RunStatus.PAUSED,
        ),
        id="a_paused_run_stops_the_training",
    ),
    pytest.param(
        HeartbeatFacts(RunStatus.ACTIVE, CLOSED, current_round=8, lease_held=True),
        refusal(
            ErrorCode.ROUND_CLOSED,
            "round 7 is closed; the current round is 8: join again",
            current_round=8,
        ),
        id="a_closed_round_names_the_current_one",
    ),
    pytest.param(
        HeartbeatFacts(RunStatus.ACTIVE, CLOSING, current_round=7, lease_held=True),
        refusal(
            ErrorCode.ROUND_CLOSED,
            "round 7 is closing; the current round is 7: join again",
            current_round=7,
        ),
        id="a_closing_round_takes_no_more_heartbeats",
    ),
    pytest.param(
        HeartbeatFacts(RunStatus.ACTIVE, OPEN, current_round=7, lease_held=False),
        refusal(ErrorCode.NO_LEASE, "you hold no such lease on round 7: join again"),
        id="someone_elses_lease_is_no_lease",
    ),
]


@pytest.mark.parametrize(("facts", "expected"), BEATS)
def test_admit_heartbeat(facts: HeartbeatFacts, expected: object) -> None:
    assert admit_heartbeat(NOW, facts, ttl_s=30) == expected


# ---------------------------------------------------------------- uploads

UPLOADS = [
    pytest.param(
        UploadFacts(RunStatus.ACTIVE, OPEN, 7, existing_sha256=None, lease_held=True),
        UploadVerdict.ACCEPT,
        id="a_lease_holder_uploads_to_the_open_round",
    ),
    pytest.param(
        UploadFacts(RunStatus.ACTIVE, CLOSED, 8, existing_sha256="ab", lease_held=True),
        UploadVerdict.RETRY,
        id="a_second_upload_is_a_retry_even_after_the_close",
    ),
    pytest.param(
        UploadFacts(RunStatus.ACTIVE, None, 8, existing_sha256=None, lease_held=False),
        refusal(
            ErrorCode.ROUND_CLOSED,
            "the run has no such round; the current round is 8",
            current_round=8,
        ),
        id="an_unknown_round_names_the_current_one",
    ),
    pytest.param(
        UploadFacts(RunStatus.PAUSED, OPEN, 7, existing_sha256=None, lease_held=True),
        refusal(
            ErrorCode.RUN_NOT_ACTIVE,
            "the run is paused: wait for its owner to resume it",
            status=RunStatus.PAUSED,
        ),
        id="a_paused_run_takes_no_upload",
    ),
    pytest.param(
        UploadFacts(RunStatus.CANCELLED, OPEN, 7, existing_sha256=None, lease_held=True),
        refusal(
            ErrorCode.RUN_NOT_ACTIVE,
            "the run is cancelled: its owner stopped it; join another run",
            status=RunStatus.CANCELLED,
        ),
        id="a_cancelled_run_takes_no_upload",
    ),
    pytest.param(
        UploadFacts(RunStatus.ACTIVE, CLOSING, 7, existing_sha256=None, lease_held=True),
        refusal(
            ErrorCode.ROUND_CLOSED,
            "round 7 is closing; the current round is 7: join again",
            current_round=7,
        ),
        id="a_closing_round_refuses_at_once",
    ),
    pytest.param(
        UploadFacts(RunStatus.ACTIVE, OPEN, 7, existing_sha256=None, lease_held=False),
        refusal(ErrorCode.NO_LEASE, "you hold no lease on round 7: join the run first"),
        id="no_lease_no_upload",
    ),
]


@pytest.mark.parametrize(("facts", "expected"), UPLOADS)
def test_admit_upload(facts: UploadFacts, expected: object) -> None:
    assert admit_upload(facts) == expected


def claim(**changes: object) -> UploadClaim:
    fields = {"run_id": "run_a", "round": 7, "base_version": 6, "tokens": 100, "inner_steps": 5}
    return UploadClaim(**(fields | changes))  # type: ignore[arg-type]


CLAIMS = [
    pytest.param(claim(), None, id="a_header_for_this_round_passes"),
    pytest.param(
        claim(run_id="run_b"),
        refusal(
            ErrorCode.HEADER_MISMATCH,
            "the body is for run 'run_b' round 7, but was sent to run 'run_a' round 7",
        ),
        id="another_runs_body_is_a_mismatch",
    ),
    pytest.param(
        claim(round=8),
        refusal(
            ErrorCode.HEADER_MISMATCH,
            "the body is for run 'run_a' round 8, but was sent to run 'run_a' round 7",
        ),
        id="another_rounds_body_is_a_mismatch",
    ),
    pytest.param(
        claim(base_version=5),
        refusal(
            ErrorCode.BASE_VERSION_MISMATCH,
            "the contribution was trained from version 5, round 7 trains from version 6: "
            "download it and train again",
            expected=6,
        ),
        id="stale_work_is_refused_naming_the_version",
    ),
    pytest.param(
        claim(tokens=0),
        refusal(ErrorCode.MALFORMED_UPLOAD, "tokens and inner_steps must be at least 1"),
        id="zero_tokens_is_malformed",
    ),
]


@pytest.mark.parametrize(("upload", "expected"), CLAIMS)
def test_admit_claim(upload: UploadClaim, expected: Refusal | None) -> None:
    assert admit_claim(upload, run_id="run_a", round=OPEN) == expected


def test_a_retry_with_the_same_bytes_is_idempotent_and_other_bytes_conflict() -> None:
    assert admit_retry("ab", "ab", contribution_id="con_1", round=7) is None
    assert admit_retry("ab", "cd", contribution_id="con_1", round=7) == refusal(
        ErrorCode.DUPLICATE_CONTRIBUTION,
        "you already contributed con_1 to round 7 with a different body; one contribution "
        "per round",
    )


# ---------------------------------------------------------------- exclusions


def test_a_round_closes_on_the_readable_others_while_they_make_quorum() -> None:
    decision = decide_after_exclusions(7, kept=2, excluded={"con_b": "damaged"}, quorum=2)

    assert decision.action is Action.CLOSE and decision.code == "excluded_quorum"
    assert decision.reason == (
        "round 7: 1 contribution left out: con_b (damaged); closing with the 2 others (quorum 2)"
    )


def test_a_round_below_quorum_after_exclusions_reopens() -> None:
    decision = decide_after_exclusions(
        7, kept=1, excluded={"con_c": "missing", "con_b": "damaged"}, quorum=2
    )

    assert decision.action is Action.KEEP_OPEN and decision.code == "excluded_below_quorum"
    assert decision.reason == (
        "round 7: 2 contributions left out: con_b (damaged), con_c (missing); 1 left, below "
        "quorum 2: reopened to wait for more"
    )


def test_a_round_whose_guard_leaves_too_few_reopens_naming_what_it_left_out() -> None:
    decision = decide_after_guard(
        7, kept=0, left_out={"con_b": "the step with it was discarded (not finite)"}, quorum=1
    )

    assert decision.action is Action.KEEP_OPEN and decision.code == "guard_below_quorum"
    assert decision.reason == (
        "round 7: left out for good: con_b (the step with it was discarded (not finite)); "
        "0 left, below quorum 1: reopened to wait for more"
    )


# ---------------------------------------------------------------- what a close changes

IN_STEP = [Aggregated("con_a", "alice", tokens=300, loss=2.0), Aggregated("con_b", "bob", 100, 4.0)]


def effects(status: RunStatus, round: int = 7, max_rounds: int = 10):  # type: ignore[no-untyped-def]
    return close_effects(
        NOW,
        round=round,
        run_status=status,
        aggregated=IN_STEP,
        n_params=1000,
        max_rounds=max_rounds,
        timeout_s=600,
    )


def test_a_close_counts_weights_the_loss_by_tokens_and_credits_6n_flops_per_token() -> None:
    result = effects(RunStatus.ACTIVE)

    assert (result.accepted, result.tokens) == (2, 400)
    assert result.train_loss == pytest.approx((300 * 2.0 + 100 * 4.0) / 400)
    assert TRAIN_FLOPS_PER_PARAM_TOKEN == 6
    assert result.credit == {"con_a": 300 * 6 * 1000.0, "con_b": 100 * 6 * 1000.0}
    assert result.run_status is RunStatus.ACTIVE
    assert result.next_round == NextRound(8, NOW, NOW + timedelta(seconds=600))
    assert result.summary == "round 7 closed with 2 contributions (400 tokens); round 8 opens"


def test_the_last_round_completes_an_active_or_paused_run() -> None:
    for status in (RunStatus.ACTIVE, RunStatus.PAUSED):
        result = effects(status, round=10, max_rounds=10)
        assert result.run_status is RunStatus.COMPLETED and result.next_round is None


def test_a_paused_run_gets_its_next_round_which_waits_for_resume() -> None:
    result = effects(RunStatus.PAUSED)

    assert result.run_status is RunStatus.PAUSED and result.next_round is not None


def test_a_cancel_is_never_overwritten_by_a_close() -> None:
    for round, max_rounds in ((7, 10), (10, 10)):
        result = effects(RunStatus.CANCELLED, round=round, max_rounds=max_rounds)
        assert result.run_status is RunStatus.CANCELLED and result.next_round is None
        assert result.summary.endswith("the run was cancelled meanwhile, so no round follows")
        assert result.credit  # the step it published still counts


def test_a_failed_close_is_retried_with_capped_exponential_backoff() -> None:
    policy = RetryPolicy(base_s=2.0, max_s=60.0)

    delays = [(close_retry_at(NOW, n, policy) - NOW).total_seconds() for n in (1, 2, 3, 6, 100)]

    assert delays == [2.0, 4.0, 8.0, 60.0, 60.0]
    with pytest.raises(ValueError, match="attempts"):
        close_retry_at(NOW, 0, policy)


def test_naive_times_are_refused_by_every_rule_that_reads_the_clock() -> None:
    naive = NOW.replace(tzinfo=None)
    facts = JoinFacts(RunStatus.ACTIVE, OPEN, contributed=False, lease=None)
    beat = HeartbeatFacts(RunStatus.ACTIVE, OPEN, current_round=7, lease_held=True)

    for call in (
        lambda: admit_join(naive, facts, LEASES),
        lambda: admit_heartbeat(naive, beat, ttl_s=30),
        lambda: close_retry_at(naive, 1, RetryPolicy()),
    ):
        with pytest.raises(ValueError, match=r"^now: must be timezone-aware"):
            call()


# ---------------------------------------------------------------- what an upload is worth


def test_an_uploads_weight_is_its_claim_at_most_what_a_lease_allows():
    assert upload_weight(1_000, lease_tokens=4_096) == 1_000
    assert upload_weight(10**12, lease_tokens=4_096) == 4_096
    assert upload_weight(-5, lease_tokens=4_096) == 0


def test_someone_elses_tensors_are_a_replay():
    assert admit_payload(False) is None
    assert admit_payload(True) == refusal(
        ErrorCode.REPLAYED_UPLOAD,
        "another contributor already contributed these very tensors to this round: a "
        "contribution must be your own work",
    )


# ---------------------------------------------------------------- the guard

STEPS = [
    pytest.param(2.0, 3.9, True, StepVerdict(True, "ok", "eval loss 3.9000"), id="within_bound"),
    pytest.param(None, 9.0, True, StepVerdict(True, "ok", "eval loss 9.0000"), id="no_base_yet"),
    pytest.param(
        2.0, 4.1, True,
        StepVerdict(
            False, "loss_rise",
            "eval loss would rise from 2.0000 to 4.1000, past 2x the base version's",
        ),
        id="too_far_a_rise_is_discarded",
    ),
    pytest.param(
        2.0, 1.0, False,
        StepVerdict(False, "non_finite", "the step's parameters are not all finite"),
        id="non_finite_parameters_are_discarded",
    ),
    pytest.param(
        2.0, math.nan, True,
        StepVerdict(False, "non_finite", "the step's parameters are not all finite"),
        id="a_nan_loss_is_discarded",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("base", "new", "finite", "expected"), STEPS)
def test_judge_step(base: float | None, new: float, finite: bool, expected: StepVerdict) -> None:
    assert judge_step(base, new, finite=finite, max_loss_ratio=2.0) == expected


@pytest.mark.parametrize(
    ("finite", "judge_windows", "expected"),
    [
        pytest.param(True, 8, True, id="every_finite_step_whatever_its_norm"),
        pytest.param(True, 1, True, id="one_window_is_a_sample"),
        pytest.param(False, 8, False, id="not_finite_is_discarded_unseen"),
        pytest.param(True, 0, False, id="judging_turned_off"),
    ],
)
def test_should_judge(finite: bool, judge_windows: int, expected: bool) -> None:
    assert should_judge(finite=finite, judge_windows=judge_windows) is expected
