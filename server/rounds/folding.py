"""Uploads folded into their round's sum as they arrive (``diloco.outer.fold``), off the
close's critical path: after the deadline the close adds only what arrived since.

Each process of the round-work role folds the accepted uploads of open folded rounds, those
that arrived since its last pass (up to ``BATCH``) in one pass over the sum (``fold_next``),
into running sums kept in a folder of its own (``server.rounds.fold_sums``). Its own closes
use them; a close in another process (or after a restart) finds none and reads every
upload: the same bits, more time.

A pass's compute runs in a child process (``FoldProcess``): on the GIL of the requests'
event loop its thousands of short torch calls each waited their turn, and folds fell far
behind the uploads (bench/arrivals.py).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.config import RunConfig
from diloco.faults import FaultInjector
from diloco.model.architectures import parameter_shapes
from diloco.outer.fold import Arrival, FoldPlan, fold_files, folded_ids
from diloco.outer.robust import SourceUnreadable
from diloco.protocol.state import RoundState
from diloco.wire.exchange import codec_for
from server.metrics import FOLD_SECONDS, FOLDED_UPLOADS
from server.rounds.close_inputs import norm_history, recent_changes
from server.rounds.fold_sums import Folds, folds_for
from server.rounds.models import Contribution, Round
from server.runs import service as runs_service
from server.runs.models import Run, RunStatus
from server.storage.base import Storage
from server.storage.staging import Stage

log = logging.getLogger("diloco.rounds")


BATCH = 16  # uploads folded in one pass over the sum, at most


@dataclass(frozen=True)
class _Batch:
    run_id: str
    index: int
    cfg: RunConfig
    plan: FoldPlan
    seeds: list[int]
    arrivals: list[tuple[str, str, float]]  # (contribution id, blob key, factor)


class FoldProcess:
    """A child process for the folds' compute (spawned at the first fold; again after it
    died): it shares no GIL with the requests this process serves."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._guard = threading.Lock()

    def fold(self, *args: Any) -> None:
        """``diloco.outer.fold.fold_files(*args)`` in the child; RuntimeError if it died."""
        with self._guard:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_child_starts,
                    initargs=(os.getpid(),),
                )
            pool = self._pool
        try:
            pool.submit(fold_files, *args).result()
        except BrokenProcessPool as err:
            with self._guard:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise RuntimeError(f"the fold process died: {err}") from None

    def shutdown(self) -> None:
        with self._guard:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _child_starts(parent: int) -> None:
    """In the fold's child: one torch thread (one pass at a time, one core), and an exit
    as soon as its parent is gone. A pool's worker outlives a parent killed with SIGKILL
    (it holds its own queue's pipe open): it would hold its memory for good."""
    torch.set_num_threads(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


async def fold_next(
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    executor: Executor,
    process: FoldProcess,
    faults: FaultInjector,
) -> bool:
    """Fold the accepted uploads of an open folded round that this process has not folded
    (up to ``BATCH``, in one pass over its sum: a busy round folds more at a time); False
    when there are none."""
    folds = folds_for(storage)
    async with sessions() as session:
        batch = await _next_batch(session, folds)
    if batch is None:
        return False

    def work() -> None:
        faults.hit("fold.arrival")
        _fold(storage, folds, batch, process)

    ids = [cid for cid, _, _ in batch.arrivals]
    try:
        with FOLD_SECONDS.time():
            await asyncio.get_running_loop().run_in_executor(executor, work)
        FOLDED_UPLOADS.inc(len(ids))
    except (SourceUnreadable, OSError, ValueError, RuntimeError) as err:
        # the upload that could not be read is left to the close; the others of the batch
        # are folded again next time, into a sum started afresh if this one was touched
        culprits = [err.source_id] if isinstance(err, SourceUnreadable) else ids
        folds.failed.update(culprits)
        log.warning(
            "run %s round %d: contributions %s not folded (%s: %s); its close reads them",
            batch.run_id, batch.index, culprits, type(err).__name__, err,
        )  # fmt: skip
    return True


async def _next_batch(session: AsyncSession, folds: Folds) -> _Batch | None:
    """The next uploads to fold, of one round: accepted, not folded here, not failed."""
    open_rounds = (
        await session.execute(
            select(Round.run_id, Round.index, Round.state)
            .join(Run, Run.id == Round.run_id)
            .where(
                Round.state.in_([RoundState.OPEN, RoundState.CLOSING]),
                Run.status == RunStatus.ACTIVE,
            )
            .order_by(Round.run_id, Round.index)
        )
    ).all()
    folds.keep_only({(r, i) for r, i, _ in open_rounds})
    for run_id, index, state in open_rounds:
        if state != RoundState.OPEN:
            continue
        done = set(folded_ids(folds.folder(run_id, index))) | folds.failed
        rows = list(
            await session.scalars(
                select(Contribution)
                .where(
                    Contribution.run_id == run_id,
                    Contribution.merged_into_round == index,
                    Contribution.excluded_code.is_(None),
                    Contribution.aggregated_at.is_(None),
                    Contribution.norm.is_not(None),
                    Contribution.id.not_in(done),
                )
                .order_by(Contribution.created_at, Contribution.id)
                .limit(BATCH)
            )
        )
        if not rows:
            continue
        r = await _round(session, run_id, index)
        if r is None:
            continue
        arrivals = [
            (c.id, c.blob_key, r.plan.factor(float(c.counted_weight), float(c.norm or 0.0)))
            for c in rows
        ]
        return _Batch(run_id, index, r.cfg, r.plan, r.seeds, arrivals)
    return None


@dataclass(frozen=True)
class _Round:
    cfg: RunConfig
    plan: FoldPlan
    seeds: list[int]  # the close's samplings: the round's own, then the recent changes'


async def _round(session: AsyncSession, run_id: str, index: int) -> _Round | None:
    """What folding the round's uploads needs; None when it is not a folded round."""
    run = await runs_service.get(session=session, run_id=run_id)
    cfg = runs_service.run_config(run)
    plan = FoldPlan.of_run(cfg, await norm_history(session, run_id, cfg))
    if plan is None:
        return None
    rnd = await session.get_one(Round, (run_id, index))
    recent = await recent_changes(session, run_id, index)
    return _Round(cfg, plan, [rnd.check_seed, *(r.seed for r in recent)])


def _fold(storage: Storage, folds: Folds, batch: _Batch, process: FoldProcess) -> None:
    codec = codec_for(batch.cfg.compression).describe()
    with folds.lock(batch.run_id, batch.index), Stage(storage) as stage:
        # a blob that cannot be fetched has no path: UploadFile names it unreadable
        paths = stage.inputs([key for _, key, _ in batch.arrivals], missing_ok=True)
        missing = Path("/nonexistent")
        arrivals = [Arrival(cid, paths.get(key, missing), f) for cid, key, f in batch.arrivals]
        folder = folds.folder(batch.run_id, batch.index)
        shapes = parameter_shapes(batch.cfg.model)
        process.fold(folder, shapes, batch.plan, batch.seeds, arrivals, codec)
