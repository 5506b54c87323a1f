"""The late-contribution rule and its discount (``diloco.protocol.late``), as pure
functions: table tests with the sentences they write."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from diloco.protocol.late import admit_late, late_weight, staleness_discount
from diloco.protocol.messages import ErrorCode, Receipt
from diloco.protocol.rules import admit_upload
from diloco.protocol.state import (
    LateGrant,
    Refusal,
    RoundState,
    RoundView,
    RunStatus,
    UploadFacts,
    UploadVerdict,
)
from diloco.protocol.volunteer import worth_finishing

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def round_(index: int, state: RoundState = RoundState.CLOSED) -> RoundView:
    return RoundView(index, T0, T0 + timedelta(seconds=600), state)


def facts(
    index: int = 3,
    *,
    state: RoundState = RoundState.CLOSED,
    current: int | None = 4,
    current_open: bool = True,
    max_staleness: int = 1,
    lease_held: bool = True,
    existing: str | None = None,
    status: RunStatus = RunStatus.ACTIVE,
) -> UploadFacts:
    return UploadFacts(
        run_status=status,
        round=round_(index, state),
        current_round=current,
        existing_sha256=existing,
        lease_held=lease_held,
        current_open=current_open,
        max_staleness=max_staleness,
    )


# ---------------------------------------------------------------- the discount


@pytest.mark.parametrize(("s", "discount"), [(0, 1.0), (1, 0.5), (2, 1 / 3), (9, 0.1)])
def test_the_discount_is_one_over_one_plus_staleness(s: int, discount: float) -> None:
    assert staleness_discount(s) == pytest.approx(discount)


@pytest.mark.parametrize(
    ("weight", "s", "expected"),
    [
        (384, 0, 384),  # fresh: its whole weight
        (384, 1, 192),  # ⌈384 / 2⌉
        (385, 1, 193),  # ⌈192.5⌉: rounded up
        (384, 2, 128),
        (1, 10, 1),  # never below one token
        (2**53, 1, 2**52),  # integer arithmetic: exact at any size
    ],
)
def test_late_weight_is_the_ceiling_of_weight_over_one_plus_staleness(
    weight: int, s: int, expected: int
) -> None:
    assert late_weight(weight, s) == expected


def test_negative_staleness_is_a_bug_not_a_bonus() -> None:
    with pytest.raises(ValueError, match="staleness"):
        late_weight(100, -1)
    with pytest.raises(ValueError, match="staleness"):
        staleness_discount(-1)


# ---------------------------------------------------------------- admission


def test_work_one_version_late_is_merged_into_the_open_round() -> None:
    assert admit_upload(facts(3, current=4)) == LateGrant(merged_into=4, staleness=1)


def test_work_up_to_max_staleness_versions_late_is_merged() -> None:
    assert admit_upload(facts(3, current=6, max_staleness=3)) == LateGrant(6, 3)


def test_work_past_max_staleness_is_refused_naming_the_current_round() -> None:
    refusal = admit_upload(facts(3, current=5, max_staleness=1))
    assert refusal == Refusal(
        ErrorCode.ROUND_CLOSED,
        "round 3 is closed and its work is 2 versions old, past this run's max_staleness "
        "of 1; the current round is 5: join again",
        {"current_round": 5},
    )


def test_with_max_staleness_0_a_closed_round_refuses_as_before() -> None:
    refusal = admit_upload(facts(3, current=4, max_staleness=0))
    assert refusal == Refusal(
        ErrorCode.ROUND_CLOSED,
        "round 3 is closed; the current round is 4: join again",
        {"current_round": 4},
    )


def test_a_closing_round_refuses_and_asks_for_the_work_again_shortly() -> None:
    refusal = admit_upload(facts(3, state=RoundState.CLOSING, current=3))
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.ROUND_CLOSED
    assert refusal.extra == {"current_round": 3}
    assert "send it again shortly" in refusal.reason


def test_late_work_waits_while_the_round_in_progress_is_closing() -> None:
    refusal = admit_upload(facts(3, current=4, current_open=False))
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.ROUND_CLOSED
    assert refusal.reason == (
        "round 3 is closed and round 4 is closing: late work joins an open round only; "
        "send it again shortly"
    )


def test_late_work_of_a_run_with_no_round_left_is_refused() -> None:
    refusal = admit_upload(facts(3, current=None, current_open=False))
    assert isinstance(refusal, Refusal) and refusal.extra == {"current_round": None}


def test_late_work_without_a_lease_on_its_round_is_refused() -> None:
    refusal = admit_upload(facts(3, current=4, lease_held=False))
    assert refusal == Refusal(
        ErrorCode.NO_LEASE,
        "you held no lease on round 3: late work is merged only from the holder of a lease "
        "on its round",
    )


def test_a_retry_of_late_work_is_answered_as_a_retry_whatever_happened_since() -> None:
    # the stored receipt (merged_into_round, staleness, weight) is returned as it was
    assert admit_upload(facts(3, current=9, existing="ab" * 32)) is UploadVerdict.RETRY


def test_a_paused_run_takes_no_late_work() -> None:
    refusal = admit_upload(facts(3, status=RunStatus.PAUSED))
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.RUN_NOT_ACTIVE


def test_admit_late_only_judges_rounds_that_are_not_open() -> None:
    # an open round is admit_upload's own: admit_late is asked about the others
    assert admit_late(facts(3, current=4), round_(3)) == LateGrant(4, 1)


# ---------------------------------------------------------------- the volunteer's side


@pytest.mark.parametrize(
    ("lease_round", "current", "max_staleness", "worth"),
    [
        (3, 3, 1, True),  # its round is closing: the work joins the next one
        (3, 4, 1, True),
        (3, 5, 1, False),  # past the bound: abandon
        (3, 5, 2, True),
        (3, 4, 0, False),  # the run takes no late work
        (3, None, 1, False),  # the run has no round left
    ],
)
def test_a_volunteer_finishes_its_steps_while_the_work_is_still_welcome(
    lease_round: int, current: int | None, max_staleness: int, worth: bool
) -> None:
    assert worth_finishing(lease_round, current, max_staleness) is worth


def test_a_receipt_from_an_older_server_parses_as_fresh_work() -> None:
    old = Receipt.model_validate({"contribution_id": "con_1", "round": 2, "sha256": "00"})
    assert (old.merged_into_round, old.staleness, old.weight, old.late) == (None, 0, None, False)
    late = Receipt.model_validate(
        {
            "contribution_id": "con_2",
            "round": 2,
            "sha256": "00",
            "merged_into_round": 3,
            "staleness": 1,
            "weight": 192,
        }
    )
    assert late.late and late.merged_into_round == 3
