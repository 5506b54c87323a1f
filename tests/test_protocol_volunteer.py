"""The volunteer's reactions (``diloco.protocol.volunteer``): what it does on each answer of
the server, as a table of (state, answer) -> (state, reaction), with the codes it reads
checked against the ones the server sends."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from diloco.protocol import volunteer
from diloco.protocol.messages import ErrorCode
from diloco.protocol.volunteer import (
    LATE_RETRY_S,
    MAX_INVALID_IN_A_ROW,
    MAX_WAIT_S,
    NO_ACTIVE_RUN,
    NO_RUN_MAX_WAIT_S,
    POLL_S,
    Answer,
    Do,
    Request,
    VolunteerState,
    staleness_bound,
    step,
)

ROOT = Path(__file__).resolve().parent.parent
HOLDING = VolunteerState(lease_round=3, max_staleness=1)  # training round 3, late work welcome


def _react(state: VolunteerState, to: Request, code: str | None = None, **body) -> Do:
    return step(state, Answer(to, code=code, body=body))[1].do


# ---------------------------------------------------------------- joining


def test_a_lease_is_trained_and_remembered_with_its_runs_staleness_bound():
    state, reaction = step(
        VolunteerState(refused_in_a_row=2),
        Answer(Request.JOIN, body={"round": 7, "max_staleness": 2}),
    )
    assert reaction.do is Do.TRAIN
    assert state == VolunteerState(lease_round=7, max_staleness=2, refused_in_a_row=2)


@pytest.mark.parametrize(
    ("code", "body", "do", "wait_s"),
    [
        (ErrorCode.RUN_NOT_ACTIVE, {"status": "paused"}, Do.WAIT, POLL_S),
        (ErrorCode.RUN_NOT_ACTIVE, {"status": "completed"}, Do.STOP, 0.0),
        (ErrorCode.RUN_NOT_ACTIVE, {"status": "cancelled"}, Do.STOP, 0.0),
        (ErrorCode.ROUND_CLOSING, {"retry_after_s": 3}, Do.WAIT, 3.0),
        (ErrorCode.ALREADY_CONTRIBUTED, {"retry_after_s": 0.01}, Do.WAIT, 0.5),
        (ErrorCode.ALREADY_CONTRIBUTED, {"retry_after_s": 9999}, Do.WAIT, MAX_WAIT_S),
        (ErrorCode.ROUND_CLOSING, {}, Do.WAIT, POLL_S),  # no time named: the poll interval
        (ErrorCode.RUN_NOT_FOUND, {}, Do.FATAL, 0.0),
        (ErrorCode.BANNED, {}, Do.FATAL, 0.0),
    ],
)
def test_a_refused_join_is_waited_out_or_ends_the_loop(code, body, do, wait_s):
    _, reaction = step(VolunteerState(), Answer(Request.JOIN, code=code, body=body))
    assert (reaction.do, reaction.wait_s) == (do, wait_s)


def test_a_join_answered_by_a_server_error_is_fatal_once_the_http_layer_gave_up():
    answer = Answer(Request.JOIN, code=ErrorCode.INTERNAL, status=500)
    assert step(VolunteerState(), answer)[1].do is Do.FATAL


def test_with_no_active_run_the_volunteer_waits_with_a_bounded_backoff():
    state, waits = VolunteerState(), []
    for _ in range(8):
        state, reaction = step(state, Answer(Request.RUNS, code=NO_ACTIVE_RUN))
        assert reaction.do is Do.WAIT and "waiting for one" in reaction.why
        waits.append(reaction.wait_s)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert max(waits) == NO_RUN_MAX_WAIT_S
    state, reaction = step(state, Answer(Request.RUNS))  # a run appeared
    assert reaction.do is Do.JOIN and state.no_run_tries == 0


# ---------------------------------------------------------------- heartbeats


@pytest.mark.parametrize(
    ("code", "body", "do"),
    [
        (None, {}, Do.CARRY_ON),
        (ErrorCode.NO_LEASE, {}, Do.ABANDON),  # the server no longer knows our lease
        (ErrorCode.ROUND_CLOSED, {"current_round": 4}, Do.CARRY_ON),  # merged late
        (ErrorCode.ROUND_CLOSED, {"current_round": 3}, Do.CARRY_ON),  # closing: late next
        (ErrorCode.ROUND_CLOSED, {"current_round": 5}, Do.ABANDON),  # past the bound
        (ErrorCode.ROUND_CLOSED, {"current_round": "4"}, Do.ABANDON),  # not a round
        (ErrorCode.RUN_NOT_ACTIVE, {"status": "paused"}, Do.ABANDON),
        (ErrorCode.BANNED, {}, Do.FATAL),
        (ErrorCode.UNAUTHORIZED, {}, Do.FATAL),
        (ErrorCode.RATE_LIMITED, {}, Do.WARN),  # trained on: the next beat may pass
    ],
)
def test_a_heartbeat_answer_keeps_the_lease_or_gives_it_up(code, body, do):
    assert _react(HOLDING, Request.HEARTBEAT, code, **body) is do


def test_a_heartbeat_answered_no_lease_forgets_the_lease_and_says_so():
    state, reaction = step(HOLDING, Answer(Request.HEARTBEAT, code=ErrorCode.NO_LEASE))
    assert state.lease_round is None
    assert reaction.why == "lost our lease on round 3 (no_lease)"


def test_a_heartbeat_answered_by_a_failing_server_is_trained_on():
    answer = Answer(Request.HEARTBEAT, code=ErrorCode.UNAVAILABLE, status=503)
    assert step(HOLDING, answer)[1].do is Do.WARN


@pytest.mark.parametrize(
    ("rounds", "code", "body", "welcome"),
    [
        ({"max_staleness": 1}, "round_closed", {"current_round": 2}, True),
        ({"max_staleness": 1}, "round_closed", {"current_round": 3}, False),  # past the bound
        ({}, "round_closed", {"current_round": 2}, False),  # a server from before late work
        ({"max_staleness": 1}, "no_lease", {}, False),
        ({"max_staleness": 1}, "round_closed", {"current_round": "2"}, False),  # not ours
    ],
)
def test_the_volunteer_keeps_training_only_for_work_the_run_still_takes(
    rounds, code, body, welcome
):
    bound = staleness_bound({"rounds": rounds})
    state, _ = step(
        VolunteerState(), Answer(Request.JOIN, body={"round": 1, "max_staleness": bound})
    )
    expected = Do.CARRY_ON if welcome else Do.ABANDON
    assert _react(state, Request.HEARTBEAT, code, **body) is expected


@pytest.mark.parametrize(
    ("config", "bound"),
    [({"rounds": {"max_staleness": 2}}, 2), ({"rounds": {}}, 0), ({}, 0), (None, 0),
     ({"rounds": {"max_staleness": True}}, 0), ({"rounds": "x"}, 0)],
)  # fmt: skip
def test_the_staleness_bound_is_read_from_the_leases_config_or_is_zero(config, bound):
    assert staleness_bound(config) == bound


# ---------------------------------------------------------------- uploads


def test_an_accepted_upload_ends_the_lease_and_the_run_of_refusals():
    state = VolunteerState(lease_round=3, refused_in_a_row=2, late_tries=1)
    state, reaction = step(state, Answer(Request.UPLOAD))
    assert reaction.do is Do.DONE
    assert state == VolunteerState(lease_round=None, refused_in_a_row=0, late_tries=0)


def test_late_work_is_sent_again_doubling_until_max_wait_then_dropped():
    state, waits = HOLDING, []
    closing = Answer(Request.UPLOAD, code=ErrorCode.ROUND_CLOSED, body={"current_round": 3})
    while True:
        state, reaction = step(state, closing)
        if reaction.do is not Do.SEND_AGAIN:
            break
        waits.append(reaction.wait_s)
    assert waits == [LATE_RETRY_S * 2**i for i in range(len(waits))]
    assert sum(waits[:-1]) <= MAX_WAIT_S < sum(waits)  # the last try starts within the bound
    assert reaction.do is Do.DROP and state.lease_round is None


@pytest.mark.parametrize("code", sorted(volunteer.MOVED_ON_CODES | volunteer.BUSY_CODES))
def test_an_upload_refused_for_the_rounds_timing_is_dropped_without_counting(code):
    state, reaction = step(
        VolunteerState(lease_round=3), Answer(Request.UPLOAD, code=code, body={})
    )
    assert reaction.do is Do.DROP and state.refused_in_a_row == 0


def test_bodies_refused_in_a_row_stop_the_volunteer_after_the_limit():
    state = VolunteerState(lease_round=3)
    bad = Answer(Request.UPLOAD, code=ErrorCode.WRONG_TENSORS, status=400)
    dos = []
    for _ in range(MAX_INVALID_IN_A_ROW):
        state, reaction = step(state, bad)
        dos.append(reaction.do)
    assert dos == [Do.REFUSED] * (MAX_INVALID_IN_A_ROW - 1) + [Do.FATAL]
    assert "may not match the server's version" in reaction.why


@pytest.mark.parametrize(
    ("code", "status"),
    [(ErrorCode.INTERNAL, 500), (ErrorCode.UNAUTHORIZED, 401), (ErrorCode.BANNED, 403)],
)
def test_an_upload_answered_by_a_server_error_or_refusing_who_we_are_is_fatal(code, status):
    answer = Answer(Request.UPLOAD, code=code, status=status)
    assert step(HOLDING, answer)[1].do is Do.FATAL


@pytest.mark.parametrize("code", [None, ErrorCode.NO_LEASE, ErrorCode.ROUND_CLOSED])
def test_a_release_answered_no_lease_means_nothing_was_held(code):
    state, reaction = step(HOLDING, Answer(Request.RELEASE, code=code))
    assert reaction.do is Do.DONE and state.lease_round is None


# ---------------------------------------------------------------- one definition


def test_every_code_the_volunteer_reacts_to_is_one_the_server_sends_or_its_own():
    server_codes = {c.value for c in ErrorCode}
    sets = [v for v in vars(volunteer).values() if isinstance(v, frozenset)]
    read = set().union(*sets)
    assert len(sets) >= 6 and ErrorCode.NO_LEASE in read
    assert read <= server_codes | volunteer.CLIENT_CODES
    assert not volunteer.CLIENT_CODES & server_codes  # never mistaken for the server's


def _code_literals(path: Path) -> list[str]:
    """String constants compared with an ``….code`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any(isinstance(s, ast.Attribute) and s.attr == "code" for s in sides):
            found += [s.value for s in sides if isinstance(s, ast.Constant)]
    return found


def test_the_client_compares_error_codes_only_with_named_ones():
    spelled = {p.name: _code_literals(p) for p in (ROOT / "client").glob("*.py")}
    assert {name: codes for name, codes in spelled.items() if codes} == {}


def test_the_reactions_import_only_the_standard_library_and_the_shared_messages():
    tree = ast.parse(Path(volunteer.__file__).read_text())
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    ours = {m for m in imported if m and m.split(".")[0] not in sys.stdlib_module_names}
    assert ours == {"diloco.protocol.messages"}, imported
