"""Which data a dataset run has trained on: its units (``server.datasets.models.DataUnit``),
how leases take them, what accepted contributions covered, and the coverage figures.

What a unit is, how units are planned and in which order they are dealt is defined once, in
:mod:`diloco.data.units` (the simulator deals them the same way); this module keeps the
counts in Postgres. A new lease takes the unit least trained on, then least handed out,
then first by position (``PICK_UNIT``, in the join's fast path): no unit is handed out a
second time before every unit was handed out once, including leases given back or expired,
and a unit whose lease came to nothing is the first to go again once the pass is through.
A shard's tail shorter than a unit is counted as not covered.
"""

from __future__ import annotations

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.data.units import unit_positions
from server.datasets.models import DataUnit
from server.runs.models import Run
from server.runs.schemas import Coverage, ShardCoverage

PICK_UNIT = """
UPDATE data_units SET issued = issued + 1, last_issued_at = $2
WHERE run_id = $1 AND unit = (
    SELECT unit FROM data_units WHERE run_id = $1
    ORDER BY trained, issued, position LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING unit, shard, start, tokens
"""
UNIT_OF = "SELECT unit, shard, start, tokens FROM data_units WHERE run_id = $1 AND unit = $2"
INSERT_BATCH = 50_000


async def create_units(
    session: AsyncSession, *, run_id: str, units: list[tuple[int, int]], tokens: int, seed: int
) -> None:
    """Insert the run's units with positions shuffled by ``seed`` (arrays, in batches)."""
    positions = unit_positions(len(units), seed)
    for first in range(0, len(units), INSERT_BATCH):
        part = units[first : first + INSERT_BATCH]
        await session.execute(
            text(
                "INSERT INTO data_units (run_id, unit, shard, start, tokens, position) "
                "SELECT :run, u, s, st, :tokens, p FROM unnest("
                "CAST(:units AS integer[]), CAST(:shards AS integer[]), "
                "CAST(:starts AS bigint[]), CAST(:positions AS integer[])) AS t(u, s, st, p)"
            ),
            {
                "run": run_id,
                "tokens": tokens,
                "units": list(range(first, first + len(part))),
                "shards": [s for s, _ in part],
                "starts": [st for _, st in part],
                "positions": positions[first : first + len(part)],
            },
        )


async def record(session: AsyncSession, *, lease_id: str, tokens: int) -> None:
    """An accepted contribution covered its lease's unit (if the run has units)."""
    await session.execute(
        text(
            "UPDATE data_units u SET trained = u.trained + 1, "
            "tokens_trained = u.tokens_trained + :tokens "
            "FROM leases l WHERE l.id = :lease AND u.run_id = l.run_id AND u.unit = l.unit"
        ),
        {"lease": lease_id, "tokens": tokens},
    )


def trained_totals(run: Run, trained: int) -> Coverage:
    """Tokens trained (the accepted contributions' weights, counted by the caller, which
    reads the rounds) and epochs, for any run."""
    epochs = trained / run.train_tokens if run.train_tokens else 0.0
    return Coverage(
        run_id=run.id, train_tokens=run.train_tokens, tokens_trained=trained, epochs=epochs
    )


async def view(session: AsyncSession, run: Run, *, trained: int) -> Coverage:
    """The totals (see ``trained_totals``), and for a dataset run its units and shards."""
    base = trained_totals(run, trained)
    if run.dataset_id is None:
        return base
    u = DataUnit
    totals = (
        await session.execute(
            select(
                func.count(),
                func.count().filter(u.issued > 0),
                func.count().filter(u.trained > 0),
                func.coalesce(func.min(u.trained), 0),
                func.coalesce(func.max(u.trained), 0),
                func.coalesce(func.sum(u.tokens - 1), 0),
            ).where(u.run_id == run.id)
        )
    ).one()
    rows = await session.execute(
        select(
            u.shard,
            func.count(),
            func.count().filter(u.trained > 0),
            func.coalesce(func.sum(u.tokens_trained), 0),
        )
        .where(u.run_id == run.id)
        .group_by(u.shard)
        .order_by(u.shard)
    )
    return base.model_copy(
        update={
            "units": totals[0],
            "units_issued": totals[1],
            "units_trained": totals[2],
            "min_passes": totals[3],
            "max_passes": totals[4],
            "unit_tokens": totals[5],
            "shards": [
                ShardCoverage(index=s, units=n, units_trained=t, tokens_trained=int(k))
                for s, n, t, k in rows
            ],
        }
    )
