"""How often volunteers heartbeat, end to end: a real ``diloco serve`` on a real Postgres
advises an interval in each lease and heartbeat answer from its live leases and budget
(``diloco.protocol.heartbeats``), and the volunteer client follows it; the heartbeat's fast
lane answers as the route does; ``/healthz`` answers while every pooled connection waits.

The server here has a budget of 1 heartbeat a second and counts its live leases every
0.2 s, so that a handful of leases moves the advice. Each test gives back the leases it
took, so that the next one on the same server starts from none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import asyncpg
import httpx
import pytest

from client.api import ServerAPI
from client.heartbeating import Heartbeats
from client.progress import Reporter
from client.worker_options import Reactions
from tests.conftest import server_run_config
from tests.support.contribute import API, auth, create_run, register
from tests.support.live import ServerProcess, wait_for

BUDGET = 1.0  # heartbeats a second the hub asks for, in all
TTL_S = 30.0  # the runs' lease TTL: the advice stays within TTL / 3 = 10 s


@pytest.fixture(scope="module")
def hub(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        proc = ServerProcess(
            data_dir=tmp_path_factory.mktemp("srv"),
            database_url=url,
            heartbeat_budget_per_s=BUDGET,
            pulse_interval_s=0.2,
        )
        try:
            proc.wait_ready()
            yield {"proc": proc, "database_url": url}
        finally:
            proc.stop()


@pytest.fixture
def http(hub: dict[str, Any]) -> Iterator[httpx.Client]:
    with hub["proc"].client() as client:
        yield client


def _run(http: httpx.Client, interval_s: float) -> str:
    rounds = {"quorum": 50, "heartbeat_interval_s": interval_s, "lease_ttl_s": TTL_S}
    return str(create_run(http, server_run_config(rounds=rounds))["id"])


def _join(http: httpx.Client, token: str, run_id: str) -> dict[str, Any]:
    r = http.post(f"{API}/runs/{run_id}/join", headers=auth(token))
    assert r.status_code == 200, r.text
    return dict(r.json())


def _beat(
    http: httpx.Client, token: str, lease: dict[str, Any], content_type: str = "application/json"
) -> httpx.Response:
    return http.post(
        f"{API}/runs/{lease['run_id']}/rounds/{lease['round']}/heartbeat",
        content=f'{{"lease_id": "{lease["lease_id"]}", "step": 2, "loss": 3.5}}',
        headers={**auth(token), "Content-Type": content_type},
    )


def _advised(http: httpx.Client, token: str, lease: dict[str, Any]) -> float:
    r = _beat(http, token, lease)
    assert r.status_code == 200, r.text
    return float(r.json()["heartbeat_interval_s"])


def _release_all(http: httpx.Client, held: list[tuple[str, dict[str, Any]]]) -> None:
    for token, lease in held:
        path = f"{API}/runs/{lease['run_id']}/rounds/{lease['round']}/lease"
        assert http.delete(path, headers=auth(token)).status_code == 204


def test_leases_and_heartbeats_advise_an_interval_that_follows_the_hubs_live_leases(http):
    # Prepare: run A heartbeats every 1 s by its config, run B every 12 s
    run_a, run_b = _run(http, 1.0), _run(http, 12.0)
    tokens = [register(http, f"adv-{i}") for i in range(11)]
    held = [(t, _join(http, t, run_a)) for t in tokens[:3]]
    first_token, first = held[0]

    # Execute + Assert: 3 live leases at 1 a second: every 3 s
    wait_for(lambda: _advised(http, first_token, first) == 3.0, timeout=30,
             what="the advice for 3 live leases")  # fmt: skip

    # a run whose own interval is longer keeps its own, in its lease and its answers
    b_lease = _join(http, tokens[3], run_b)
    held.append((tokens[3], b_lease))
    assert b_lease["heartbeat_interval_s"] == 12.0
    assert _advised(http, tokens[3], b_lease) == 12.0

    # 11 live leases over both runs: 11 s would leave fewer than 3 heartbeats a TTL: 10 s
    held += [(t, _join(http, t, run_a)) for t in tokens[4:]]
    wait_for(lambda: _advised(http, first_token, first) == TTL_S / 3, timeout=30,
             what="the advice capped at a third of the TTL")  # fmt: skip
    again = _join(http, first_token, run_a)  # the same lease, renewed: the advice now
    assert again["lease_id"] == first["lease_id"] and again["heartbeat_interval_s"] == 10.0
    beat = _beat(http, first_token, first).json()
    assert set(beat) == {"lease_expires_at", "round_state", "deadline", "heartbeat_interval_s"}

    # leases given back: the load drops and so does the advice (4 live: 4 s)
    _release_all(http, held[4:])
    wait_for(lambda: _advised(http, first_token, first) == 4.0, timeout=30,
             what="the advice to follow the load down")  # fmt: skip
    _release_all(http, held[:4])


def _scenarios(
    http: httpx.Client, held: list[tuple[str, dict[str, Any]]]
) -> dict[str, tuple[str, dict[str, Any], str | None]]:
    """name -> (token, lease-like target, raw body or None for the lease's own); the
    leases taken are added to ``held``."""
    run_id = _run(http, 1.0)
    token, other = register(http, "lane-a"), register(http, "lane-b")
    lease, theirs = _join(http, token, run_id), _join(http, other, run_id)
    held += [(token, lease), (other, theirs)]
    return {
        "renewed": (token, lease, None),
        "unknown token": ("ctr_nobody", lease, None),
        "someone else's lease": (token, theirs, None),
        "no such run": (token, {**lease, "run_id": "run_nope"}, None),
        "no such round": (token, {**lease, "round": 99}, None),
        "round index out of bounds": (token, {**lease, "round": 0}, None),
        "invalid body": (token, lease, '{"lease_id": "x", "step": -1}'),
        "not JSON": (token, lease, '{"lease_id": '),
        "empty body": (token, lease, ""),
    }


def test_the_fast_lane_answers_every_heartbeat_as_the_route_does(http):
    # The lane takes "application/json"; a charset parameter, which FastAPI accepts too,
    # leaves the request to the route. Each scenario is sent both ways.
    def send(token: str, target: dict[str, Any], raw: str | None, content_type: str) -> tuple:
        path = f"{API}/runs/{target['run_id']}/rounds/{target['round']}/heartbeat"
        body = raw if raw is not None else f'{{"lease_id": "{target["lease_id"]}"}}'
        r = http.post(path, content=body, headers={**auth(token), "Content-Type": content_type})
        answer = r.json()
        if r.status_code == 200:  # the same fields; the expiry moves with each renewal
            return r.status_code, sorted(answer), answer["round_state"], answer["deadline"]
        return r.status_code, answer["error"], answer["detail"]

    held: list[tuple[str, dict[str, Any]]] = []
    try:
        for name, (token, target, raw) in _scenarios(http, held).items():
            lane = send(token, target, raw, "application/json")
            route = send(token, target, raw, "application/json; charset=utf-8")

            assert lane == route, name
            expected = {"renewed": 200, "unknown token": 401, "someone else's lease": 409,
                        "no such run": 404, "no such round": 409}  # fmt: skip
            assert lane[0] == expected.get(name, 422), (name, lane)
    finally:
        _release_all(http, held)


def test_the_lane_counts_its_heartbeats_under_the_routes_template(http):
    run_id = _run(http, 1.0)
    token = register(http, "counted")
    lease = _join(http, token, run_id)
    series = (
        'diloco_http_requests_total{method="POST",'
        'route="/api/v1/runs/{run_id}/rounds/{index}/heartbeat",status="200"}'
    )

    def count() -> float:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith(series):
                return float(line.split()[-1])
        return 0.0

    before = count()
    for _ in range(3):
        assert _beat(http, token, lease).status_code == 200
    _release_all(http, [(token, lease)])

    assert count() == before + 3


def test_the_client_heartbeats_at_the_interval_the_server_advises(hub, http):
    # Prepare: a run of 1 s heartbeats on a hub advising 10 s (its budget is spent); the
    # client's loop with a clock that records each wait instead of sleeping, and dice
    # that always draw 0.5
    run_id = _run(http, 1.0)
    token = register(http, "obedient")
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) > 4:
            raise asyncio.CancelledError  # four heartbeats are enough
        await asyncio.sleep(0)

    async def loop() -> Any:
        async with ServerAPI(hub["proc"].url, token=token) as api:
            lease = await api.join(run_id)
            mine = {"run_id": run_id, "round": lease.round, "lease_id": lease.lease_id}
            others = [register(http, f"crowd-{i}") for i in range(10)]
            crowd = [(t, _join(http, t, run_id)) for t in others]  # 11 live leases: 10 s
            try:
                await asyncio.to_thread(
                    wait_for, lambda: _advised(http, token, mine) == 10.0, timeout=30,
                    what="the hub to advise 10 s",
                )  # fmt: skip
                beats = Heartbeats(
                    api, Reactions(), Reporter(quiet=True), sleep=sleep, draw=lambda: 0.5
                )
                with pytest.raises(asyncio.CancelledError):
                    await beats.run(lease, lambda: (1, 3.0), threading.Event())
            finally:
                _release_all(http, [*crowd, (token, mine)])
            return lease

    # Execute
    lease = asyncio.run(loop())

    # Assert: the lease's advice first; then the answers' 10 s (reached at a random point
    # of the new interval when the advice changed), never the run's own 1 s
    first = lease.heartbeat_interval_s
    changed = [] if first == 10.0 else [5.0]
    assert waits == [first, *changed, 10.0, 10.0, 10.0][: len(waits)], waits
    assert len(waits) == 5 and waits[-1] == 10.0


def test_healthz_answers_while_every_pooled_connection_waits_on_the_database(hub, http):
    # Prepare: a volunteer's lease; then the contributors table is locked, so that every
    # heartbeat (its statement marks the contributor seen) waits, holding a pooled
    # connection: more heartbeats than the pool has connections
    run_id = _run(http, 1.0)
    token = register(http, "patient")
    lease = _join(http, token, run_id)

    async def lock(locked: threading.Event, release: threading.Event) -> None:
        dsn = hub["database_url"].replace("postgresql+asyncpg://", "postgresql://")
        conn = await asyncpg.connect(dsn)
        try:
            async with conn.transaction():
                await conn.execute("LOCK TABLE contributors IN ACCESS EXCLUSIVE MODE")
                locked.set()
                await asyncio.to_thread(release.wait, 60)
        finally:
            await conn.close()

    locked, release = threading.Event(), threading.Event()
    locker = threading.Thread(target=asyncio.run, args=(lock(locked, release),))
    locker.start()
    try:
        assert locked.wait(30)
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            clients = [hub["proc"].client() for _ in range(12)]
            pending = [pool.submit(_beat, c, token, lease) for c in clients]

            # Execute: a load balancer asks while they all wait
            health = http.get("/healthz")
            waiting = sum(not f.done() for f in pending)
            release.set()
            answers = [f.result(timeout=60) for f in pending]
            for c in clients:
                c.close()
    finally:
        release.set()
        locker.join(timeout=60)

    _release_all(http, [(token, lease)])

    # Assert: /healthz answered from the pulse, ahead of them; then they all went through
    assert health.status_code == 200, health.text
    body = health.json()
    assert body["status"] == "ok" and body["database"] == "ok"
    assert 0 <= body["database_checked_s_ago"] < 5, body
    assert waiting == len(pending), "the heartbeats were not waiting: the lock did not hold"
    assert [a.status_code for a in answers] == [200] * len(pending)


def test_healthz_other_methods_are_405_as_before(http):
    r = http.post("/healthz")

    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"
    assert r.headers["allow"] == "GET"
