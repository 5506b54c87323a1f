"""What a round's close reads from the database before it computes
(``server.rounds.closing``): its contributions in a fixed order, the base version, the
clipping's history, the checks' recent published changes (``diloco.outer.checks``) and
where each scored contribution's lease read its data (``diloco.outer.scoring``).
"""

from __future__ import annotations

import numpy as np
import torch
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.config import RunConfig
from diloco.outer.checks import RECENT_CHANGES, RecentChange
from diloco.outer.scoring import Score
from diloco.protocol.state import Aggregated
from server.checkpoints import service as checkpoints_service
from server.datasets.models import DataUnit
from server.rounds import service as rounds_service
from server.rounds.claims import Claim
from server.rounds.models import Contribution, Lease, Round
from server.rounds.outer_step import LeaseData, StepInputs, Stored
from server.runs import service as runs_service
from server.runs.models import Run
from server.storage import keys


async def read_inputs(
    sessions: async_sessionmaker[AsyncSession], claim: Claim
) -> tuple[StepInputs, list[Aggregated]]:
    """The close's inputs, and its contributions as ``close_effects`` counts them."""
    async with sessions() as session:
        rnd = await session.get_one(Round, (claim.run_id, claim.index))
        run = await runs_service.get(session=session, run_id=claim.run_id)
        cfg = rounds_service.run_config(run)
        rows = list(
            await session.scalars(
                select(Contribution)
                .where(
                    Contribution.run_id == claim.run_id,
                    # its own contributions and the late ones merged into it
                    Contribution.merged_into_round == claim.index,
                    Contribution.excluded_code.is_(None),
                )
                .order_by(Contribution.created_at, Contribution.id)  # a fixed order: determinism
            )
        )
        base = await checkpoints_service.get(
            session=session, run_id=claim.run_id, version=rnd.base_version
        )
        if base.full_files_at is None:  # claim_next waits for them: a bug if not
            raise RuntimeError(
                f"run {claim.run_id} round {claim.index}: its base version {base.version}'s "
                "full files are not yet durable"
            )
        history = await norm_history(session, claim.run_id, cfg)
        leases = await lease_data(session, run, [c for c in rows if c.staleness == 0])
        recent = await recent_changes(session, claim.run_id, claim.index)
    inputs = StepInputs(
        run_id=claim.run_id,
        version=claim.index,
        cfg=cfg,
        base_params_key=base.params_key,
        base_state_key=base.state_key,
        contributions=[
            Stored(
                c.id,
                c.blob_key,
                float(c.counted_weight),
                c.norm or 0.0,
                leases.get(c.id),
                None if not c.score else Score.from_figures(c.score),
            )
            for c in rows
        ],
        history=history,
        quorum=cfg.rounds.quorum,
        check_seed=rnd.check_seed,
        recent=recent,
    )
    return inputs, [rounds_service.aggregated(c) for c in rows]


async def norm_history(session: AsyncSession, run_id: str, cfg: RunConfig) -> list[float]:
    """The norms of the run's latest aggregated contributions, newest first: the clipping's
    reference when a round has few, and a folded round's (``diloco.outer.fold``). It changes
    only when a round of the run closes, so it is the same all the while a round is open."""
    history = await session.scalars(
        select(Contribution.norm)
        .where(
            Contribution.run_id == run_id,
            Contribution.aggregated_at.is_not(None),
            Contribution.norm.is_not(None),
        )
        .order_by(Contribution.aggregated_at.desc(), Contribution.id)
        .limit(cfg.aggregation.history)
    )
    return [h for h in history if h is not None]


async def recent_changes(session: AsyncSession, run_id: str, index: int) -> list[RecentChange]:
    """The run's last published changes before round ``index``, sampled, oldest first."""
    recent = (
        await session.execute(
            select(Round.index, Round.check_seed, Round.change_sample)
            .where(
                Round.run_id == run_id,
                Round.index < index,
                Round.change_sample.is_not(None),
            )
            .order_by(Round.index.desc())
            .limit(RECENT_CHANGES)
        )
    ).all()
    return [
        RecentChange(i, seed, unpack_sample(sample))
        for i, seed, sample in reversed(recent)
        if sample is not None
    ]


async def lease_data(
    session: AsyncSession, run: Run, rows: list[Contribution]
) -> dict[str, LeaseData]:
    """Where each contribution's lease read its data (``outer_step.LeaseData``), for the
    scoring (at the close, or on arrival); late work is not scored (its base is an older
    version)."""
    if not rows or not rounds_service.run_config(run).aggregation.score_windows:
        return {}
    found = await session.execute(
        select(Contribution.id, Lease.shard, Lease.seed, Contribution.inner_steps,
               Round.check_seed, DataUnit.start, DataUnit.tokens)
        .join(Lease, Lease.id == Contribution.lease_id)
        .join(Round, (Round.run_id == Lease.run_id) & (Round.index == Lease.round_index))
        .outerjoin(DataUnit, (DataUnit.run_id == Lease.run_id) & (DataUnit.unit == Lease.unit))
        .where(Contribution.id.in_([c.id for c in rows]))
    )  # fmt: skip
    return {
        cid: LeaseData(
            keys.training_shard(run.id, run.dataset_id, shard),  # a dataset unit's shard
            seed,
            run.token_dtype,
            run.chunk_len,
            steps,
            secret,
            start,
            tokens,
        )
        for cid, shard, seed, steps, secret, start, tokens in found.all()
    }


def pack_sample(values: torch.Tensor | None) -> bytes | None:
    """A sampled change as a round stores it: float32, little-endian."""
    return None if values is None else values.numpy().astype("<f4").tobytes()


def unpack_sample(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))
