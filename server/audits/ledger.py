"""The replay ledger (issue 26, docs/verification.md): what an audit needs to train a
lease again. The lease as it was handed out (``server.rounds.leases.lease_answer`` on the
stored lease row: the same base, data, seed and H), the upload's replay record (the AdamW
state it began from, its precision and micro-batch), and where its blob and the revealed
state are."""

from __future__ import annotations

from datetime import datetime

import asyncpg

from diloco.protocol.messages import Lease
from server.http.errors import Gone
from server.rounds import leases
from server.runs import coverage
from server.settings import Settings
from server.storage.base import Storage

ISSUED = """
SELECT l.contributor_id, run.chunk_len, run.shards::text AS shards, run.config::text AS config,
       run.dataset_id, run.token_dtype,
       r.index, r.state, r.opened_at, r.deadline, r.extensions,
       l.id, l.shard, l.unit, l.seed, l.expires_at, l.inner_steps,
       c.version, c.sha256, c.nbytes, c.files_deleted_at,
       c.full_files_at IS NOT NULL AS full_durable
FROM leases l
JOIN runs run ON run.id = l.run_id
JOIN rounds r ON r.run_id = l.run_id AND r.index = l.round_index
LEFT JOIN checkpoints c ON c.run_id = l.run_id AND c.version = r.index - 1
WHERE l.run_id = $1 AND l.round_index = $2 AND l.contributor_id = $3
"""


async def issued(
    *,
    pool: asyncpg.Pool,
    settings: Settings,
    storage: Storage,
    run_id: str,
    index: int,
    contributor_id: str,
    now: datetime,
) -> Lease | None:
    """The lease this contributor was given on round ``index``, as it was handed out (the
    same base, data and seed; fresh download URLs): what an audit replays. None: no such
    lease. ``Gone`` when retention deleted the base version's files."""
    async with pool.acquire() as conn:
        row = await conn.fetchrow(ISSUED, run_id, index, contributor_id)
        if row is None:
            return None
        if row["version"] is None or row["files_deleted_at"] is not None:
            raise Gone(
                f"round {index}'s base (version {index - 1}) is no longer kept: the run's "
                "retention policy deleted its files, so its leases cannot be replayed"
            )
        view = leases.round_view(row)
        assert view is not None
        unit = None
        if row["unit"] is not None:
            unit = await conn.fetchrow(coverage.UNIT_OF, run_id, row["unit"])
    lease = leases.lease_answer(settings, storage, run_id, view, row, row, unit, now)
    return lease.model_copy(update={"upload": None})  # nothing to upload: no signed PUT
