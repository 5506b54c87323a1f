"""Uploads folded into their round's sum as they arrive (``diloco.outer.fold``), off the
close's critical path: after the deadline the close adds only what arrived since.

Each process of the round-work role folds the accepted uploads of open folded rounds, one
at a time on a thread of its own at low priority (``fold_next``), into running sums kept in
a folder of its own (``server.rounds.fold_sums``). Its own closes use them; a close in
another process (or after a restart) finds none and reads every upload: the same bits, more
time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.config import RunConfig
from diloco.faults import FaultInjector
from diloco.model.architectures import parameter_shapes
from diloco.outer.fold import FoldPlan, FoldState
from diloco.outer.robust import SourceUnreadable
from diloco.protocol.state import RoundState
from diloco.wire.exchange import codec_for
from server.metrics import FOLD_SECONDS
from server.rounds.close_inputs import norm_history, recent_changes
from server.rounds.fold_sums import Folds, folds_for
from server.rounds.models import Contribution, Round
from server.runs import service as runs_service
from server.runs.models import Run, RunStatus
from server.storage.base import Storage
from server.storage.staging import Stage

log = logging.getLogger("diloco.rounds")


@dataclass(frozen=True)
class _Job:
    run_id: str
    index: int
    cfg: RunConfig
    plan: FoldPlan
    seeds: list[int]
    contribution_id: str
    blob_key: str
    factor: float


async def fold_next(
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    executor: Executor,
    faults: FaultInjector,
) -> bool:
    """Fold one accepted upload of an open folded round that this process has not folded;
    False when there is none."""
    folds = folds_for(storage)
    async with sessions() as session:
        job = await _next_job(session, folds)
    if job is None:
        return False

    def work() -> None:
        faults.hit("fold.arrival")
        _fold(storage, folds, job)

    try:
        with FOLD_SECONDS.time():
            await asyncio.get_running_loop().run_in_executor(executor, work)
    except (SourceUnreadable, OSError, ValueError, RuntimeError) as err:
        folds.failed.add(job.contribution_id)
        log.warning(
            "run %s round %d: contribution %s not folded (%s: %s); its close reads it",
            job.run_id, job.index, job.contribution_id, type(err).__name__, err,
        )  # fmt: skip
    return True


async def _next_job(session: AsyncSession, folds: Folds) -> _Job | None:
    open_rounds = (
        await session.execute(
            select(Round.run_id, Round.index)
            .join(Run, Run.id == Round.run_id)
            .where(
                Round.state.in_([RoundState.OPEN, RoundState.CLOSING]),
                Run.status == RunStatus.ACTIVE,
            )
        )
    ).all()
    folds.keep_only({(r, i) for r, i in open_rounds})
    rows = await session.scalars(
        select(Contribution)
        .join(
            Round,
            (Round.run_id == Contribution.run_id) & (Round.index == Contribution.merged_into_round),
        )
        .join(Run, Run.id == Contribution.run_id)
        .where(
            Round.state == RoundState.OPEN,
            Run.status == RunStatus.ACTIVE,
            Contribution.excluded_code.is_(None),
            Contribution.aggregated_at.is_(None),
            Contribution.norm.is_not(None),
        )
        .order_by(Contribution.created_at, Contribution.id)
    )
    rounds: dict[tuple[str, int], _Round | None] = {}
    for c in rows:
        key = (c.run_id, c.merged_into_round)
        if key not in rounds:
            rounds[key] = await _round(session, *key, set(_folded_ids(folds.folder(*key))))
        r = rounds[key]
        if r is None or c.id in r.folded or c.id in folds.failed:
            continue
        factor = r.plan.factor(float(c.counted_weight), float(c.norm or 0.0))
        return _Job(c.run_id, key[1], r.cfg, r.plan, r.seeds, c.id, c.blob_key, factor)
    return None


def _folded_ids(folder: Path) -> list[str]:
    """The uploads a round's sum holds (read without trusting it: the fold checks)."""
    with contextlib.suppress(OSError, ValueError):
        return list(json.loads((folder / "meta.json").read_text()).get("ids", []))
    return []


@dataclass(frozen=True)
class _Round:
    cfg: RunConfig
    plan: FoldPlan
    seeds: list[int]  # the close's samplings: the round's own, then the recent changes'
    folded: set[str]


async def _round(session: AsyncSession, run_id: str, index: int, folded: set[str]) -> _Round | None:
    """What folding the round's uploads needs; None when it is not a folded round."""
    run = await runs_service.get(session=session, run_id=run_id)
    cfg = runs_service.run_config(run)
    plan = FoldPlan.of_run(cfg, await norm_history(session, run_id, cfg))
    if plan is None:
        return None
    rnd = await session.get_one(Round, (run_id, index))
    recent = await recent_changes(session, run_id, index)
    return _Round(cfg, plan, [rnd.check_seed, *(r.seed for r in recent)], folded)


def _fold(storage: Storage, folds: Folds, job: _Job) -> None:
    codec = codec_for(job.cfg.compression).describe()
    with folds.lock(job.run_id, job.index), Stage(storage) as stage:
        state = FoldState(folds.folder(job.run_id, job.index), parameter_shapes(job.cfg.model))
        path = stage.input(job.blob_key)
        state.fold(job.plan, job.seeds, job.contribution_id, path, codec, job.factor)
