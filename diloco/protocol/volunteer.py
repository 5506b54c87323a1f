"""What a volunteer does on each answer of the server: the one definition of its reactions.

The volunteer client (``client.worker``, ``client.uploading``) and the simulator's
volunteers (``diloco.simulate.events``) both feed every answer they get to :func:`step`
and do what the :class:`Reaction` says; how they do it (a thread that trains and an HTTP
session, or events on a simulated clock) is theirs. The constants the reactions use live
here too, so that no side copies a number.

A volunteer's loop, as the table below drives it:

- **pick a run** (no ``--run`` given): none active → ``WAIT`` with a bounded backoff
  (``NO_RUN_FIRST_WAIT_S`` doubling up to ``NO_RUN_MAX_WAIT_S``), then ask again.
- **join**: a lease → ``TRAIN``; the run paused → ``WAIT`` ``POLL_S``; ``round_closing``
  or ``already_contributed`` → ``WAIT`` the answer's ``retry_after_s`` (clamped to
  ``[MIN_WAIT_S, MAX_WAIT_S]``); the run completed or cancelled → ``STOP``.
- **heartbeat** (every ``heartbeat_every(lease's heartbeat_interval_s)``): renewed →
  ``CARRY_ON``; ``round_closed`` while the run still merges the work late
  (``diloco.protocol.late``) → ``CARRY_ON`` (finish it and upload); the lease lost
  (``LOST_LEASE_CODES``: ``round_closed``, ``no_lease``, ``run_not_active``) →
  ``ABANDON``: stop training, drop the work, join again; anything else (the server busy
  or failing after the HTTP layer's retries) → ``WARN`` and train on.
- **upload**: accepted (fresh or late) → ``DONE``; ``round_closed`` for work still welcome
  late (its round, or the round in progress, is closing) → ``SEND_AGAIN`` after
  ``LATE_RETRY_S``, doubling, for at most ``MAX_WAIT_S`` in all; the round moved on
  (``MOVED_ON_CODES``) or the server too busy (``BUSY_CODES``) → ``DROP`` and join again;
  the body refused → ``REFUSED``, and ``MAX_INVALID_IN_A_ROW`` of those in a row →
  ``FATAL`` (this client may not match the server's version).
- **release** (stopping): given back, or nothing was held → ``DONE``; else ``WARN``.
- Anywhere: who we are refused (``FATAL_CODES``) → ``FATAL``. A join or an upload answered
  with a server error (5xx) that the HTTP layer already tried again with backoff
  (``client.http``), or a join answered with a code not listed here → ``FATAL``.

Plain data in and out: no torch, no clock, no HTTP (imports only the shared messages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from diloco.protocol.messages import ErrorCode

# ---------------------------------------------------------------- the constants

MIN_WAIT_S = 0.5  # never ask again sooner than this, whatever ``retry_after_s`` says
MAX_WAIT_S = 120.0  # nor wait longer than this for one answer's sake
POLL_S = 15.0  # how often to ask again while the run is paused (its answer names no time)
MIN_HEARTBEAT_S = 1.0  # heartbeats no more often than this, whatever the lease says
# how long to wait before sending late work again while its round, or the round in
# progress, is still closing (a close takes seconds; the next round then opens); doubles
LATE_RETRY_S = 2.0
# the server refused our upload itself (not the round's timing): worth a few more rounds,
# in case it was one bad round, but not forever (a client the server cannot read)
MAX_INVALID_IN_A_ROW = 3
# no active run to join yet: ask again after this, doubling up to the cap
NO_RUN_FIRST_WAIT_S = 1.0
NO_RUN_MAX_WAIT_S = 30.0

# ---------------------------------------------------------------- the codes it reacts to

# answers the volunteer side makes up itself (never sent by the server): the run list held
# no active run; the object store refused a direct upload's PUT (its signed URL expired,
# say: the upload is lost as when the round moves on; the next lease brings a fresh URL),
# or a download's signed URL (a new lease brings fresh URLs, the part file is resumed)
NO_ACTIVE_RUN = "no_active_run"
UPLOAD_TARGET_REFUSED = "upload_target_refused"
DOWNLOAD_URL_REFUSED = "download_url_refused"
CLIENT_CODES = frozenset({NO_ACTIVE_RUN, UPLOAD_TARGET_REFUSED, DOWNLOAD_URL_REFUSED})

# a heartbeat answer that means the lease is no longer worth training for (a paused or
# ended run takes no upload: the join that follows waits or stops)
LOST_LEASE_CODES = frozenset({ErrorCode.ROUND_CLOSED, ErrorCode.NO_LEASE, ErrorCode.RUN_NOT_ACTIVE})
# join again after the answer's retry_after_s: the round is closing, or we are in it already
RETRY_JOIN_CODES = frozenset({ErrorCode.ALREADY_CONTRIBUTED, ErrorCode.ROUND_CLOSING})
# an upload refused because the round moved on without us: drop the work, join again
MOVED_ON_CODES = frozenset(
    {
        ErrorCode.ROUND_CLOSED,
        ErrorCode.BASE_VERSION_MISMATCH,
        ErrorCode.NO_LEASE,
        ErrorCode.DUPLICATE_CONTRIBUTION,
        ErrorCode.RUN_NOT_ACTIVE,
        UPLOAD_TARGET_REFUSED,
    }
)
# an upload still refused after every retry (the HTTP layer waits the server's
# Retry-After): the server was too busy, or our connection too slow; not our body's fault
BUSY_CODES = frozenset({ErrorCode.TOO_MANY_UPLOADS, ErrorCode.REQUEST_TIMEOUT})
# who we are was refused: every request would be; stop
FATAL_CODES = frozenset(
    {
        ErrorCode.UNAUTHORIZED,
        ErrorCode.FORBIDDEN,
        ErrorCode.BANNED,
        ErrorCode.BANNED_FROM_RUN,
        ErrorCode.NOT_INVITED,
        ErrorCode.INVALID_INVITE,
    }
)


class Request(StrEnum):
    """The request an answer is to."""

    RUNS = "runs"  # which run to join (only without --run)
    JOIN = "join"
    HEARTBEAT = "heartbeat"
    UPLOAD = "upload"
    RELEASE = "release"


class Do(StrEnum):
    """What the volunteer does next."""

    JOIN = "join"  # a run to join was found: join it
    TRAIN = "train"  # a lease: download its inputs and train
    WAIT = "wait"  # ask again (pick a run, or join) after ``wait_s``
    STOP = "stop"  # the run ended: stop volunteering
    CARRY_ON = "carry_on"  # keep training this lease
    WARN = "warn"  # say why (once per kind), and carry on
    ABANDON = "abandon"  # the lease is lost: stop training, drop the work, join again
    SEND_AGAIN = "send_again"  # send the same upload again after ``wait_s``
    DONE = "done"  # the upload was accepted (or the lease given back): join again
    DROP = "drop"  # the upload was refused, not for its body: drop the work, join again
    REFUSED = "refused"  # the server refused the body: drop it, join again, and count it
    FATAL = "fatal"  # stop with the server's error


@dataclass(frozen=True)
class Answer:
    """One answer: ``code`` None is a success; ``status`` the HTTP status, where there is
    one (the simulator's refusals have none); ``body`` the answer's fields (for a lease:
    its ``round`` and its run's ``max_staleness``, ``staleness_bound`` of its config)."""

    to: Request
    code: str | None = None
    status: int | None = None
    body: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reaction:
    do: Do
    wait_s: float = 0.0  # for WAIT and SEND_AGAIN
    why: str = ""  # a sentence for the volunteer's log ("" for the plain path)


@dataclass(frozen=True)
class VolunteerState:
    """What the reactions remember between answers."""

    lease_round: int | None = None  # the round of the lease we train or upload for
    max_staleness: int = 0  # that run's [rounds] max_staleness (0: no late work)
    late_tries: int = 0  # this upload's sends again while a round was closing
    refused_in_a_row: int = 0  # uploads whose body the server refused, in a row
    no_run_tries: int = 0  # run lists in a row with no active run


def step(state: VolunteerState, answer: Answer) -> tuple[VolunteerState, Reaction]:
    """The volunteer's reaction to ``answer``, and what it remembers afterwards."""
    if answer.code in FATAL_CODES:
        return state, Reaction(Do.FATAL, why=f"{answer.code}")
    react = {
        Request.RUNS: _runs,
        Request.JOIN: _join,
        Request.HEARTBEAT: _heartbeat,
        Request.UPLOAD: _upload,
        Request.RELEASE: _release,
    }[answer.to]
    return react(state, answer)


def _runs(state: VolunteerState, answer: Answer) -> tuple[VolunteerState, Reaction]:
    if answer.code is None:
        return dataclasses.replace(state, no_run_tries=0), Reaction(Do.JOIN)
    wait = min(NO_RUN_MAX_WAIT_S, NO_RUN_FIRST_WAIT_S * 2.0**state.no_run_tries)
    state = dataclasses.replace(state, no_run_tries=state.no_run_tries + 1)
    return state, Reaction(Do.WAIT, wait, "no active run yet; waiting for one")


def _join(state: VolunteerState, answer: Answer) -> tuple[VolunteerState, Reaction]:
    body = answer.body
    if answer.code is None:
        granted = VolunteerState(
            lease_round=int(body["round"]),
            max_staleness=int(body.get("max_staleness", 0)),
            refused_in_a_row=state.refused_in_a_row,
        )
        return granted, Reaction(Do.TRAIN)
    if _server_error(answer):
        return state, Reaction(Do.FATAL, why=f"{answer.code}")
    if answer.code == ErrorCode.RUN_NOT_ACTIVE:
        status = body.get("status")
        if status == "paused":
            return state, Reaction(Do.WAIT, POLL_S, "the run is paused; waiting")
        return state, Reaction(Do.STOP, why=f"the run is {status}")
    if answer.code in RETRY_JOIN_CODES:
        wait = join_wait(body.get("retry_after_s"))
        return state, Reaction(Do.WAIT, wait, "waiting for the next round to open")
    return state, Reaction(Do.FATAL, why=f"{answer.code}")


def _heartbeat(state: VolunteerState, answer: Answer) -> tuple[VolunteerState, Reaction]:
    if answer.code is None:
        return state, Reaction(Do.CARRY_ON)
    if _still_welcome(state, answer):
        current = answer.body.get("current_round")
        return state, Reaction(
            Do.CARRY_ON,
            why=f"round {state.lease_round} closed; finishing it: the server merges late "
            f"work into round {current} or later",
        )
    if answer.code in LOST_LEASE_CODES:
        lost = f"lost our lease on round {state.lease_round} ({answer.code})"
        return dataclasses.replace(state, lease_round=None), Reaction(Do.ABANDON, why=lost)
    return state, Reaction(Do.WARN, why=f"{answer.code}")


def _upload(state: VolunteerState, answer: Answer) -> tuple[VolunteerState, Reaction]:
    if answer.code is None:
        done = dataclasses.replace(state, lease_round=None, late_tries=0, refused_in_a_row=0)
        return done, Reaction(Do.DONE)
    if _server_error(answer):
        return state, Reaction(Do.FATAL, why=f"{answer.code}")
    waited = LATE_RETRY_S * (2**state.late_tries - 1)
    if _still_welcome(state, answer) and waited <= MAX_WAIT_S:
        again = dataclasses.replace(state, late_tries=state.late_tries + 1)
        return again, Reaction(Do.SEND_AGAIN, LATE_RETRY_S * 2**state.late_tries)
    dropped = dataclasses.replace(state, lease_round=None, late_tries=0)
    if answer.code in MOVED_ON_CODES:
        return dropped, Reaction(Do.DROP, why="the round moved on without us")
    if answer.code in BUSY_CODES:
        return dropped, Reaction(Do.DROP, why="the server was too busy to take it")
    refused = dataclasses.replace(dropped, refused_in_a_row=state.refused_in_a_row + 1)
    if refused.refused_in_a_row >= MAX_INVALID_IN_A_ROW:
        why = (
            f"the server refused {refused.refused_in_a_row} contributions in a row; this "
            "client may not match the server's version: re-run the installer or pip "
            "install -U diloco-hub"
        )
        return refused, Reaction(Do.FATAL, why=why)
    return refused, Reaction(Do.REFUSED, why="the server refused our upload")


def _release(state: VolunteerState, answer: Answer) -> tuple[VolunteerState, Reaction]:
    released = dataclasses.replace(state, lease_round=None)
    if answer.code is None or answer.code in LOST_LEASE_CODES:  # given back, or none held
        return released, Reaction(Do.DONE)
    return released, Reaction(Do.WARN, why=f"{answer.code}")


def _server_error(answer: Answer) -> bool:
    """A 5xx: the HTTP layer already tried again with backoff (``client.http``)."""
    return answer.status is not None and answer.status >= 500


def _still_welcome(state: VolunteerState, answer: Answer) -> bool:
    return state.lease_round is not None and welcome_late(
        state.lease_round, str(answer.code), answer.body.get("current_round"), state.max_staleness
    )


# ---------------------------------------------------------------- the numbers it reads


def heartbeat_every(interval_s: float) -> float:
    """Seconds between two heartbeats, given the lease's ``heartbeat_interval_s``."""
    return max(MIN_HEARTBEAT_S, interval_s)


def join_wait(retry_after_s: object) -> float:
    """Seconds to wait before joining again, given the answer's ``retry_after_s`` (none:
    ``POLL_S``), clamped to ``[MIN_WAIT_S, MAX_WAIT_S]``."""
    ok = isinstance(retry_after_s, int | float) and not isinstance(retry_after_s, bool)
    wait = float(retry_after_s) if ok else POLL_S  # type: ignore[arg-type]
    return min(max(wait, MIN_WAIT_S), MAX_WAIT_S)


def staleness_bound(config: object) -> int:
    """A lease's run config's ``[rounds] max_staleness``: how many rounds on the run still
    merges work late (0, none, for a server from before late work)."""
    rounds = config.get("rounds") if isinstance(config, Mapping) else None
    bound = rounds.get("max_staleness", 0) if isinstance(rounds, Mapping) else 0
    return bound if isinstance(bound, int) and not isinstance(bound, bool) else 0


def worth_finishing(lease_round: int, current_round: int | None, max_staleness: int) -> bool:
    """Its round ``lease_round`` closed (or is closing) while the volunteer trained; is its
    work still welcome once done? Yes while the round in progress is at most
    ``max_staleness`` rounds on (a closing round: 0 on), and the run takes late work."""
    if max_staleness < 1 or current_round is None:
        return False
    return 0 <= current_round - lease_round <= max_staleness


def welcome_late(lease_round: int, code: str, current_round: object, max_staleness: int) -> bool:
    """The volunteer's reading of a refusal (a heartbeat's or an upload's) about its work
    for ``lease_round``: a ``round_closed`` naming a ``current_round`` the work may still
    join (``worth_finishing``) means finish it and upload, rather than abandon it."""
    current = current_round if isinstance(current_round, int) else None
    return code == ErrorCode.ROUND_CLOSED and worth_finishing(lease_round, current, max_staleness)
