"""Rounds: opening a round, restarting its deadline, what the protocol's rules see, and
the round views. Leases (join, heartbeat, release) are in ``server.rounds.leases``, uploads
in ``server.rounds.ingest``, closes in ``server.rounds.closing``.

The rules are ``diloco.protocol.rules``; the round states they decide are written in four
modules:

- a round is inserted ``open`` here (``open_round``: at run creation, and by the close that
  opens the next round);
- open -> open with a later deadline: here when a paused run resumes
  (``restart_deadline``), in ``server.rounds.sweeper`` when a round below quorum is
  extended;
- open -> closing: ``server.rounds.closing.mark_closing`` (the sweeper's guarded UPDATE);
  the close's claim on a closing round is ``server.rounds.claims``;
- closing -> closed (one short transaction that also publishes the checkpoint and opens the
  next round) and closing -> open (too few readable contributions left) in
  ``server.rounds.closing``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.config import RunConfig
from diloco.model.architectures import parameter_shapes
from diloco.protocol.outcome import step_totals
from diloco.protocol.rules import decide_close
from diloco.protocol.state import (
    Aggregated,
    ClosePolicy,
    ContributionView,
    Decision,
    LeaseView,
    RoundState,
    RoundView,
)
from diloco.wire.exchange import codec_for
from diloco.wire.header import PREFIX, body_bytes, specs_for
from server.contributors.models import Contributor
from server.http.errors import NotFound
from server.rounds.models import Contribution, Lease, Round
from server.rounds.schemas import RoundOut
from server.runs.models import Run, RunStatus
from server.runs.schemas import CloseError, CurrentRound, LeaseState
from server.runs.service import run_config  # also read as rounds_service.run_config
from server.settings import Settings


def close_policy(cfg: RunConfig) -> ClosePolicy:
    return ClosePolicy.of(cfg.rounds)


def view_of(rnd: Round) -> RoundView:
    return RoundView(
        index=rnd.index,
        opened_at=rnd.opened_at,
        deadline=rnd.deadline,
        state=RoundState(rnd.state),
        extensions=rnd.extensions,
    )


def model_shapes(cfg: RunConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the run's model (built on the meta device: no memory)."""
    return parameter_shapes(cfg.model)


def max_upload_bytes(cfg: RunConfig, settings: Settings) -> int:
    """The exact frame bytes of a contribution for this model and codec, plus header room."""
    return _frame_bytes(cfg, settings.upload_slack_bytes)


@lru_cache(maxsize=256)
def _frame_bytes(cfg: RunConfig, slack_bytes: int) -> int:
    """Worked out once per config (each join names it: ~0.1 ms of shapes and specs)."""
    codec = codec_for(cfg.compression)
    specs = specs_for(codec, model_shapes(cfg))
    return body_bytes(PREFIX.size + slack_bytes, specs)


# ---------------------------------------------------------------- rounds


async def open_round(*, session: AsyncSession, run: Run, index: int, now: datetime) -> Round:
    cfg = run_config(run)
    rnd = Round(
        run_id=run.id,
        index=index,
        state=RoundState.OPEN,
        base_version=index - 1,
        opened_at=now,
        deadline=now + timedelta(seconds=cfg.rounds.timeout_s),
        extensions=0,
        accepted=0,
        tokens=0,
    )
    session.add(rnd)
    return rnd


async def restart_deadline(*, session: AsyncSession, run: Run, now: datetime) -> None:
    cfg = run_config(run)
    await session.execute(
        update(Round)
        .where(Round.run_id == run.id, Round.state == RoundState.OPEN)
        .values(deadline=now + timedelta(seconds=cfg.rounds.timeout_s))
    )


async def current(*, session: AsyncSession, run_id: str) -> Round | None:
    """The round in progress (open or closing); None once the run has no more rounds."""
    return await session.scalar(
        select(Round)
        .where(Round.run_id == run_id, Round.state != RoundState.CLOSED)
        .order_by(Round.index.desc())
        .limit(1)
    )


async def last_closed(*, session: AsyncSession, run_id: str) -> Round | None:
    return await session.scalar(
        select(Round)
        .where(Round.run_id == run_id, Round.state == RoundState.CLOSED)
        .order_by(Round.index.desc())
        .limit(1)
    )


