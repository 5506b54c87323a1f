"""Closing a round: aggregate -> outer step -> checkpoint files -> one transaction.

Exactly once, also with several servers and crashes at any point:
- ``open -> closing`` is a guarded ``UPDATE ... WHERE state = 'open'``: one sweeper wins.
- The work on a ``closing`` round happens under ``SELECT ... FOR UPDATE SKIP LOCKED``:
  whoever holds the row lock does it, the others skip; if the worker dies, Postgres drops
  its lock and the next sweep redoes the work from the same inputs (the step is
  deterministic, and the files are written by atomic rename, so a rewrite is harmless).
- The checkpoint files exist before the transaction that marks the round closed, publishes
  the version and opens the next round commits (commit or discard, never half-apply).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.codec import make_codec
from diloco.config import RunConfig
from diloco.exchange import aggregate_upload
from diloco.model import GPT
from diloco.outer import Aggregator, OuterOptimizer
from diloco.train import evaluate, load_parameters
from server.checkpoints import service as checkpoints_service
from server.checkpoints.models import Checkpoint
from server.metrics import CLOSE_SECONDS, CLOSE_STAGE_SECONDS, ROUNDS_CLOSED
from server.rounds import service as rounds_service
from server.rounds.models import Contribution, Round
from server.rounds.policy import Action, RoundState
from server.runs import data as run_data
from server.runs.models import Run, RunStatus
from server.settings import Settings
from server.storage import Storage

log = logging.getLogger("diloco.rounds")


@dataclass(frozen=True)
class OuterResult:
    files: checkpoints_service.VersionFiles
    update_norm: float
    eval_loss: float
    seconds: dict[str, float]  # by stage: load, aggregate, step, eval, write


def apply_outer_step(
    storage: Storage,
    *,
    run_id: str,
    cfg: RunConfig,
    base_state_key: str,
    blobs: list[str],
    version: int,
    eval_windows: int,
) -> OuterResult:
    """Read the base state, add the contributions one at a time (memory O(model)), step,
    evaluate on the validation split and write version ``version``. Pure given its inputs."""
    clock = _StageClock()
    base = checkpoints_service.load_checkpoint(storage.path(base_state_key))
    outer = OuterOptimizer(
        base.params, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov
    )
    if base.outer_state is not None:
        outer.load_state_dict(base.outer_state)
    shapes = {n: tuple(p.shape) for n, p in outer.params.items()}
    codec = make_codec(cfg.compression.kind, cfg.compression.block_size).describe()
    aggregator = Aggregator(shapes)
    clock.lap("load")
    for key in blobs:  # each weighted by the tokens in its header
        aggregate_upload(storage.read_chunks(key), aggregator, expected=shapes, codec=codec)
    clock.lap("aggregate")
    update_norm = outer.step(aggregator.result())
    clock.lap("step")
    model = GPT(cfg.model.gpt_config())
    load_parameters(model, outer.params)
    val = run_data.load_val(storage, run_id)
    eval_loss = evaluate(model, val, block_size=cfg.model.block_size, max_windows=eval_windows)
    clock.lap("eval")
    files = checkpoints_service.write_version(
        storage, run_id=run_id, version=version, params=outer.params, outer_state=outer.state_dict()
    )
    clock.lap("write")
    return OuterResult(files, update_norm, eval_loss, clock.seconds)


class _StageClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self._last
        self._last = now


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


async def finish_close(
    *,
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    settings: Settings,
    run_id: str,
    index: int,
) -> bool:
    """closing -> closed, with the outer step; False when someone else holds the round."""
    async with sessions() as session, session.begin():
        rnd = await session.scalar(
            select(Round)
            .where(Round.run_id == run_id, Round.index == index, Round.state == RoundState.CLOSING)
            .with_for_update(skip_locked=True)
        )
        if rnd is None:
            return False
        run = await session.get_one(Run, run_id)
        cfg = rounds_service.run_config(run)
        contributions = list(
            await session.scalars(
                select(Contribution)
                .where(Contribution.run_id == run_id, Contribution.round_index == index)
                .order_by(Contribution.created_at, Contribution.id)  # a fixed order: determinism
            )
        )
        base = await checkpoints_service.get(
            session=session, run_id=run_id, version=rnd.base_version
        )
        started = datetime.now(UTC)
        result = await asyncio.to_thread(
            apply_outer_step,
            storage,
            run_id=run_id,
            cfg=cfg,
            base_state_key=base.state_key,
            blobs=[c.blob_key for c in contributions],
            version=index,
            eval_windows=settings.eval_windows,
        )
        now = datetime.now(UTC)
        tokens = sum(c.tokens for c in contributions)
        rnd.state = RoundState.CLOSED
        rnd.closed_at = now
        rnd.accepted = len(contributions)
        rnd.tokens = tokens
        rnd.train_loss = sum(c.loss * c.tokens for c in contributions) / tokens if tokens else None
        rnd.eval_loss = result.eval_loss
        rnd.update_norm = result.update_norm
        session.add(
            checkpoints_service.row_for(result.files, run_id=run_id, eval_loss=result.eval_loss)
        )
        await award_credit(session=session, run=run, contributions=contributions, now=now)
        run.checkpoint_version = index
        if index >= cfg.rounds.max_rounds:
            run.status = RunStatus.COMPLETED
        else:
            await rounds_service.open_round(session=session, run=run, index=index + 1, now=now)
    ROUNDS_CLOSED.labels(rnd.close_code or "unknown").inc()
    CLOSE_SECONDS.observe((now - started).total_seconds())
    for stage, seconds in result.seconds.items():
        CLOSE_STAGE_SECONDS.labels(stage).observe(seconds)
    log.info(
        "run %s round %d closed (%s): %d contributions, eval loss %.4f, update norm %.4g, %.2f s",
        run_id,
        index,
        rnd.close_code,
        len(contributions),
        result.eval_loss,
        result.update_norm,
        (now - started).total_seconds(),
    )
    return True


# Training a transformer costs about 6 FLOPs per parameter per token (forward 2, backward 4)
TRAIN_FLOPS_PER_PARAM_TOKEN = 6


async def award_credit(
    *, session: AsyncSession, run: Run, contributions: list[Contribution], now: datetime
) -> None:
    """Credit exactly the contributions that went into this outer step, in the transaction
    that publishes it: the training FLOPs they did, tokens x 6 x n_params. Nothing else ever
    earns credit (a round that never closes leaves its contributions at 0)."""
    if not contributions:
        return
    flops_per_token = float(TRAIN_FLOPS_PER_PARAM_TOKEN * run.n_params)
    await session.execute(
        update(Contribution)
        .where(Contribution.id.in_([c.id for c in contributions]))
        .values(aggregated_at=now, credit=Contribution.tokens * flops_per_token)
        .execution_options(synchronize_session=False)
    )


async def sweep_once(
    *, sessions: async_sessionmaker[AsyncSession], storage: Storage, settings: Settings
) -> int:
    """One pass over every unfinished round: decide, extend or close. Returns rounds closed."""
    now = datetime.now(UTC)
    closed = 0
    async with sessions() as session:
        pending = (
            await session.execute(
                select(Round.run_id, Round.index, Round.state, Run.status)
                .join(Run, Run.id == Round.run_id)
                .where(Round.state != RoundState.CLOSED)
                .order_by(Round.run_id, Round.index)
            )
        ).all()
    for run_id, index, state, status in pending:
        if state == RoundState.OPEN:
            if status != RunStatus.ACTIVE:
                continue  # paused or cancelled: the round waits
            if not await _decide_and_mark(sessions, settings, run_id, index, now):
                continue
        if await finish_close(
            sessions=sessions, storage=storage, settings=settings, run_id=run_id, index=index
        ):
            closed += 1
    return closed


async def _decide_and_mark(
    sessions: async_sessionmaker[AsyncSession],
    settings: Settings,
    run_id: str,
    index: int,
    now: datetime,
) -> bool:
    """Ask decide_close about an open round and persist the decision; True to close now."""
    async with sessions() as session, session.begin():
        rnd = await session.get_one(Round, (run_id, index))
        run = await session.get_one(Run, run_id)
        cfg = rounds_service.run_config(run)
        _, decision = await rounds_service.decide(
            session=session, rnd=rnd, cfg=cfg, settings=settings, now=now
        )
        if decision.action is Action.CLOSE:
            return await mark_closing(
                session=session,
                run_id=run_id,
                index=index,
                code=decision.code,
                reason=decision.reason,
            )
        if decision.action is Action.EXTEND and decision.new_deadline is not None:
            await session.execute(
                update(Round)
                .where(
                    Round.run_id == run_id,
                    Round.index == index,
                    Round.state == RoundState.OPEN,
                    Round.deadline == rnd.deadline,
                )
                .values(
                    deadline=decision.new_deadline,
                    extensions=Round.extensions + 1,
                    close_code=decision.code,
                    close_reason=decision.reason,
                )
            )
            log.info("run %s round %d: %s", run_id, index, decision.reason)
    return False


class Sweeper:
    """The background task: sweep every ``sweep_interval_s``, or at once when woken (an
    accepted upload may have reached the target)."""

    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], storage: Storage, settings: Settings
    ) -> None:
        self.sessions, self.storage, self.settings = sessions, storage, settings
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        interval = timedelta(seconds=self.settings.sweep_interval_s).total_seconds()
        while True:
            try:
                await sweep_once(
                    sessions=self.sessions, storage=self.storage, settings=self.settings
                )
            except asyncio.CancelledError:
                raise
            except Exception:  # keep sweeping: one bad round must not stop every run
                log.exception("round sweep failed; retrying in %.1f s", interval)
            with contextlib.suppress(TimeoutError):  # no wake-up: the periodic sweep
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            self._wake.clear()


__all__ = [
    "Checkpoint",
    "Sweeper",
    "apply_outer_step",
    "award_credit",
    "finish_close",
    "sweep_once",
]
