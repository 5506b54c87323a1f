"""A run's status is honoured by every volunteer request, and a close never overwrites a
cancel: real server processes on a real Postgres."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import server_run_config
from tests.support.contribute import API, auth, create_run, register, train, upload
from tests.support.live import ServerProcess, admin_headers, wait_for


def act(http: httpx.Client, run_id: str, action: str) -> dict:
    r = http.post(f"{API}/runs/{run_id}/{action}", headers=admin_headers())
    assert r.status_code == 200, r.text
    return dict(r.json())


def heartbeat(http: httpx.Client, token: str, lease: dict) -> httpx.Response:
    return http.post(
        f"{API}/runs/{lease['run_id']}/rounds/{lease['round']}/heartbeat",
        json={"lease_id": lease["lease_id"], "step": 1, "loss": 3.0},
        headers=auth(token),
    )


def refused_as(r: httpx.Response, status: str) -> bool:
    body = r.json()
    return (r.status_code, body["error"], body["status"]) == (409, "run_not_active", status)


@pytest.mark.parametrize("action", ["pause", "cancel"])
def test_heartbeats_uploads_and_joins_to_a_run_that_is_not_active_are_409(http, action):
    # Prepare: a volunteer with a lease and finished work, then the owner acts
    run = create_run(http, server_run_config(rounds={"quorum": 2, "max_rounds": 3}))
    token = register(http, f"v-{action}")
    work = train(http, token, run["id"], steps=1)
    status = act(http, run["id"], action)["status"]

    # Execute
    beat, sent = heartbeat(http, token, work.lease), upload(http, token, work)
    joined = http.post(f"{API}/runs/{run['id']}/join", headers=auth(token))

    # Assert: each refused, naming the status; nothing was stored
    assert refused_as(beat, status) and refused_as(sent, status) and refused_as(joined, status)
    assert "the run is " + status in sent.json()["detail"]
    listed = http.get(f"{API}/runs/{run['id']}/rounds/1/contributions").json()
    assert listed["contributions"] == []
    assert [r["error"] for r in listed["rejections"]] == ["run_not_active"]
    if action == "pause":  # resuming lets the same work in
        act(http, run["id"], "resume")
        assert heartbeat(http, token, work.lease).status_code == 200
        assert upload(http, token, work).status_code == 201


@pytest.fixture
def slow_retry_server(database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    """The first close attempt fails at eval; the retry waits 3 s: time to cancel."""
    proc = ServerProcess(
        data_dir=tmp_path / "srv",
        database_url=database_url,
        faults="close.eval=fail",
        close_retry_base_s=3,
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_a_cancel_during_the_last_rounds_close_is_never_overwritten(slow_retry_server):
    # Prepare: a one-round run whose close has failed once and waits to retry
    http = slow_retry_server.client()
    run = create_run(http, server_run_config(rounds={"quorum": 1, "max_rounds": 1}))
    token = register(http, "v")
    assert upload(http, token, train(http, token, run["id"], steps=1)).status_code == 201
    wait_for(
        lambda: http.get(f"{API}/runs/{run['id']}").json()["current_round"]["error"],
        timeout=60,
        what="the first close attempt to fail",
    )

    # Execute: cancel while the round is closing; the retry publishes afterwards
    assert act(http, run["id"], "cancel")["status"] == "cancelled"
    wait_for(
        lambda: http.get(f"{API}/runs/{run['id']}").json()["checkpoint_version"] == 1,
        timeout=60,
        what="the retried close to publish",
    )

    # Assert: the step is published and credited, the run stays cancelled, no round follows
    after = http.get(f"{API}/runs/{run['id']}").json()
    assert after["status"] == "cancelled" and after["current_round"] is None
    rounds = http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"]
    assert [(r["index"], r["state"], r["close_attempts"]) for r in rounds] == [(1, "closed", 2)]
    listed = http.get(f"{API}/runs/{run['id']}/rounds/1/contributions").json()["contributions"]
    assert listed[0]["aggregated"] and listed[0]["credit"] > 0
    assert "the run was cancelled meanwhile, so no round follows" in slow_retry_server.output()