async def get_round(*, session: AsyncSession, run_id: str, index: int) -> Round:
    rnd = await session.get(Round, (run_id, index))
    if rnd is None:
        raise NotFound(f"run {run_id} has no round {index}")
    return rnd


async def round_views(
    *, session: AsyncSession, rnd: Round
) -> tuple[RoundView, list[ContributionView], list[LeaseView]]:
    """What decide_close needs, read from the database."""
    # the columns it needs, no ORM objects: a sweep reads every upload and lease of the
    # round after each upload and once a second (5,000 leases as ORM objects held the event
    # loop 45-120 ms, as rows 10-20 ms; a thousand uploads' rows, read after each of them,
    # took the CPU the folds needed: bench/arrivals.py)
    c = Contribution
    contributions = await session.execute(
        select(c.contributor_id, c.tokens, c.base_version, c.excluded_code).where(
            c.run_id == rnd.run_id, c.round_index == rnd.index
        )
    )
    leases = await session.execute(
        select(Lease.contributor_id, Lease.last_heartbeat, Lease.expires_at).where(
            Lease.run_id == rnd.run_id, Lease.round_index == rnd.index
        )
    )
    return (
        view_of(rnd),
        [
            ContributionView(
                contributor_id=contributor_id,
                accepted=True,
                tokens=tokens,
                base_version=base_version,
                excluded=excluded_code is not None,
            )
            for contributor_id, tokens, base_version, excluded_code in contributions
        ],
        [
            LeaseView(
                contributor_id=contributor_id,
                last_heartbeat=last_heartbeat,
                expires_at=expires_at,
            )
            for contributor_id, last_heartbeat, expires_at in leases
        ],
    )


async def decide(*, session: AsyncSession, rnd: Round, cfg: RunConfig, now: datetime) -> Decision:
    view, contributions, leases = await round_views(session=session, rnd=rnd)
    return decide_close(now, view, contributions, leases, close_policy(cfg))


async def current_view(
    *, session: AsyncSession, settings: Settings, run: Run, now: datetime
) -> CurrentRound | None:
    rnd = await current(session=session, run_id=run.id)
    if rnd is None:
        return None
    cfg = run_config(run)
    decision = await decide(session=session, rnd=rnd, cfg=cfg, now=now)
    so_far = (await steps_so_far(session=session, run_id=run.id, indices=[rnd.index])).get(
        rnd.index, NO_STEP
    )
    reason = decision.reason if rnd.state == RoundState.OPEN else closing_reason(rnd)
    if run.status != RunStatus.ACTIVE and rnd.state == RoundState.OPEN:
        reason = f"run is {run.status}"
    return CurrentRound(
        index=rnd.index,
        state=rnd.state,
        opened_at=rnd.opened_at,
        deadline=rnd.deadline,
        accepted=so_far.accepted,
        late=so_far.late,
        quorum=cfg.rounds.quorum,
        target=cfg.rounds.target,
        reason=reason,
        error=close_error(rnd),
        leases=await lease_states(session=session, rnd=rnd, now=now),
    )


def closing_reason(rnd: Round) -> str:
    """What a closing round is doing, as the dashboard says it."""
    if rnd.error_code is not None and rnd.claim_token is None and rnd.retry_at is not None:
        return f"closing: attempt {rnd.close_attempts} failed ({rnd.error_code}); retrying"
    return f"closing: {rnd.close_reason}" if rnd.close_reason else "closing"


def close_error(rnd: Round) -> CloseError | None:
    """The round's latest failed close attempt, if any (kept after a later success)."""
    if rnd.error_code is None or rnd.error is None or rnd.error_at is None:
        return None
    return CloseError(
        code=rnd.error_code,
        detail=rnd.error,
        at=rnd.error_at,
        attempts=rnd.close_attempts,
        retry_at=rnd.retry_at if rnd.state == RoundState.CLOSING else None,
    )


