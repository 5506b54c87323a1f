"""How often volunteers heartbeat (``diloco.protocol.heartbeats``): the server's advice from
the run's interval and TTL, the hub's live leases and its budget; and the volunteer's
schedule once an answer advised an interval."""

from __future__ import annotations

import math

import pytest

from diloco.protocol.heartbeats import (
    HEARTBEATS_PER_TTL,
    STEP_S,
    advise_interval,
    advised,
    next_heartbeat,
)
from diloco.protocol.volunteer import MIN_HEARTBEAT_S

# ---------------------------------------------------------------- the server's advice


@pytest.mark.parametrize(
    ("configured", "ttl", "live", "budget", "expected", "why"),
    [
        (10.0, 30.0, 0, 500.0, 10.0, "no load: the run's own interval"),
        (10.0, 30.0, 4999, 500.0, 10.0, "within the budget at the run's interval"),
        (2.0, 30.0, 1000, 500.0, 2.0, "1,000 leases at 2 s are the budget exactly"),
        (2.0, 30.0, 1001, 500.0, 2.5, "one more lease: up to the next step"),
        (2.0, 30.0, 2000, 500.0, 4.0, "twice the budget: twice the interval"),
        (2.0, 30.0, 5000, 500.0, 10.0, "5,000 leases: 10 s, a third of the TTL"),
        (2.0, 30.0, 50_000, 500.0, 10.0, "past budget x TTL / 3: the TTL's bound wins"),
        (2.0, 60.0, 50_000, 500.0, 20.0, "a longer TTL allows a longer interval"),
        (12.0, 30.0, 50_000, 500.0, 12.0, "a run's own interval past TTL / 3 is kept"),
        (1.0, 1.5, 10_000, 1.0, 1.0, "never below the run's own interval"),
    ],
)
def test_the_advice_spreads_the_load_within_the_ttl_and_never_below_the_run(
    configured, ttl, live, budget, expected, why
):
    got = advise_interval(configured_s=configured, ttl_s=ttl, live_leases=live, budget_per_s=budget)

    assert got == expected, why


@pytest.mark.parametrize("live", [0, 1, 7, 499, 500, 501, 1234, 4999, 5000, 5001, 10**6])
@pytest.mark.parametrize("configured", [1.0, 2.0, 10.0])
def test_the_advice_keeps_the_hub_within_budget_or_the_lease_within_its_ttl(live, configured):
    ttl, budget = 30.0, 500.0

    got = advise_interval(configured_s=configured, ttl_s=ttl, live_leases=live, budget_per_s=budget)

    assert got >= configured
    assert got <= max(configured, ttl / HEARTBEATS_PER_TTL)  # several heartbeats per TTL
    offered = live / got
    if live <= budget * ttl / HEARTBEATS_PER_TTL:
        assert offered <= budget  # the hub is offered at most its budget
    if got > configured:  # lengthened by load: a whole step, or the TTL's bound
        assert got == ttl / HEARTBEATS_PER_TTL or math.isclose(got / STEP_S, round(got / STEP_S))


@pytest.mark.parametrize(
    "bad",
    [
        {"configured_s": 0.0},
        {"ttl_s": -1.0},
        {"budget_per_s": 0.0},
        {"live_leases": -1},
    ],
)
def test_the_advice_refuses_numbers_that_make_no_interval(bad):
    args = {"configured_s": 2.0, "ttl_s": 30.0, "live_leases": 10, "budget_per_s": 500.0}

    with pytest.raises(ValueError, match="advise_interval"):
        advise_interval(**{**args, **bad})


# ---------------------------------------------------------------- the volunteer's schedule


def test_unchanged_advice_means_one_interval_to_the_next_heartbeat():
    assert next_heartbeat(10.0, 10.0, draw=0.9) == (10.0, 10.0)


def test_no_advice_keeps_the_interval_followed_so_far():
    assert next_heartbeat(4.0, None, draw=0.3) == (4.0, 4.0)


@pytest.mark.parametrize(
    ("current", "advice", "draw", "expected"),
    [
        (2.0, 10.0, 0.5, (10.0, 5.0)),  # longer: a random point of the new interval
        (2.0, 10.0, 0.0, (10.0, MIN_HEARTBEAT_S)),  # but never sooner than the floor
        (10.0, 4.0, 0.75, (4.0, 3.0)),  # shorter: the same
        (10.0, 0.2, 0.5, (MIN_HEARTBEAT_S, MIN_HEARTBEAT_S)),  # an advice under the floor
    ],
)
def test_changed_advice_moves_the_next_heartbeat_to_a_random_point_of_the_new_interval(
    current, advice, draw, expected
):
    assert next_heartbeat(current, advice, draw) == expected


def test_volunteers_who_hear_a_change_together_spread_over_the_new_interval():
    # 1,000 volunteers heartbeating within one second all hear 2 s -> 10 s; with evenly
    # spread draws, their next heartbeats cover the new interval instead of one second
    sent = [i / 1000 for i in range(1000)]
    nexts = [t + next_heartbeat(2.0, 10.0, draw=i / 1000)[1] for i, t in enumerate(sent)]

    per_second = [sum(1 for t in nexts if s <= t < s + 1) for s in range(1, 11)]
    assert max(per_second) <= 2 * 1000 / 10, per_second


def test_a_draw_outside_the_unit_interval_is_refused():
    with pytest.raises(ValueError, match="draw"):
        next_heartbeat(2.0, 10.0, draw=1.0)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"heartbeat_interval_s": 7.5}, 7.5),
        ({"heartbeat_interval_s": 3}, 3.0),
        ({"lease_expires_at": "…"}, None),  # a server from before the advice
        ({"heartbeat_interval_s": None}, None),
        ({"heartbeat_interval_s": "10"}, None),
        ({"heartbeat_interval_s": True}, None),
        ({"heartbeat_interval_s": 0}, None),
        ({"heartbeat_interval_s": float("nan")}, None),
        ({"heartbeat_interval_s": float("inf")}, None),
        ([], None),
        (None, None),
    ],
)
def test_the_advice_is_read_from_an_answer_only_when_it_is_a_sane_number(answer, expected):
    assert advised(answer) == expected
