"""Scores by the loss taken as uploads arrive, off the close's critical path.

An upload's score (``diloco.outer.scoring``: applied alone to the round's base, the loss on
windows drawn across its lease's data and on the validation sample) depends on nothing else of the
round, so the round worker takes it while the round is still open: the close then only
scores what arrived too late (``diloco.outer.close`` uses a stored score as it is). At a
hundred million parameters one score is a few forward passes of the whole model, seconds
each on a CPU: in the close, a round of eight would wait minutes for them.

Any process of the round worker role may score: one claims the oldest unscored
contribution of an open round for ``CLAIM_S`` (``score_claim_expires_at``), scores it on a
thread of its own at low priority and stores the figures (``Contribution.score``). One
whose scorer died is claimed again once that expires; one that cannot be scored (late work,
its lease's data gone, scoring off) is marked ``{}`` and left to the close, as is one whose
round closed meanwhile (the close wrote its checks, and nothing here overwrites them).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import exists, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.config import RunConfig
from diloco.faults import FaultInjector
from diloco.outer.scoring import Score, Scorer
from diloco.protocol.state import RoundState
from server.checkpoints import service as checkpoints_service
from server.checkpoints.models import Checkpoint
from server.metrics import SCORE_SECONDS
from server.rounds.close_inputs import lease_data
from server.rounds.models import Contribution, Round
from server.rounds.outer_step import LeaseData, read_lease_windows, score_sample
from server.runs import service as runs_service
from server.runs.models import Run, RunStatus
from server.storage.base import Storage
from server.storage.staging import Stage

log = logging.getLogger("diloco.rounds")
CLAIM_S = 600.0
NOT_SCORED: dict = {}  # stored for what is not scored on arrival: the close decides


@dataclass(frozen=True)
class _Job:
    contribution_id: str
    run_id: str
    cfg: RunConfig
    blob_key: str
    base_params_key: str
    lease: LeaseData


async def score_next(
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    executor: Executor,
    faults: FaultInjector,
) -> bool:
    """Claim the oldest unscored contribution of an open round, score it, store the score;
    False when there was none to claim."""
    now = datetime.now(UTC)
    async with sessions() as session, session.begin():
        found = await _claim(session, now)
        if found is None:
            return False
        job = await _job(session, found)
        if job is None:  # not for scoring here: the close decides about it
            found.score, found.score_claim_expires_at = NOT_SCORED, None
            return True

    def measure() -> Score | None:
        faults.hit("score.arrival")
        return _score(storage, job)

    try:
        with SCORE_SECONDS.time():
            score = await asyncio.get_running_loop().run_in_executor(executor, measure)
    except (OSError, ValueError, RuntimeError) as err:  # a missing file, an injected fault
        log.warning(
            "run %s: contribution %s not scored on arrival (%s: %s); its close scores it",
            job.run_id, job.contribution_id, type(err).__name__, err,
        )  # fmt: skip
        score = None
    await _store(sessions, job.contribution_id, score)
    return True


async def _claim(session: AsyncSession, now: datetime) -> Contribution | None:
    in_round = (Round.run_id == Contribution.run_id) & (
        Round.index == Contribution.merged_into_round
    )
    query = (
        select(Contribution)
        .join(Round, in_round)
        .join(Run, Run.id == Contribution.run_id)
        .where(
            Contribution.score.is_(None),
            Contribution.aggregated_at.is_(None),
            Contribution.excluded_code.is_(None),
            (Contribution.score_claim_expires_at.is_(None))
            | (Contribution.score_claim_expires_at < now),
            Round.state == RoundState.OPEN,
            Run.status == RunStatus.ACTIVE,
            exists().where(  # scored against its base, once that is durable (full_files)
                Checkpoint.run_id == Contribution.run_id,
                Checkpoint.version == Contribution.base_version,
                Checkpoint.full_files_at.is_not(None),
            ),
        )
        .order_by(Contribution.created_at, Contribution.id)
        .limit(1)
        .with_for_update(of=Contribution, skip_locked=True)
    )  # fmt: skip
    found = await session.scalar(query)
    if found is not None:
        found.score_claim_expires_at = now + timedelta(seconds=CLAIM_S)
    return found


async def _job(session: AsyncSession, c: Contribution) -> _Job | None:
    """What scoring it needs, or None when it is not scored on arrival."""
    run = await runs_service.get(session=session, run_id=c.run_id)
    cfg = runs_service.run_config(run)
    if c.staleness != 0 or not cfg.aggregation.score_windows:
        return None
    lease = (await lease_data(session, run, [c])).get(c.id)
    if lease is None:
        return None
    base = await checkpoints_service.get(session=session, run_id=c.run_id, version=c.base_version)
    return _Job(c.id, c.run_id, cfg, c.blob_key, base.params_key, lease)


def _score(storage: Storage, job: _Job) -> Score | None:
    """The contribution's score, as its close would take it (None: no validation sample)."""
    sample = score_sample(storage, job.run_id, job.cfg)
    if sample is None:
        return None
    with Stage(storage) as stage:
        base = stage.input(job.base_params_key)
        upload = stage.input(job.blob_key)
        own = read_lease_windows(job.lease, stage.input(job.lease.shard_key), {}, job.cfg)
        return Scorer(job.cfg, base, sample).score(upload, own)


async def _store(
    sessions: async_sessionmaker[AsyncSession], contribution_id: str, score: Score | None
) -> None:
    """The score on its contribution, unless its round was closed meanwhile (the close took
    it or scored it itself) or it was excluded; the claim released either way."""
    async with sessions() as session, session.begin():
        await session.execute(
            update(Contribution)
            .where(
                Contribution.id == contribution_id,
                Contribution.aggregated_at.is_(None),
                Contribution.excluded_code.is_(None),
            )
            .values(
                score=NOT_SCORED if score is None else score.figures(),
                score_claim_expires_at=None,
            )
        )