async def lease_states(*, session: AsyncSession, rnd: Round, now: datetime) -> list[LeaseState]:
    """Every lease on the round with its contributor's name and heartbeat age."""
    contributed = (
        select(Contribution.id)
        .where(
            Contribution.run_id == Lease.run_id,
            Contribution.round_index == Lease.round_index,
            Contribution.contributor_id == Lease.contributor_id,
        )
        .exists()
    )
    rows = await session.execute(
        select(Lease, Contributor.name, contributed)
        .join(Contributor, Contributor.id == Lease.contributor_id)
        .where(Lease.run_id == rnd.run_id, Lease.round_index == rnd.index)
        .order_by(Lease.issued_at, Lease.id)
    )
    return [
        LeaseState(
            contributor_id=lease.contributor_id,
            contributor_name=name,
            shard=lease.shard,
            issued_at=lease.issued_at,
            last_heartbeat=lease.last_heartbeat,
            heartbeat_age_s=max(0.0, (now - lease.last_heartbeat).total_seconds()),
            expires_at=lease.expires_at,
            live=lease.expires_at > now,
            contributed=bool(done),
            last_step=lease.last_step,
            last_loss=lease.last_loss,
            inner_steps=lease.inner_steps,
        )
        for lease, name, done in rows
    ]


# ---------------------------------------------------------------- a round's step


@dataclass(frozen=True)
class StepSoFar:
    """A round's step as its contributions stand: those taking part in it (accepted, not
    left out; its own and the late ones merged into it), how many of them are late, the
    tokens they count for and their token-weighted train loss (``step_totals``, as a close
    records them)."""

    accepted: int
    late: int
    tokens: int
    train_loss: float | None


NO_STEP = StepSoFar(0, 0, 0, None)


def aggregated(c: Contribution) -> Aggregated:
    """The contribution as a close's effects (and a round's figures so far) take it."""
    return Aggregated(c.id, c.contributor_id, c.discounted_weight, c.loss, c.earned)


def in_step(run_id: str) -> list[ColumnElement[bool]]:
    """The run's contributions that take part in a step: accepted and not left out."""
    return [Contribution.run_id == run_id, Contribution.excluded_code.is_(None)]


async def steps_so_far(
    *, session: AsyncSession, run_id: str, indices: Collection[int]
) -> dict[int, StepSoFar]:
    """The steps of rounds ``indices`` as their contributions stand (rounds with none
    are left out). For rounds not yet closed: a closed one has its figures recorded."""
    rows = await session.scalars(
        select(Contribution).where(
            *in_step(run_id), Contribution.merged_into_round.in_(list(indices))
        )
    )
    by_round: dict[int, list[Contribution]] = {}
    for c in rows:
        by_round.setdefault(c.merged_into_round, []).append(c)
    out = {}
    for index, taken in by_round.items():
        tokens, loss = step_totals([aggregated(c) for c in taken])
        late = sum(1 for c in taken if c.staleness > 0)
        out[index] = StepSoFar(len(taken), late, tokens, loss)
    return out


async def list_rounds(*, session: AsyncSession, run_id: str) -> list[RoundOut]:
    # by the step that takes them: a round's own contributions and the late ones merged in
    counted = await session.execute(
        select(Contribution.merged_into_round, func.count(Contribution.id))
        .where(*in_step(run_id), Contribution.staleness > 0)
        .group_by(Contribution.merged_into_round)
    )
    lates = {index: n for index, n in counted}
    rounds = list(
        await session.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.index))
    )
    live = await steps_so_far(
        session=session,
        run_id=run_id,
        indices=[r.index for r in rounds if r.state != RoundState.CLOSED],
    )
    out = []
    for r in rounds:
        accepted, tokens, train_loss = r.accepted, r.tokens, r.train_loss
        if r.state != RoundState.CLOSED:  # figures so far while open
            so_far = live.get(r.index, NO_STEP)
            accepted, tokens, train_loss = so_far.accepted, so_far.tokens, so_far.train_loss
        out.append(
            RoundOut(
                index=r.index,
                state=r.state,
                base_version=r.base_version,
                opened_at=r.opened_at,
                deadline=r.deadline,
                closed_at=r.closed_at,
                close_reason=r.close_reason,
                close_code=r.close_code,
                extensions=r.extensions,
                accepted=accepted,
                tokens=tokens,
                train_loss=train_loss,
                eval_loss=r.eval_loss,
                update_norm=r.update_norm,
                close_attempts=r.close_attempts,
                error=close_error(r),
                late=lates.get(r.index, 0),
            )
        )
    return out
