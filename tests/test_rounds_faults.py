"""Crashes and concurrency with real server processes on one real Postgres.

- SIGKILL the server after an accepted upload and before its round closes: after a restart
  the round closes with that upload counted, and the new parameters equal an in-process
  reference computed from the same contributions with the same library calls.
- Two `diloco serve` processes on one database: every round's outer step happens once.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as safetensors_load

from tests.conftest import server_run_config
from tests.support.contribute import API, reference_step, register, train, upload
from tests.support.contribute import create_run as post_run
from tests.support.live import ServerProcess, wait_for

CLOSED_LINE = re.compile(r"run (run_\w+) round (\d+) closed")


def create_run(http: httpx.Client, **rounds: object) -> dict:
    return post_run(http, server_run_config(rounds={"timeout_s": 600, **rounds}))


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "srv"


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    procs: list[ServerProcess] = []
    yield procs
    for proc in procs:
        proc.stop()


def test_server_killed_after_an_accepted_upload_closes_the_round_after_restart(
    database_url, data_dir, started
):
    # Prepare: a round that needs two contributions; one arrives, then the server dies
    first = ServerProcess(data_dir=data_dir, database_url=database_url)
    started.append(first)
    http = first.wait_ready().client()
    run = create_run(http, quorum=2)
    a, b = register(http, "a"), register(http, "b")
    work_a, work_b = train(http, a, run["id"], steps=2), train(http, b, run["id"], steps=2)
    base = safetensors_load(http.get(work_a.lease["checkpoint"]["url"]).content)
    assert upload(http, a, work_a).status_code == 201
    first.kill()

    # Execute: a new server process on the same database and data dir
    second = ServerProcess(data_dir=data_dir, database_url=database_url)
    started.append(second)
    http = second.wait_ready().client()
    assert http.get(f"{API}/runs/{run['id']}").json()["current_round"]["accepted"] == 1
    assert upload(http, b, work_b).status_code == 201
    wait_for(
        lambda: http.get(f"{API}/runs/{run['id']}").json()["checkpoint_version"] == 1,
        timeout=60,
        what="round 1 to close after the restart",
    )

    # Assert: both uploads counted, parameters bit for bit the in-process reference
    (round1, *_) = http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"]
    assert round1["state"] == "closed" and round1["accepted"] == 2
    assert round1["tokens"] == work_a.meta.tokens + work_b.meta.tokens
    assert round1["close_code"] == "quorum_no_live_leases"
    published = safetensors_load(http.get(f"{API}/runs/{run['id']}/checkpoints/1").content)
    expected = reference_step(run, base, [work_a, work_b]).params
    assert published.keys() == expected.keys()
    for name in expected:
        assert torch.equal(published[name], expected[name]), name
    assert any(not torch.equal(published[n], base[n]) for n in base)


def test_two_servers_on_one_database_close_each_round_exactly_once(database_url, data_dir, started):
    # Prepare: two servers sweeping every 50 ms over one database and one data dir
    servers = [
        ServerProcess(data_dir=data_dir, database_url=database_url, sweep_interval_s=0.05)
        for _ in range(2)
    ]
    started.extend(servers)
    clients = [s.wait_ready().client() for s in servers]
    run = create_run(clients[0], quorum=2, target=2, max_rounds=3)
    tokens = [register(clients[0], f"v{i}") for i in range(2)]

    # Execute: three rounds, each volunteer talking to a different server
    for index in (1, 2, 3):
        for token, http in zip(tokens, clients, strict=True):
            work = train(http, token, run["id"], steps=1)
            assert work.lease["round"] == index
            assert upload(http, token, work).status_code == 201
        wait_for(
            lambda i=index: (
                clients[1].get(f"{API}/runs/{run['id']}").json()["checkpoint_version"] == i
            ),
            timeout=60,
            what=f"round {index} to close",
        )

    # Assert: one close per round across both servers' logs and metrics
    for s in servers:
        s.stop()
    closes = [m.group(2) for s in servers for m in CLOSED_LINE.finditer(s.output())]
    assert sorted(closes) == ["1", "2", "3"], closes
    third = ServerProcess(data_dir=data_dir, database_url=database_url)
    started.append(third)
    http = third.wait_ready().client()
    run_now = http.get(f"{API}/runs/{run['id']}").json()
    assert run_now["status"] == "completed" and run_now["checkpoint_version"] == 3
    listed = http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"]
    assert [(r["index"], r["state"], r["accepted"]) for r in listed] == [
        (1, "closed", 2),
        (2, "closed", 2),
        (3, "closed", 2),
    ]
