"""A real `diloco join` against a real `diloco serve`, reacting as
``diloco.protocol.volunteer`` says: started before any run exists, it waits for one (as
the join page promises) and trains once one is created; and when the server no longer
knows its lease, the heartbeat's ``409 no_lease`` stops the training and it joins again,
instead of training on for an upload the server would refuse.

The training is slowed by the test hook ``volunteer.step=stall:S`` (``diloco.faults``)
so that a lease lasts a few heartbeats.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.conftest import server_run_config
from tests.support.contribute import API, create_run
from tests.support.live import Proc, ServerProcess, wait_for

H = 20  # leased steps, each slowed to STALL_S: a lease takes about 5 s
STALL_S = 0.25


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(data_dir=tmp_path / "srv", database_url=database_url, n_shards=1)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _volunteer(server: ServerProcess, home: Path, *extra: str) -> Proc:
    """``diloco join`` for one accepted round, slowed to STALL_S a step."""
    home.mkdir()
    env = {
        "DILOCO_CONFIG_DIR": str(home / "config"),
        "DILOCO_CACHE_DIR": str(home / "cache"),
        "DILOCO_FAULTS": f"volunteer.step=stall:{STALL_S}@1*1000000",
    }
    args = [sys.executable, "-m", "client.cli", "join", server.url, *extra]
    args += ["--name", home.name, "--threads", "1", "--max-rounds", "1", "--device", "cpu"]
    return Proc(args, log=home / "join.log", env=env)


def _config() -> dict[str, Any]:
    return server_run_config(
        inner={"steps": H, "batch_size": 4, "warmup_steps": 2},
        rounds={
            "quorum": 1,
            "timeout_s": 600,
            "max_rounds": 3,
            "heartbeat_interval_s": 1,
            "lease_ttl_s": 3,
        },
    )


def _sql(database_url: str, query: str, *args: Any) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return list(await conn.fetch(query, *args))
        finally:
            await conn.close()

    return asyncio.run(run())


def test_a_volunteer_started_before_any_run_waits_for_one_and_trains_it(server, tmp_path):
    # Prepare: a hub with no run at all; the volunteer starts without --run
    http = httpx.Client(base_url=server.url, timeout=30)
    assert http.get(f"{API}/runs").json()["runs"] == []
    proc = _volunteer(server, tmp_path / "early-bird")
    try:
        wait_for(
            lambda: "has no active run yet; waiting for one" in proc.output() or not proc.alive(),
            timeout=120,
            what="the volunteer to say it waits for a run",
        )
        assert proc.alive(), proc.output()[-3000:]  # it waits rather than exits 1

        # Execute: the operator creates a run
        run_id = create_run(http, _config())["id"]
        wait_for(lambda: not proc.alive(), timeout=180, what="the volunteer's round")
    finally:
        proc.stop()
    out = proc.output()

    # Assert: it found the run, trained round 1 and was accepted, and said what it waited for
    assert proc.popen.returncode == 0, out[-3000:]
    assert out.count("has no active run yet; waiting for one") == 1, out[-3000:]
    assert f"joining run {run_id}" in out, out[-3000:]
    assert "done after 1 accepted rounds: 1 contributions accepted" in out, out[-3000:]
    taken = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"]
    assert [c["contributor_name"] for c in taken] == ["early-bird"], taken


def test_a_volunteer_whose_lease_is_taken_away_stops_and_joins_again(
    server, database_url, tmp_path
):
    # Prepare: a run; the volunteer trains its lease on round 1
    http = httpx.Client(base_url=server.url, timeout=30)
    run_id = create_run(http, _config())["id"]
    proc = _volunteer(server, tmp_path / "dispossessed", "--run", run_id)
    lease_of = "SELECT id, last_step FROM leases WHERE run_id = $1 AND round_index = 1"
    try:
        first = wait_for(
            lambda: [r for r in _sql(database_url, lease_of, run_id) if r["last_step"]],
            timeout=120,
            what="a heartbeat reporting training on round 1",
        )[0]["id"]

        # Execute: the server loses the lease (as a hub restored from an older backup
        # would); the volunteer's next heartbeat is answered 409 no_lease
        _sql(database_url, "DELETE FROM leases WHERE id = $1", first)
        wait_for(lambda: not proc.alive(), timeout=180, what="the volunteer's round")
    finally:
        proc.stop()
    out = proc.output()

    # Assert: it stopped training the lost lease (abandoned, not uploaded and refused),
    # joined again with a new lease, and that one's work was accepted
    assert proc.popen.returncode == 0, out[-3000:]
    assert "round 1: lost our lease on round 1 (no_lease); joining again" in out, out[-3000:]
    assert "1 contributions accepted, 0 rejected, 1 abandoned" in out, out[-3000:]
    assert "still training" not in out, out[-3000:]
    leases = _sql(database_url, lease_of, run_id)
    assert len(leases) == 1 and leases[0]["id"] != first, leases
    taken = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"]
    assert [c["inner_steps"] for c in taken] == [H], taken
