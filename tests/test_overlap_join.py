"""Overlap through the real platform (issue 25): a ``diloco join`` volunteer of a run with
``[inner] overlap`` trains on after its upload, while its round waits for a slower
volunteer and closes, folds those steps onto the next version when it arrives, and that
lease's upload is accepted as any other: based on the version the lease names, claiming only
the tokens of the lease's own data (the steps ahead read the last lease's data again)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.support.corpora import TINYSHAKESPEARE
from tests.support.volunteers import live_run

ROUNDS, H, CAP = 3, 8, 4  # overlap 0.5: at most 4 of a lease's 8 steps trained ahead
BATCH, BLOCK = 4, 64


def write_config(path: Path) -> Path:
    path.write_text(
        f"""name = "overlap"
seed = 3
[model]
n_layer = 1
n_head = 2
n_embd = 64
block_size = {BLOCK}
[data]
path = "{TINYSHAKESPEARE}"
chunk_size = 4096
[inner]
steps = {H}
batch_size = {BATCH}
lr = 3e-3
warmup_steps = 2
overlap = 0.5
[rounds]
quorum = 2
target = 2
timeout_s = 300
max_rounds = {ROUNDS}
heartbeat_interval_s = 1
"""
    )
    return path


def contributions(database_url: str, run_id: str) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        conn = await asyncpg.connect(database_url.replace("+asyncpg", ""))
        try:
            found = await conn.fetch(
                "SELECT c.round_index, c.base_version, c.tokens, c.inner_steps, u.name "
                "FROM contributions c JOIN contributors u ON u.id = c.contributor_id "
                "WHERE c.run_id = $1 AND c.aggregated_at IS NOT NULL ORDER BY c.round_index",
                run_id,
            )
            return [dict(r) for r in found]
        finally:
            await conn.close()

    return asyncio.run(go())


@pytest.mark.slow
def test_a_volunteer_trains_ahead_while_its_round_closes_and_its_next_upload_is_accepted(
    database_url: str, tmp_path: Path
) -> None:
    # Prepare: a server, a run that trains ahead, a volunteer and a slower one (0.4 s a
    # step more) whose round-1 upload the first waits for
    with live_run(database_url, tmp_path, write_config(tmp_path / "run.toml")) as live:
        fast = live.volunteers.start("fast", live.server, live.run_id, quiet=False)
        live.volunteers.start(
            "slow", live.server, live.run_id, DILOCO_FAULTS="volunteer.step=stall:0.4@1*1000000"
        )

        # Execute: the run to its end
        live.volunteers.finish(live.http, live.run_id)
        log, run_id = fast.output(), live.run_id

    # Assert: after each of its uploads, the fast volunteer trained the cap of steps ahead
    # (it waited 3 s and more for the slow one) and folded them onto the next version
    accepted = [m.start() for m in re.finditer(r"^round (\d) .* accepted", log, re.M)]
    folds = [
        (m.start(), m.groups())
        for m in re.finditer(
            r"^round (\d): (\d) of its (\d) steps trained ahead while round (\d) closed; "
            r"folded onto version (\d)$",
            log,
            re.M,
        )
    ]
    assert [g for _, g in folds] == [
        (str(r), str(CAP), str(H), str(r - 1), str(r - 1)) for r in range(2, ROUNDS + 1)
    ], log[-3000:]
    # each fold comes after the upload of the round before was accepted
    assert len(accepted) == ROUNDS and all(accepted[i] < at for i, (at, _) in enumerate(folds)), (
        log[-3000:]
    )
    assert f"{CAP * (ROUNDS - 1)} steps trained ahead" in log, log[-1000:]

    # every upload was accepted against the version its lease named; the fast one's
    # after the first claim the tokens of the H - CAP steps on their own lease's data
    rows = contributions(database_url, run_id)
    assert [(r["round_index"], r["base_version"]) for r in rows] == [
        (r, r - 1) for r in range(1, ROUNDS + 1) for _ in range(2)
    ]
    mine = [(r["round_index"], r["inner_steps"], r["tokens"]) for r in rows if r["name"] == "fast"]
    full, rest = H * BATCH * BLOCK, (H - CAP) * BATCH * BLOCK
    assert mine == [(1, H, full)] + [(r, H, rest) for r in range(2, ROUNDS + 1)]
