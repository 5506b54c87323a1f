"""A version's eval loss, measured after it is published: off the round's critical path.

A close publishes its version as soon as the files are written (``server.rounds.closing``)
with the eval loss pending (NULL); the round worker then measures it here
(``server.checkpoints.evals.evaluate_file``) and fills it in on the checkpoint and on the
round that published it. The dashboard shows "pending" in between. Any process of the round
worker role may do it: one claims a pending version for ``EVAL_CLAIM_S``
(``eval_claim_expires_at``), and a version whose evaluator died is claimed again once that
expires; a failed eval is logged and tried again after ``close_retry_base_s``. A version
whose parameters are not yet durable (``server.rounds.full_files``) waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Executor
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.faults import FaultInjector
from server.checkpoints.evals import evaluate_file
from server.checkpoints.models import Checkpoint
from server.metrics import EVAL_SECONDS
from server.rounds.models import Round
from server.runs import service as runs_service
from server.settings import Settings
from server.storage.base import Storage
from server.storage.staging import Stage
from server.webhooks import events as webhooks

log = logging.getLogger("diloco.evals")
EVAL_CLAIM_S = 600.0


async def evaluate_next(
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    settings: Settings,
    executor: Executor,
    faults: FaultInjector,
) -> bool:
    """Claim the oldest pending version, measure its eval loss, fill it in; False when
    there was none to claim."""
    now = datetime.now(UTC)
    async with sessions() as session, session.begin():
        pending = (
            select(Checkpoint.run_id, Checkpoint.version)
            .where(
                Checkpoint.eval_loss.is_(None),
                Checkpoint.full_files_at.is_not(None),  # its parameters are durable
                (Checkpoint.eval_claim_expires_at.is_(None))
                | (Checkpoint.eval_claim_expires_at < now),
            )
            .order_by(Checkpoint.created_at)
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        row = (await session.execute(pending)).first()
        if row is None:
            return False
        run_id, version = row
        await session.execute(
            update(Checkpoint)
            .where(Checkpoint.run_id == run_id, Checkpoint.version == version)
            .values(eval_claim_expires_at=now + timedelta(seconds=EVAL_CLAIM_S))
        )
        ck = await session.get_one(Checkpoint, (run_id, version))
        run = await runs_service.get(session=session, run_id=run_id)
        cfg = runs_service.run_config(run)
        params_key = ck.params_key
    started = time.perf_counter()

    def measure() -> float:
        faults.hit("eval.version")
        with Stage(storage) as stage:
            return evaluate_file(
                storage,
                run_id=run_id,
                cfg=cfg,
                params_path=stage.input(params_key),
                windows=cfg.eval.windows,
            )

    try:
        loss = await asyncio.get_running_loop().run_in_executor(executor, measure)
    except (OSError, ValueError, RuntimeError) as err:  # a missing file, an injected fault
        retry = datetime.now(UTC) + timedelta(seconds=settings.close_retry_base_s)
        log.error(
            "run %s version %d: eval failed (%s: %s); tried again from %s",
            run_id, version, type(err).__name__, err, retry.isoformat(),
        )  # fmt: skip
        async with sessions() as session, session.begin():
            await session.execute(
                update(Checkpoint)
                .where(Checkpoint.run_id == run_id, Checkpoint.version == version)
                .values(eval_claim_expires_at=retry)
            )
        return True
    EVAL_SECONDS.observe(time.perf_counter() - started)
    await record(sessions, run_id=run_id, version=version, loss=loss)
    return True


async def fill_in(session: AsyncSession, *, run_id: str, version: int, loss: float) -> None:
    """A version's eval loss on its checkpoint (its eval claim released) and on the round
    that published it (the round of the same index; version 0 has none), in the caller's
    transaction."""
    await session.execute(
        update(Checkpoint)
        .where(Checkpoint.run_id == run_id, Checkpoint.version == version)
        .values(eval_loss=loss, eval_claim_expires_at=None)
    )
    await session.execute(
        update(Round).where(Round.run_id == run_id, Round.index == version).values(eval_loss=loss)
    )


async def record(
    sessions: async_sessionmaker[AsyncSession], *, run_id: str, version: int, loss: float
) -> None:
    """Fill a version's eval loss in, on its checkpoint and on the round that published it."""
    if not math.isfinite(loss):  # stored as it is (the API answers null): never pending again
        log.warning("run %s version %d: the eval loss is not finite", run_id, version)
    async with sessions() as session, session.begin():
        await fill_in(session, run_id=run_id, version=version, loss=loss)
        best = await session.scalar(
            select(func.min(Checkpoint.eval_loss)).where(
                Checkpoint.run_id == run_id,
                Checkpoint.version < version,
                Checkpoint.eval_loss < float("inf"),  # not NaN nor inf (Postgres sorts NaN last)
            )
        )
        if best is not None and best > 0 and math.isfinite(loss):
            await webhooks.emit(
                session,
                run_id=run_id,
                event="eval.rising",
                data={"version": version, "eval_loss": loss, "best": best, "ratio": loss / best},
                now=datetime.now(UTC),
                ratio=loss / best,
            )
    log.info("run %s version %d: eval loss %.4f", run_id, version, loss)
