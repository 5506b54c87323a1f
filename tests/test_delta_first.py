"""Delta first: a version is published once its delta is durable, and its parameters and
outer state follow off the close's critical path (``server.rounds.full_files``).

A real ``diloco serve`` on a real Postgres, its closer held (``close.full=stall``) between
committing version 1's full files and marking them durable. Meanwhile:
- the parameters' download answers ``503 checkpoint_pending`` with Retry-After, for the
  version and for ``latest``; a catch-up from version 0 is by the delta;
- a returning volunteer rebuilds version 1 from version 0 and the delta, trains on it and
  uploads; round 2 is decided closing but not claimed: its close waits for its base;
- a new volunteer's real client (``ServerAPI.download``) honours the Retry-After and gets
  the file once it is durable.
Then version 1 is ``torch.equal`` to the reference step and to what the delta gave, and
round 2 closes on it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as safetensors_load

from client import catchup
from client.api import RetryPolicy, ServerAPI
from diloco.checkpoint import checkpoint_params_only
from tests.conftest import server_run_config
from tests.support.contribute import (
    API,
    auth,
    create_run,
    reference_step,
    register,
    train,
    upload,
)
from tests.support.live import ServerProcess, wait_for

STALL_S = 12  # the closer's hold on version 1's mark: what the test does fits in it
PATIENT = RetryPolicy(attempts=8, base_delay_s=0.01, max_delay_s=0.05, total_s=90.0)


@pytest.fixture
def server(database_url, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        data_dir=tmp_path / "srv", database_url=database_url, faults=f"close.full=stall:{STALL_S}"
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _rounds(http, run_id: str) -> dict[int, dict]:  # type: ignore[no-untyped-def]
    rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
    return {r["index"]: r for r in rounds}


def test_while_the_full_files_are_pending_volunteers_get_the_delta_or_a_503_they_honour(
    server: ServerProcess, tmp_path: Path
):
    # Prepare: round 1 closes on one upload; its closer holds version 1's mark
    http = server.client()
    raw = server.client(wait_pending=False)  # sees the 503s
    config = server_run_config(rounds={"quorum": 1, "target": 1, "max_rounds": 3})
    run = create_run(http, config | {"seed": 3})
    run_id = run["id"]
    old = register(http, "returning")
    work = train(http, old, run_id, steps=1)
    held = tmp_path / "v0.safetensors"
    held.write_bytes(http.get(work.lease["checkpoint"]["url"]).content)
    v0 = safetensors_load(held.read_bytes())
    assert upload(http, old, work).status_code == 201
    wait_for(
        lambda: http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"] == 1,
        timeout=60,
        what="version 1 to be published",
    )

    # Execute and Assert, while version 1's full files are pending:
    # the parameters answer 503 with Retry-After, the catch-up from version 0 is the delta
    for which in ("1", "latest"):
        pending = raw.get(f"{API}/runs/{run_id}/checkpoints/{which}")
        assert pending.status_code == 503, pending.text
        assert pending.headers["Retry-After"] == "5"
        assert pending.json()["error"] == "checkpoint_pending"
        assert pending.json()["retry_after_s"] == 5
    plan = raw.get(f"{API}/runs/{run_id}/checkpoints/latest/catch-up?from=0").json()
    assert plan["kind"] == "deltas" and [d["version"] for d in plan["deltas"]] == [1]
    assert plan["full"]["url"] == f"{API}/runs/{run_id}/checkpoints/1"
    delta_path = tmp_path / "1.delta.safetensors"
    delta_path.write_bytes(raw.get(plan["deltas"][0]["url"]).content)
    rebuilt = tmp_path / "v1-by-delta.safetensors"  # as the client's catch-up writes it
    sha = catchup.rebuild(held, [delta_path], version=1, run_id=run_id, out=rebuilt)
    assert sha == plan["full"]["sha256"]  # the sha256 recorded before the file was committed
    v1_by_delta = checkpoint_params_only(rebuilt)

    # a new volunteer's lease names the server's route for version 1 (the bucket's 404
    # would not say when to come back)
    new = register(http, "new")
    lease = http.post(f"{API}/runs/{run_id}/join", headers=auth(new)).json()
    assert lease["checkpoint"]["url"] == f"{API}/runs/{run_id}/checkpoints/1"

    # the returning volunteer trains on version 1 rebuilt from the delta; round 2 is then
    # decided closing, and waits for its base's full files
    again = train(http, old, run_id, steps=1, start=v1_by_delta)
    assert upload(http, old, again).status_code == 201
    wait_for(lambda: _rounds(http, run_id)[2]["state"] == "closing", timeout=30,
             what="round 2 to be decided closing")  # fmt: skip
    round2 = _rounds(http, run_id)[2]
    assert raw.get(f"{API}/runs/{run_id}/checkpoints/1").status_code == 503  # still pending
    assert round2["state"] == "closing" and round2["close_attempts"] == 0, round2

    # the new volunteer's client honours the Retry-After and gets the file once durable
    dest = tmp_path / "v1.safetensors"

    async def download() -> None:
        async with ServerAPI(server.url, retry=PATIENT) as api:
            await api.download(lease["checkpoint"]["url"], dest, lease["checkpoint"]["sha256"])

    started = time.monotonic()
    asyncio.run(download())
    assert time.monotonic() - started >= 4.5  # it waited as told, not its 10 ms backoff
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == lease["checkpoint"]["sha256"]

    # Assert: version 1 is the exact step, as the delta gave it; round 2 closes on it
    v1 = safetensors_load(dest.read_bytes())
    expected = reference_step(run, v0, [work])
    for name, tensor in expected.params.items():
        assert torch.equal(v1[name], tensor), name
        assert torch.equal(v1_by_delta[name], tensor), name
    wait_for(
        lambda: http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"] == 2,
        timeout=60,
        what="round 2 to close on version 1",
    )
    assert _rounds(http, run_id)[2]["close_attempts"] == 1
