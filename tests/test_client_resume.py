"""A volunteer stopped mid-round and started again: it gives its lease back on Ctrl+C, and the
restarted client trains the round from its cached checkpoint and shard (no download: the
server's own request counter says so) with the AdamW state it saved, not a fresh one.

Real processes: `diloco serve` on a fresh database and `diloco join` twice on one cache.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from safetensors import safe_open

from tests.conftest import server_run_config
from tests.support.contribute import API, create_run
from tests.support.live import Proc, ServerProcess, wait_for

H = 1500  # inner steps: long enough (seconds) to stop the client in the middle of a round


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(data_dir=tmp_path / "srv", database_url=database_url, n_shards=1)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def downloads(http: httpx.Client, what: str) -> float:
    """GETs of checkpoint or shard files (``what``: ``checkpoints``, ``shards``, or
    ``deltas``: a checkpoint's delta) the server answered with 200 or 206 (not the
    catch-up plans)."""
    total = 0.0
    route = r"checkpoints/\{version\}/delta" if what == "deltas" else rf"{what}/\{{[a-z_]+\}}"
    file_route = re.compile(rf'route="/api/v1/runs/\{{run_id\}}/{route}"')
    for line in http.get("/metrics").text.splitlines():
        m = re.match(r"^diloco_http_requests_total\{(.*)\} (\S+)$", line)
        labels = m.group(1) if m else ""
        if (
            file_route.search(labels)
            and 'method="GET"' in labels
            and re.search(r'status="20[06]"', labels)
        ):
            total += float(m.group(2))  # type: ignore[union-attr]
    return total


async def _lease_step(database_url: str, run_id: str, index: int) -> tuple[int, bool] | None:
    """(last reported step, still live) of the round's lease, or None before one exists."""
    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        row = await conn.fetchrow(
            "SELECT coalesce(last_step, 0) AS step, expires_at > now() AS live FROM leases "
            "WHERE run_id = $1 AND round_index = $2",
            run_id,
            index,
        )
        return None if row is None else (int(row["step"]), bool(row["live"]))
    finally:
        await conn.close()


def lease_step(database_url: str, run_id: str, index: int) -> tuple[int, bool] | None:
    return asyncio.run(_lease_step(database_url, run_id, index))


def volunteer(
    home: Path, server: ServerProcess, run_id: str
) -> tuple[Path, dict[str, str], list[str]]:
    """A volunteer's own dirs, its environment, and its `diloco join` command line."""
    home.mkdir()
    env = {"DILOCO_CONFIG_DIR": str(home / "config"), "DILOCO_CACHE_DIR": str(home / "cache")}
    args = [sys.executable, "-m", "client.cli", "join", server.url, "--run", run_id]
    return home, env, [*args, "--name", home.name, "--threads", "1"]


def saved_state(cache: Path, run_id: str) -> dict[str, str]:
    with safe_open(str(cache / "runs" / run_id / "adamw.safetensors"), framework="pt") as f:
        return dict(f.metadata())


