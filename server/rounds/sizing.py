"""Each lease's H, sized to its volunteer's speed (``diloco.protocol.sizing``): this module
fetches the facts (the volunteer's report, else what its accepted contributions in the run
measured) and reads a lease's H back where an upload's weight is capped.
"""

from __future__ import annotations

import logging
from datetime import datetime

import asyncpg
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.config import RunConfig
from diloco.protocol.sizing import OBSERVED_WINDOW, Sizing, StepBounds, observed_rate, size_lease
from server.rounds.models import Lease

log = logging.getLogger(__name__)

# The volunteer's last accepted contributions in the run: the tokens each weighs and the
# seconds from its lease's issue to its upload (an index on contributions (contributor_id,
# created_at) serves it). Only a new lease without a reported speed runs it.
OBSERVED = """
SELECT coalesce(x.weight, x.tokens)::float8 AS tokens,
       extract(epoch FROM x.created_at - l.issued_at)::float8 AS seconds
FROM contributions x JOIN leases l ON l.id = x.lease_id
WHERE x.contributor_id = $2 AND x.run_id = $1 AND x.excluded_code IS NULL
ORDER BY x.created_at DESC
LIMIT $3
"""


async def size_new_lease(
    conn: asyncpg.Connection,
    *,
    cfg: RunConfig,
    run_id: str,
    contributor_id: str,
    dataset: bool,
    reported: float | None,
    now: datetime,
    deadline: datetime,
) -> Sizing:
    """H for a new lease of ``contributor_id`` on a round due at ``deadline``. A dataset
    run's lease trains on one data unit, which holds ``steps`` batches: H stays at most
    ``steps`` there."""
    observed = None
    if reported is None:
        rows = await conn.fetch(OBSERVED, run_id, contributor_id, OBSERVED_WINDOW)
        observed = observed_rate([(r["tokens"], r["seconds"]) for r in rows])
    bounds = StepBounds.of(cfg.inner, max_steps=cfg.inner.steps if dataset else None)
    sizing = size_lease(
        now,
        deadline,
        bounds,
        tokens_per_step=cfg.tokens_per_step,
        reported=reported,
        observed=observed,
    )
    log.debug("run %s: lease for %s: %s", run_id, contributor_id, sizing.reason)
    return sizing


async def leased_steps(session: AsyncSession, lease_id: str, cfg: RunConfig) -> int:
    """The H a lease was given (a lease from before sizing had the run's ``steps``)."""
    steps = await session.scalar(select(Lease.inner_steps).where(Lease.id == lease_id))
    return cfg.inner.steps if steps is None else int(steps)
