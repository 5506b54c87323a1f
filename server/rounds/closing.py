"""Closing a round: claim, compute, publish. Exactly once, whatever crashes and however
many worker processes share the database.

1. **Claim** (one short transaction): a ``closing`` round whose claim is free or expired,
   and whose retry time has come, gets this worker's claim token until
   ``claim_expires_at``. The worker renews the claim while it computes; a worker that dies
   stops renewing, and another one takes the round over once the claim expires.
2. **Compute** (``server.rounds.outer_step``, in a thread): no transaction, row lock or
   pooled connection is held while the contributions are summed, the step applied and
   the version's files written (temp name, fsync, rename: a rewrite after a crash writes
   the same bytes): the delta committed, the parameters and outer state only written.
   Every step is judged on a small fixed sample before it is published
   (``diloco.outer.close``); the version's full eval loss is measured after publishing, off
   the critical path (``server.rounds.version_eval``).
3. **Publish** (one short transaction, guarded by the claim token): the round closed with
   its figures, the checkpoint row, credit, the run's status and the next round, all from
   ``diloco.protocol.outcome.close_effects``. A worker whose claim was taken over publishes
   nothing.
4. **Full files** (off the critical path: the next round is open): the version's parameters
   and outer state committed, and the row marked (``server.rounds.full_files``, which also
   rebuilds them when this process dies first). The next round's close waits for them.

A close that fails is recorded on the round (``error_code``, ``error``) and tried again
with backoff; it never stops another round's close. A close whose step used the work of a
contributor banned while it computed publishes nothing either (``contributor_banned``): it
is computed again at once, without that work (``server.rounds.bans``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping
from concurrent.futures import Executor
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.config.rounds import AuditSection
from diloco.faults import FaultInjector
from diloco.outer.checks import RECENT_CHANGES, suspect_figures
from diloco.protocol.audit import CreditStatus
from diloco.protocol.outcome import close_effects
from diloco.protocol.reputation import VERIFY_CODES
from diloco.protocol.state import Aggregated, CloseEffects, Decision, RoundState, RunStatus
from server.checkpoints import service as checkpoints_service
from server.checkpoints.models import Checkpoint
from server.metrics import CLOSE_SECONDS, CLOSE_STAGE_SECONDS, ROUNDS_CLOSED
from server.rounds import audit_draw, bans, claims, escrow, full_files, quarantine
from server.rounds import service as rounds_service
from server.rounds.claims import BannedInStep, Claim, claim_next
from server.rounds.close_inputs import pack_sample, read_inputs
from server.rounds.models import Contribution, Round
from server.rounds.outer_step import (
    OuterResult,
    apply_outer_step,
)
from server.runs import service as runs_service
from server.runs.models import Run
from server.settings import Settings
from server.storage.base import Storage
from server.webhooks import events as webhooks

log = logging.getLogger("diloco.rounds")


async def mark_closing(
    *, session: AsyncSession, run_id: str, index: int, code: str, reason: str
) -> bool:
    """open -> closing; False when another process got there first."""
    won = await session.scalar(
        update(Round)
        .where(Round.run_id == run_id, Round.index == index, Round.state == RoundState.OPEN)
        .values(state=RoundState.CLOSING, close_code=code, close_reason=reason)
        .returning(Round.index)
    )
    return won is not None


async def close_claimed(
    *,
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    settings: Settings,
    faults: FaultInjector,
    claim: Claim,
    executor: Executor,
) -> bool:
    """Compute and publish a claimed round; True when this worker published it. The compute
    runs on ``executor`` (the sweeper's low-priority close threads). Any failure is recorded
    on the round (retried later) instead of raised."""
    started = datetime.now(UTC)
    renewal = asyncio.create_task(claims.renew(sessions, settings, claim))
    pending: full_files.Pending | None = None  # the version's full files, not yet committed
    handed = False
    try:
        inputs, aggregated = await read_inputs(sessions, claim)
        faults.hit("close.claim")
        step = functools.partial(apply_outer_step, storage, inputs, faults=faults)
        result = await asyncio.get_running_loop().run_in_executor(executor, step)
        pending = result.pending
        if result.files is None:
            assert result.decision is not None
            await _reopen(sessions, claim, result)
            return False
        kept = [a for a in aggregated if a.contribution_id not in result.excluded]
        hold = datetime.now(UTC) + timedelta(seconds=settings.claim_ttl_s)
        code = await _publish(sessions, claim, result, kept, hold)
        if code is not None:
            faults.hit("close.publish")
        handed = code is not None  # published: its full files are committed next
    except asyncio.CancelledError:
        raise
    except BannedInStep as err:  # not a failure: computed again at once, without them
        log.warning("run %s round %d: %s", claim.run_id, claim.index, err)
        await claims.record_failure(sessions, settings, claim, err)
        return False
    except Exception as err:  # recorded on the round and retried: never stops other rounds
        log.exception(
            "run %s round %d: close attempt %d failed", claim.run_id, claim.index, claim.attempt
        )
        await claims.record_failure(sessions, settings, claim, err)
        return False
    finally:
        renewal.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewal
        if pending is not None and not handed:
            pending.discard()  # not published; or failed after publishing: a rebuild does it
    if code is None:
        return False
    to_delta = (datetime.now(UTC) - started).total_seconds()
    assert pending is not None
    durable = await full_files.commit_published(
        sessions=sessions, settings=settings, executor=executor, faults=faults,
        run_id=claim.run_id, version=claim.index, pending=pending,
    )  # fmt: skip
    to_full = (datetime.now(UTC) - started).total_seconds() if durable else None
    _observe(claim, code, result, to_delta, to_full)
    return True


async def _publish(
    sessions: async_sessionmaker[AsyncSession],
    claim: Claim,
    result: OuterResult,
    aggregated: list[Aggregated],
    hold: datetime,
) -> str | None:
    """closing -> closed, the version published (its full files pending, held by this
    process until ``hold``: ``server.rounds.full_files``) and the next round open, in one
    short transaction; the round's close code, or None when the claim is no longer ours."""
    assert result.files is not None and result.recipe is not None
    now = datetime.now(UTC)
    async with sessions() as session, session.begin():
        run = await runs_service.get(session=session, run_id=claim.run_id, lock="update")
        cfg = rounds_service.run_config(run)
        effects = close_effects(
            now,
            round=claim.index,
            run_status=RunStatus(run.status),
            aggregated=aggregated,
            n_params=run.n_params,
            max_rounds=cfg.rounds.max_rounds,
            timeout_s=cfg.rounds.timeout_s,
        )
        closed = _closed_values(result, effects, now)
        code = await session.scalar(
            update(Round).where(*claims.mine(claim)).values(**closed).returning(Round.close_code)
        )
        if code is None:
            log.warning("run %s round %d: claim lost before publishing", claim.run_id, claim.index)
            return None
        if banned := await bans.used_banned(
            session=session, contribution_ids=[a.contribution_id for a in aggregated]
        ):  # raising rolls this transaction back: nothing of this step is published
            raise BannedInStep(
                f"contributions {', '.join(banned)} were excluded by a ban or a quarantine "
                "while the step computed; computing it again without them"
            )
        await _exclude(session, result)
        session.add(
            checkpoints_service.row_for(
                result.files,
                run_id=claim.run_id,
                eval_loss=None,
                pending=(result.recipe.to_json(), hold),
            )
        )
        await _credit(session, claim.run_id, cfg.audit, result, effects.credit, now)
        cosines, aligned = suspect_figures(result.checks, result.shares)
        await audit_draw.suspect_at_close(
            session, cfg, run_id=claim.run_id, median_cosines=cosines, alignments=aligned, now=now
        )
        await session.execute(  # only the last few are compared with
            update(Round)
            .where(
                Round.run_id == claim.run_id,
                Round.index <= claim.index - RECENT_CHANGES,
                Round.change_sample.is_not(None),
            )
            .values(change_sample=None)
        )
        await _advance(session, run, claim, effects, now)
        await _review(session, result, now)
    log.info("run %s: %s", claim.run_id, effects.summary)
    return str(code)


def _closed_values(result: OuterResult, effects: CloseEffects, now: datetime) -> dict[str, object]:
    """What a published round's row becomes (its claim released)."""
    values: dict[str, object] = {
        "state": RoundState.CLOSED,
        "closed_at": now,
        "accepted": effects.accepted,
        "tokens": effects.tokens,
        "train_loss": effects.train_loss,
        "eval_loss": None,  # pending: server.rounds.version_eval measures it
        "update_norm": result.update_norm,
        "claim_token": None,
        "claim_expires_at": None,
        "retry_at": None,
        "change_sample": pack_sample(result.change_sample),
    }
    if result.decision is not None:  # some were left out: say so on the round
        values |= {
            "close_code": result.decision.code,
            "close_reason": func.coalesce(Round.close_reason, "decided")
            + "; "
            + result.decision.reason,
        }
    return values


async def _advance(
    session: AsyncSession, run: Run, claim: Claim, effects: CloseEffects, now: datetime
) -> None:
    """The run after a published round: its status (a webhook when it completes), its
    version, and its next round opened."""
    if effects.run_status == RunStatus.COMPLETED and run.status != RunStatus.COMPLETED:
        await webhooks.emit(
            session,
            run_id=claim.run_id,
            event="run.completed",
            data={"round": claim.index, "version": claim.index},
            now=now,
        )
    run.status = effects.run_status
    run.checkpoint_version = claim.index
    if effects.next_round is not None:
        await rounds_service.open_round(
            session=session, run=run, index=effects.next_round.index, now=now
        )


async def _review(session: AsyncSession, result: OuterResult, now: datetime) -> None:
    """Quarantine whom verification keeps failing (``server.rounds.quarantine``),
    once this close's exclusions and credit are written."""
    failed = [cid for cid, code in result.exclusion_codes.items() if code in VERIFY_CODES]
    if failed:
        who = await session.scalars(
            select(Contribution.contributor_id).where(Contribution.id.in_(failed))
        )
        await quarantine.review(session, list(who), now)


async def _credit(
    session: AsyncSession,
    run_id: str,
    audit: AuditSection,
    result: OuterResult,
    credit: Mapping[str, float],
    now: datetime,
) -> None:
    """Each contribution the step took: its credit (pending an audit where the run's
    escrow says so: ``server.rounds.escrow``) and what the step made of it, by a bulk
    UPDATE by primary key."""
    if not credit:
        return
    status = await escrow.at_close(session, run_id, audit, credit)
    await session.execute(
        update(Contribution),
        [
            {
                "id": cid,
                "credit": 0.0 if status[cid] == CreditStatus.FORFEITED else flops,
                "credit_status": status[cid],
                "aggregated_at": now,
                "cosine": result.shares[cid].cosine,
                "clip_factor": result.shares[cid].clip,
                "checks": _figures(result, cid),
            }
            for cid, flops in credit.items()
        ],
    )


async def _exclude(session: AsyncSession, result: OuterResult) -> None:
    """Record what the close left out, with what its checks measured."""
    if result.excluded:  # bulk UPDATE by primary key
        await session.execute(
            update(Contribution),
            [
                {
                    "id": cid,
                    "excluded_code": result.exclusion_codes[cid],
                    "excluded_reason": why,
                    "checks": _figures(result, cid),
                }
                for cid, why in result.excluded.items()
            ],
        )


def _figures(result: OuterResult, contribution_id: str) -> dict | None:
    check = result.checks.get(contribution_id)
    return None if check is None else check.figures()


async def _reopen(
    sessions: async_sessionmaker[AsyncSession], claim: Claim, result: OuterResult
) -> None:
    """Too few readable contributions left: back to open, to wait for more."""
    decision: Decision | None = result.decision
    assert decision is not None
    async with sessions() as session, session.begin():
        won = await session.scalar(
            update(Round)
            .where(*claims.mine(claim))
            .values(
                state=RoundState.OPEN,
                claim_token=None,
                claim_expires_at=None,
                close_code=decision.code,
                close_reason=decision.reason,
            )
            .returning(Round.index)
        )
        if won is not None:
            await _exclude(session, result)
            await _review(session, result, datetime.now(UTC))
    log.warning("run %s: %s", claim.run_id, decision.reason)


def _observe(
    claim: Claim, code: str, result: OuterResult, seconds: float, to_full: float | None
) -> None:
    """The close's figures: ``seconds`` from the claim to the version published (its delta
    durable: the critical path), ``to_full`` to its full files durable (None: they failed,
    a rebuild makes them)."""
    ROUNDS_CLOSED.labels(code).inc()
    CLOSE_SECONDS.observe(seconds)
    CLOSE_STAGE_SECONDS.labels("to_delta").observe(seconds)
    if to_full is not None:
        CLOSE_STAGE_SECONDS.labels("to_full").observe(to_full)
    for stage, spent in result.seconds.items():
        CLOSE_STAGE_SECONDS.labels(stage).observe(spent)
    judged = (
        "unjudged"
        if result.judge_loss is None
        else f"judged {result.judge_loss:.4f} against the base's {result.base_judge_loss:.4f}"
    )
    full = "failed: a rebuild makes them" if to_full is None else f"{to_full:.2f} s"
    log.info(
        "run %s round %d closed (%s): %s, eval pending, update norm %.4g, delta published in "
        "%.2f s, full files durable %s (attempt %d)",
        claim.run_id,
        claim.index,
        code,
        judged,
        result.update_norm or float("nan"),
        seconds,
        full,
        claim.attempt,
    )


__all__ = ["Checkpoint", "Claim", "claim_next", "close_claimed", "mark_closing"]