def test_a_restarted_volunteer_resumes_without_downloading_again(server, database_url, tmp_path):
    # Prepare: a run whose rounds close on one contribution, and a volunteer's dirs
    # The outer step is the volunteer's own move (lr 1, no momentum). One volunteer training
    # 1500 steps a round on one small shard learns it by heart each round; Nesterov's
    # momentum would add 0.57 of round 1's whole move to round 2's step, and the guard
    # rightly discarded that step on about half the seeds (eval 0.73 -> 1.60, past 2x),
    # leaving round 2 open. The test follows the resume, not the outer step.
    config = server_run_config(
        inner={"steps": H, "batch_size": 4, "warmup_steps": 2},
        rounds={
            "quorum": 1,
            "target": 1,
            "timeout_s": 600,
            "max_rounds": 3,
            "heartbeat_interval_s": 1,
        },
    )
    config["outer"] = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    http = httpx.Client(base_url=server.url, timeout=30)
    run_id = create_run(http, config)["id"]
    home, env, args = volunteer(tmp_path / "alice", server, run_id)

    # Execute: round 1 in full, then Ctrl+C in the middle of round 2
    first = Proc(args, log=home / "first.log", env=env)
    try:
        wait_for(
            lambda: (lease_step(database_url, run_id, 2) or (0, True))[0] > 0,
            timeout=240,
            what="the volunteer to be training round 2",
            every=0.2,
        )
        first.popen.send_signal(signal.SIGINT)
        first.popen.wait(timeout=60)
    finally:
        first.stop()
    stopped = first.output()
    lease_after_stop = lease_step(database_url, run_id, 2)
    before = tuple(downloads(http, what) for what in ("checkpoints", "deltas", "shards"))
    state_after_1 = saved_state(home / "cache", run_id)

    second = Proc([*args, "--max-rounds", "1"], log=home / "second.log", env=env)
    try:
        wait_for(lambda: not second.alive(), timeout=240, what="the restarted volunteer")
    finally:
        second.stop()
    resumed = second.output()

    # Assert: a clean stop that gave the lease back
    assert first.popen.returncode == 128 + signal.SIGINT, stopped[-2000:]
    assert "gave back our lease on round 2" in stopped, stopped[-2000:]
    assert lease_after_stop is not None and lease_after_stop[1] is False  # no longer live
    assert (state_after_1["round"], state_after_1["steps"]) == ("1", str(H))
    # the restart: no download, the saved AdamW state, an accepted contribution
    assert second.popen.returncode == 0, resumed[-2000:]
    # the first process: v0 whole, v1 as v0 plus its int8 delta, and the one shard
    assert before == (1.0, 1.0, 1.0)
    assert tuple(downloads(http, what) for what in ("checkpoints", "deltas", "shards")) == before
    assert "checkpoint v1: cached copy verified" in resumed, resumed[-2000:]
    assert f"AdamW state restored from {home / 'cache'}" in resumed, resumed[-2000:]
    assert f"(step {H}, saved after round 1)" in resumed, resumed[-2000:]
    state_after_2 = saved_state(home / "cache", run_id)
    assert (state_after_2["round"], state_after_2["steps"]) == ("2", str(2 * H))
    rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
    # round 2 took the resumed upload; it may still be closing when the volunteer exits
    # (a close is asynchronous, and every step is judged before it is published)
    taken = http.get(f"{API}/runs/{run_id}/rounds/2/contributions").json()
    assert [(x["index"], x["accepted"]) for x in rounds[:2]] == [(1, 1), (2, 1)], (
        json.dumps(rounds[1]),
        json.dumps(taken),
        resumed[-3000:],
    )
    assert rounds[0]["state"] == "closed" and rounds[1]["state"] in ("closing", "closed")


def test_max_hours_stops_mid_round_gives_the_lease_back_and_exits_0(server, database_url, tmp_path):
    config = server_run_config(
        inner={"steps": 50 * H, "batch_size": 4, "warmup_steps": 2},
        rounds={"quorum": 1, "timeout_s": 600, "max_rounds": 2, "heartbeat_interval_s": 1},
    )
    http = httpx.Client(base_url=server.url, timeout=30)
    run_id = create_run(http, config)["id"]
    home, env, args = volunteer(tmp_path / "bob", server, run_id)
    args += ["--max-hours", "0.003"]  # 10.8 s

    proc = Proc(args, log=home / "join.log", env=env)
    try:
        wait_for(lambda: not proc.alive(), timeout=120, what="--max-hours to stop the volunteer")
    finally:
        proc.stop()
    out = proc.output()

    assert proc.popen.returncode == 0, out[-2000:]
    assert "gave back our lease on round 1" in out, out[-2000:]
    assert "stopped after --max-hours 0.003" in out, out[-2000:]
    lease = lease_step(database_url, run_id, 1)
    assert lease is not None and lease[0] > 0 and lease[1] is False  # trained, then released
    round_1 = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"][0]
    assert (round_1["state"], round_1["accepted"]) == ("open", 0)
