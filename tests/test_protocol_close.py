"""Table tests for decide_close, the round-closing rule: a fixed `now`, exact sentences."""

from datetime import UTC, datetime, timedelta

import pytest

from diloco.protocol.rules import decide_close
from diloco.protocol.state import (
    Action,
    ClosePolicy,
    ContributionView,
    Decision,
    LeaseView,
    ReasonCode,
    RoundState,
    RoundView,
)

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
POLICY = ClosePolicy(quorum=2, target=4, timeout_s=600)


def at(seconds: float) -> datetime:
    """NOW shifted by `seconds` (negative: in the past)."""
    return NOW + timedelta(seconds=seconds)


def round_(deadline_in: float = 300, *, state=RoundState.OPEN, extensions=0) -> RoundView:
    return RoundView(
        index=7, opened_at=at(-300), deadline=at(deadline_in), state=state, extensions=extensions
    )


def accepted(*ids: str) -> list[ContributionView]:
    return [ContributionView(i, accepted=True, tokens=1000, base_version=6) for i in ids]


def rejected(*ids: str) -> list[ContributionView]:
    return [ContributionView(i, accepted=False, tokens=1000, base_version=6) for i in ids]


def live(*ids: str) -> list[LeaseView]:
    return [LeaseView(i, last_heartbeat=at(-10), expires_at=at(60)) for i in ids]


def lease(contributor_id: str, expires_in: float) -> LeaseView:
    return LeaseView(contributor_id, last_heartbeat=at(expires_in - 60), expires_at=at(expires_in))


def keep(reason: str, code: ReasonCode) -> Decision:
    return Decision(action=Action.KEEP_OPEN, reason=reason, code=code)


def close(reason: str, code: ReasonCode) -> Decision:
    return Decision(action=Action.CLOSE, reason=reason, code=code)


def extend(reason: str, new_deadline: datetime) -> Decision:
    return Decision(
        action=Action.EXTEND, reason=reason, new_deadline=new_deadline, code="deadline_below_quorum"
    )


