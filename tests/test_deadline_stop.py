"""A volunteer whose speed drops mid-round still delivers before the deadline: real
processes, `diloco serve` on a fresh database and `diloco join` slowed by the test hook
``volunteer.step=stall:S`` (``diloco.faults``: each step then sleeps S seconds). It stops
early, uploads the steps it took, and the server accepts them as a contribution with
fewer steps than leased; a second round is joined with its measured speed and sized to it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from diloco.protocol.reputation import counted_weight, standing
from tests.conftest import server_run_config
from tests.support.contribute import API, create_run
from tests.support.live import Proc, ServerProcess, wait_for

H = 400  # leased steps: with each step slowed to 0.1 s from the 30th on, 37 s of work
TIMEOUT_S = 30  # the round's deadline, from its opening (the run's creation)


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(data_dir=tmp_path / "srv", database_url=database_url, n_shards=1)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_a_volunteer_that_slows_down_uploads_fewer_steps_before_the_deadline(server, tmp_path):
    # Prepare: rounds that close on one contribution; a volunteer slowed from step 30 on
    config = server_run_config(
        inner={"steps": H, "batch_size": 4, "warmup_steps": 2},
        rounds={"quorum": 1, "timeout_s": TIMEOUT_S, "max_rounds": 3, "heartbeat_interval_s": 1},
    )
    http = httpx.Client(base_url=server.url, timeout=30)
    run_id = create_run(http, config)["id"]
    home = tmp_path / "tortoise"
    home.mkdir()
    env = {
        "DILOCO_CONFIG_DIR": str(home / "config"),
        "DILOCO_CACHE_DIR": str(home / "cache"),
        "DILOCO_FAULTS": "volunteer.step=stall:0.1@30*1000000",
    }
    args = [sys.executable, "-m", "client.cli", "join", server.url, "--run", run_id]
    args += ["--name", "tortoise", "--threads", "1", "--max-rounds", "2"]

    # Execute: two rounds
    proc = Proc(args, log=home / "join.log", env=env)
    try:
        wait_for(lambda: not proc.alive(), timeout=240, what="the volunteer's two rounds")
    finally:
        proc.stop()
    out = proc.output()

    # Assert: round 1 (nominal H, unknown speed) stopped early and was accepted before its
    # deadline with fewer steps than leased, but at least the 29 quick ones
    assert proc.popen.returncode == 0, out[-3000:]
    rounds = {r["index"]: r for r in http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]}
    first = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"]
    assert len(first) == 1, first
    taken = first[0]["inner_steps"]
    assert 29 <= taken < H, first
    assert first[0]["tokens"] == taken * 4 * 32  # its weight: those, at a new account's standing
    assert first[0]["weight"] == counted_weight(taken * 4 * 32, 0, standing(0, 0))
    created = datetime.fromisoformat(first[0]["created_at"])
    assert created < datetime.fromisoformat(rounds[1]["deadline"]), (first, rounds[1])
    assert rounds[1]["state"] == "closed" and rounds[1]["accepted"] == 1
    assert f"stopped after {taken} of {H} steps for the deadline" in out, out[-3000:]
    assert f"{taken}/{H} steps (deadline)" in out, out[-3000:]
    assert "fault injected: stalling at volunteer.step (hit 30)" in out, out[-3000:]
    # round 2: the join reported the slow speed, so the lease was sized down and finished
    # (or, on a machine slower still, stopped early too); either way it was accepted
    second = http.get(f"{API}/runs/{run_id}/rounds/2/contributions").json()["contributions"]
    assert len(second) == 1 and second[0]["inner_steps"] < H, second
    assert "(the server sized it to our" in out, out[-3000:]
    assert "2 contributions accepted" in out, out[-3000:]
