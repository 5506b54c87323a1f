"""`diloco serve --role`: an API process and two round workers on one Postgres and one data
dir. Volunteers talk to the API only; the workers close every round exactly once, woken
across processes by Postgres NOTIFY (their periodic sweep is a minute apart, longer than
the test waits for a round)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import server_run_config
from tests.support.contribute import API, create_run, register, train, upload
from tests.support.live import ServerProcess, wait_for

CLOSED_LINE = re.compile(r"run (run_\w+) round (\d+) closed")


@pytest.fixture
def processes(database_url: str, tmp_path: Path) -> Iterator[dict[str, ServerProcess]]:
    data_dir = tmp_path / "shared-data"
    procs = {
        "api": ServerProcess(data_dir=data_dir, database_url=database_url, role="api"),
        **{
            name: ServerProcess(
                data_dir=data_dir, database_url=database_url, role="worker", sweep_interval_s=60
            )
            for name in ("worker-1", "worker-2")
        },
    }
    try:
        yield {name: proc.wait_ready() for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


def test_an_api_process_and_two_workers_close_each_round_once(processes):
    # Prepare: volunteers see the API process only
    api = processes["api"].client()
    run = create_run(api, server_run_config(rounds={"quorum": 2, "target": 2, "max_rounds": 3}))
    tokens = [register(api, f"v{i}") for i in range(2)]

    # Execute: three rounds of two uploads each
    for index in (1, 2, 3):
        for token in tokens:
            work = train(api, token, run["id"], steps=1)
            assert work.lease["round"] == index
            assert upload(api, token, work).status_code == 201
        wait_for(
            lambda i=index: api.get(f"{API}/runs/{run['id']}").json()["checkpoint_version"] == i,
            timeout=40,
            what=f"round {index} to close (woken by NOTIFY, not the 60 s sweep)",
        )

    # Assert: one close per round across the workers, none by the API process
    for proc in processes.values():
        proc.stop()
    closes = {
        name: [m.group(2) for m in CLOSED_LINE.finditer(proc.output())]
        for name, proc in processes.items()
    }
    assert closes["api"] == []
    assert sorted(closes["worker-1"] + closes["worker-2"]) == ["1", "2", "3"], closes


def test_a_worker_serves_health_and_metrics_but_no_api(processes):
    worker = processes["worker-1"].client()

    health = worker.get("/healthz")
    assert health.status_code == 200 and health.json()["role"] == "worker"
    assert worker.get("/metrics").status_code == 200
    assert worker.get(f"{API}/runs").status_code == 404
    assert processes["api"].client().get("/healthz").json()["role"] == "api"


def test_an_unknown_role_is_a_usage_error(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", "serve", "--role", "janitor",
         "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip

    assert done.returncode == 2 and "--role must be all, api or worker" in done.stderr