CASES = [
    pytest.param(
        round_(), accepted("a", "b", "c", "d"), [], POLICY,
        close("target reached: 4 of target 4 accepted contributions", "target"),
        id="target_reached_closes_the_round",
    ),
    pytest.param(
        round_(), accepted("a", "b", "c", "d"), live("e", "f"), POLICY,
        close("target reached: 4 of target 4 accepted contributions", "target"),
        id="target_reached_closes_even_with_live_leases_outstanding",
    ),
    pytest.param(
        round_(), accepted("a", "b"), [], POLICY,
        close("quorum reached (2 of 2) and no live lease outstanding", "quorum_no_live_leases"),
        id="quorum_with_no_live_lease_closes",
    ),
    pytest.param(
        round_(412), accepted("a", "b"), live("c"), POLICY,
        keep("waiting: 2 of quorum 2 accepted, 1 live lease, deadline in 412 s", "waiting"),
        id="quorum_waits_for_a_live_lease_of_someone_who_has_not_contributed",
    ),
    pytest.param(
        round_(), accepted("a", "b"), live("a", "b"), POLICY,
        close("quorum reached (2 of 2) and no live lease outstanding", "quorum_no_live_leases"),
        id="quorum_closes_when_only_contributors_hold_live_leases",
    ),
    pytest.param(
        round_(-5), accepted("a", "b", "c"), live("d"), POLICY,
        close("deadline passed with quorum: 3 accepted, quorum 2", "deadline_quorum"),
        id="deadline_passed_with_quorum_closes_despite_a_live_lease",
    ),
    pytest.param(
        round_(-10), accepted("a"), live("b"), ClosePolicy(2, 4, timeout_s=300, extension_s=600),
        extend(
            "deadline passed below quorum: 1 of 2 accepted; deadline extended by 600 s "
            "(extension 1)",
            at(600),
        ),
        id="deadline_passed_below_quorum_extends_from_now_by_extension_s",
    ),
    pytest.param(
        round_(-10, extensions=2), accepted("a"), [], ClosePolicy(2, None, timeout_s=300),
        extend(
            "deadline passed below quorum: 1 of 2 accepted; deadline extended by 300 s "
            "(extension 3)",
            at(300),
        ),
        id="extension_defaults_to_timeout_and_counts_previous_extensions",
    ),
    pytest.param(
        round_(0), accepted("a"), [], POLICY,
        extend(
            "deadline passed below quorum: 1 of 2 accepted; deadline extended by 600 s "
            "(extension 1)",
            at(600),
        ),
        id="deadline_exactly_at_now_counts_as_passed",
    ),
    pytest.param(
        round_(), accepted("a") + rejected("b", "c"), [], POLICY,
        keep("waiting: 1 of quorum 2 accepted, 0 live leases, deadline in 300 s", "waiting"),
        id="rejected_contributions_do_not_count",
    ),
    pytest.param(
        round_(), accepted("a", "a", "a") + rejected("a"), [], POLICY,
        keep("waiting: 1 of quorum 2 accepted, 0 live leases, deadline in 300 s", "waiting"),
        id="duplicate_contributions_from_one_contributor_count_once",
    ),
    pytest.param(
        round_(), accepted("a", "b"), [lease("c", -1), lease("d", 0)], POLICY,
        close("quorum reached (2 of 2) and no live lease outstanding", "quorum_no_live_leases"),
        id="expired_leases_do_not_count_as_live",
    ),
    pytest.param(
        round_(411.5), accepted("a"), live("b", "c", "c"), POLICY,
        keep("waiting: 1 of quorum 2 accepted, 2 live leases, deadline in 412 s", "waiting"),
        id="below_quorum_before_the_deadline_waits_and_counts_lease_holders_once",
    ),
    pytest.param(
        round_(-10, state=RoundState.CLOSED), accepted("a", "b", "c", "d"), [], POLICY,
        keep("round 7 is closed, not open: nothing to decide", "not_open"),
        id="closed_round_is_not_decided",
    ),
    pytest.param(
        round_(state=RoundState.CLOSING), accepted("a", "b"), [], POLICY,
        keep("round 7 is closing, not open: nothing to decide", "not_open"),
        id="closing_round_is_not_decided",
    ),
    pytest.param(
        round_(-10, extensions=2), accepted("a"), [],
        ClosePolicy(2, 4, timeout_s=600, max_extensions=2),
        keep(
            "deadline passed below quorum: 1 of 2 accepted; extension limit 2 reached, "
            "so the round waits for quorum",
            "deadline_below_quorum",
        ),
        id="max_extensions_reached_keeps_the_round_open_without_extending",
    ),
    pytest.param(
        round_(-10), [], [], ClosePolicy(2, 4, timeout_s=600, max_extensions=0),
        keep(
            "deadline passed below quorum: 0 of 2 accepted; extension limit 0 reached, "
            "so the round waits for quorum",
            "deadline_below_quorum",
        ),
        id="max_extensions_zero_never_extends",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("round_view", "contributions", "leases", "policy", "expected"), CASES)
def test_decide_close(round_view, contributions, leases, policy, expected):
    # Prepare: the views, the policy and the expected decision come from the table above.

    # Execute
    decision = decide_close(NOW, round_view, contributions, leases, policy)

    # Assert
    assert decision.action == expected.action
    assert decision.code == expected.code
    assert decision.reason == expected.reason
    assert decision.new_deadline == expected.new_deadline


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"quorum": 0}, r"^quorum: must be at least 1, got 0$", id="quorum_below_one"),
        pytest.param(
            {"quorum": 3, "target": 2},
            r"^target: must be at least quorum \(3\), got 2$",
            id="target_below_quorum",
        ),
        pytest.param({"timeout_s": 0}, r"^timeout_s: must be a positive", id="zero_timeout"),
        pytest.param({"timeout_s": float("nan")}, r"^timeout_s: ", id="nan_timeout"),
        pytest.param(
            {"extension_s": -1.0}, r"^extension_s: must be a positive", id="negative_extension"
        ),
        pytest.param(
            {"max_extensions": -1},
            r"^max_extensions: must be at least 0",
            id="negative_max_extensions",
        ),
    ],
)
def test_invalid_policy_is_rejected_naming_the_field(kwargs, message):
    # Prepare
    fields = {"quorum": 2, "target": None, "timeout_s": 600.0} | kwargs

    # Execute / Assert
    with pytest.raises(ValueError, match=message):
        ClosePolicy(**fields)


def test_policy_without_target_or_limits_is_valid_and_extends_by_its_timeout():
    policy = ClosePolicy(quorum=1, target=None, timeout_s=90.5)

    assert policy.extension == timedelta(seconds=90.5)
    assert policy.max_extensions is None


def test_naive_now_is_rejected():
    naive_now = NOW.replace(tzinfo=None)

    with pytest.raises(ValueError, match=r"^now: must be timezone-aware"):
        decide_close(naive_now, round_(), [], [], POLICY)


def test_naive_round_and_lease_datetimes_are_rejected_naming_the_field():
    naive = NOW.replace(tzinfo=None)

    with pytest.raises(ValueError, match=r"^deadline: must be timezone-aware"):
        RoundView(index=1, opened_at=NOW, deadline=naive, state=RoundState.OPEN)
    with pytest.raises(ValueError, match=r"^expires_at: must be timezone-aware"):
        LeaseView("a", last_heartbeat=NOW, expires_at=naive)


def test_extend_decision_requires_a_new_deadline_and_only_extend_has_one():
    with pytest.raises(ValueError, match=r"^new_deadline: "):
        Decision(action=Action.EXTEND, reason="x", code="deadline_below_quorum")
    with pytest.raises(ValueError, match=r"^new_deadline: "):
        Decision(action=Action.CLOSE, reason="x", new_deadline=NOW, code="target")
