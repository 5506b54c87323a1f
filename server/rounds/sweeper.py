"""The round worker: decide every open round, then close claimed ones, again and again.

Each pass (every ``sweep_interval_s``, or at once when a notification says an upload or a
lease release may let a round close):

1. **decide**: for every open round of an active run, ``decide_close`` in its own short
   transaction: close (open -> closing), extend the deadline, or wait. A round whose
   decision fails is logged and skipped; the others are decided all the same.
2. **close**: claim closing rounds, up to ``close_concurrency`` at once, each closed in its
   own task (``server.rounds.closing``). A slow close of one run never holds up the
   decisions of the others, and a failing one is recorded on its round and retried later.
3. **evaluate**: one published version whose eval loss is pending at a time, on a thread
   of its own (``server.rounds.version_eval``): never in the way of a close.
4. **score**: the uploads of open rounds by the loss, one at a time as they arrive, on a
   thread of their own (``server.rounds.arrival_scores``): what the close would otherwise
   compute after the deadline.
5. **fold**: the uploads of open folded rounds into their round's running sum, one at a
   time as they arrive, on a thread of their own (``server.rounds.folding``): the close
   then adds only what arrived since.
6. **rebuild**: a published version whose full files its closer did not make durable (it
   died, or failed), one at a time, on the close threads (``server.rounds.full_files``).

Any number of processes (role ``all`` or ``worker``) may run this loop on one database:
the guarded transitions and claims make each round close exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.faults import FaultInjector
from diloco.protocol.state import Action, RoundState
from server.rounds import arrival_scores, folding, full_files, version_eval
from server.rounds import service as rounds_service
from server.rounds.closing import Claim, claim_next, close_claimed, mark_closing
from server.rounds.models import Round
from server.runs.models import Run, RunStatus
from server.settings import Settings
from server.storage.base import Storage
from server.upkeep import memory
from server.webhooks import events as webhooks

log = logging.getLogger("diloco.rounds")


class Sweeper:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        storage: Storage,
        settings: Settings,
        faults: FaultInjector | None = None,
    ) -> None:
        self.sessions, self.storage, self.settings = sessions, storage, settings
        self.faults = faults or FaultInjector()
        self._wake = asyncio.Event()
        self._closing: set[asyncio.Task[bool]] = set()
        self._evaluating: asyncio.Task[None] | None = None
        self._scoring: asyncio.Task[None] | None = None
        self._folding: asyncio.Task[None] | None = None
        self._rebuilding: asyncio.Task[None] | None = None
        # the closes' compute, on threads of their own at a lower OS priority, so that the
        # requests this process serves meanwhile get the CPU first (no request waits on a
        # close); their GIL share is small: the compute is torch and file I/O
        self.executor = ThreadPoolExecutor(
            max_workers=settings.close_concurrency,
            thread_name_prefix="close",
            initializer=lower_priority,
            initargs=(settings.close_nice,),
        )
        self.eval_executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="eval",
            initializer=lower_priority,
            initargs=(settings.close_nice,),
        )
        self.score_executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="score",
            initializer=lower_priority,
            initargs=(settings.close_nice,),
        )
        # folds at the requests' priority: a fold is the rest of taking an upload in (less
        # CPU than its ingest), and one starved until the deadline is read by the close
        # instead, on the critical path (bench/arrivals.py: at nice 10, 1 in 6 folded)
        self.fold_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fold")
        self.fold_process = folding.FoldProcess()  # what the fold thread waits on

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        interval = self.settings.sweep_interval_s
        try:
            while True:
                self._wake.clear()
                try:
                    await self.sweep()
                except asyncio.CancelledError:
                    raise
                except Exception:  # the database went away, say: log it and sweep again
                    log.exception("round sweep failed; retrying in %.1f s", interval)
                with contextlib.suppress(TimeoutError):  # no wake-up: the periodic sweep
                    await asyncio.wait_for(self._wake.wait(), timeout=interval)
        finally:
            background = (self._evaluating, self._scoring, self._folding, self._rebuilding)
            tasks = [*self._closing, *(t for t in background if t)]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            executors = (self.executor, self.eval_executor, self.score_executor, self.fold_executor)
            for executor in executors:
                executor.shutdown(wait=False, cancel_futures=True)
            self.fold_process.shutdown()

    async def sweep(self) -> None:
        """One pass: decide every open round, then start closes up to the concurrency."""
        now = datetime.now(UTC)
        for run_id, index in await self._open_rounds():
            try:
                await self._decide(run_id, index, now)
            except asyncio.CancelledError:
                raise
            except Exception:  # one round's failure must not keep the others undecided
                log.exception("run %s round %d: deciding failed; next sweep retries", run_id, index)
        while len(self._closing) < self.settings.close_concurrency:
            claim = await claim_next(sessions=self.sessions, settings=self.settings, now=now)
            if claim is None:
                break
            task = asyncio.create_task(
                self._close(claim), name=f"close {claim.run_id}/{claim.index}"
            )
            self._closing.add(task)
            task.add_done_callback(self._closed)
        if self._evaluating is None:
            self._evaluating = asyncio.create_task(self._evaluate(), name="evaluate")
        if self._rebuilding is None:
            self._rebuilding = asyncio.create_task(self._rebuild(), name="rebuild")
        if self._scoring is None and not self._closing:  # never beside a close: memory
            self._scoring = asyncio.create_task(self._score(), name="score")
        if self._folding is None:  # a few chunks of memory: beside closes too
            self._folding = asyncio.create_task(self._fold(), name="fold")

    async def _evaluate(self) -> None:
        """Evaluate pending versions, one after the other, while there are any."""
        try:
            await _drain(
                "evaluating pending versions",
                lambda: version_eval.evaluate_next(
                    self.sessions, self.storage, self.settings, self.eval_executor, self.faults
                ),
            )
        finally:
            self._evaluating = None

    async def _rebuild(self) -> None:
        """Rebuild the full files of versions whose closer left them, one after the other."""
        try:
            await _drain(
                "rebuilding full files",
                lambda: full_files.finish_next(
                    self.sessions, self.storage, self.settings, self.executor, self.faults
                ),
            )
        finally:
            self._rebuilding = None  # the mark notifies the round workers: a close waits

    async def _score(self) -> None:
        """Score arrived uploads, one after the other, while there are any and no close
        runs in this process: a score holds the model three times in memory, and none
        starts beside a close (one in progress when a close starts ends first, in seconds;
        the close does not wait for it)."""
        try:
            await _drain(
                "scoring arrived uploads",
                lambda: arrival_scores.score_next(
                    self.sessions, self.storage, self.score_executor, self.faults
                ),
                until=lambda: bool(self._closing),
            )
        finally:
            self._scoring = None

    async def _fold(self) -> None:
        """Fold arrived uploads into their rounds' sums, one after the other, while there
        are any (a round's close and its folds never overlap: ``server.rounds.folding``)."""
        try:
            await _drain(
                "folding arrived uploads",
                lambda: folding.fold_next(
                    self.sessions,
                    self.storage,
                    self.fold_executor,
                    self.fold_process,
                    self.faults,
                ),
            )
        finally:
            self._folding = None

    def _closed(self, task: asyncio.Task[bool]) -> None:
        self._closing.discard(task)
        memory.settle_if_imported()  # the outer step's SGD brought torch._dynamo, say
        self.wake()  # a slot is free, the next round may already be decidable, and the
        # version just published waits for its eval

    async def _close(self, claim: Claim) -> bool:
        return await close_claimed(
            sessions=self.sessions,
            storage=self.storage,
            settings=self.settings,
            faults=self.faults,
            claim=claim,
            executor=self.executor,
        )

    async def _open_rounds(self) -> list[tuple[str, int]]:
        async with self.sessions() as session:
            rows = await session.execute(
                select(Round.run_id, Round.index)
                .join(Run, Run.id == Round.run_id)
                .where(Round.state == RoundState.OPEN, Run.status == RunStatus.ACTIVE)
                .order_by(Round.run_id, Round.index)
            )
            return [(run_id, index) for run_id, index in rows]

    async def _decide(self, run_id: str, index: int, now: datetime) -> None:
        """Ask decide_close about an open round and persist the decision."""
        async with self.sessions() as session, session.begin():
            rnd = await session.get_one(Round, (run_id, index))
            run = await session.get_one(Run, run_id)
            if rnd.state != RoundState.OPEN or run.status != RunStatus.ACTIVE:
                return  # changed since the scan
            cfg = rounds_service.run_config(run)
            decision = await rounds_service.decide(session=session, rnd=rnd, cfg=cfg, now=now)
            if decision.action is Action.CLOSE:
                await mark_closing(
                    session=session,
                    run_id=run_id,
                    index=index,
                    code=decision.code,
                    reason=decision.reason,
                )
            elif decision.action is Action.EXTEND and decision.new_deadline is not None:
                extended = await session.scalar(
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
                    .returning(Round.extensions)
                )
                if extended is None:
                    return  # another worker extended it first
                await webhooks.emit(
                    session,
                    run_id=run_id,
                    event="round.stalled",
                    data={
                        "round": index,
                        "reason": decision.reason,
                        "extensions": extended,
                        "deadline": decision.new_deadline.isoformat(),
                    },
                    now=now,
                )
                log.info("run %s round %d: %s", run_id, index, decision.reason)


async def _drain(
    what: str,
    step: Callable[[], Awaitable[bool]],
    until: Callable[[], bool] = lambda: False,
) -> None:
    """``step`` again and again while it finds work (and ``until`` says go on); a failure
    is logged, and the next sweep starts it again (the database went away, say)."""
    try:
        while not until() and await step():
            pass
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("%s failed; the next sweep retries", what)


def lower_priority(nice: int) -> None:
    """Lower this thread's OS priority by ``nice`` (Linux sets it per thread; elsewhere, or
    where not permitted, the thread keeps its priority and says so once)."""
    if nice <= 0:
        return
    try:
        current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), current + nice)
    except (AttributeError, OSError) as err:
        log.info("close threads keep their priority (%s)", err)
