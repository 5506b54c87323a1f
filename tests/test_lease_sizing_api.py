"""Each lease's H against a real server (``diloco serve`` on a migrated Postgres): sized to
the speed the volunteer reports with its join, else to what the server measured of its
accepted contributions in the run, within [min_steps, max_steps]; unknown speed gets the
nominal steps; the lease's H caps what its contribution weighs.

The join's ``now`` is the server's: each expected H is bracketed by the pure rule
evaluated at the times just before and just after the request (fewer steps the later)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import pytest

from diloco.config import parse_config
from diloco.protocol.reputation import counted_weight, standing
from diloco.protocol.sizing import StepBounds, observed_rate, size_lease
from tests.conftest import server_run_config
from tests.support.contribute import API, auth, create_run, register, train, upload
from tests.support.live import ServerProcess, wait_for

# 128 tokens a step (batch 4 x block 32); H = 40 in [10, 80]
INNER = {"steps": 40, "min_steps": 10, "max_steps": 80, "batch_size": 4}


@pytest.fixture(scope="module")
def db_url(pg_admin_url: str):  # type: ignore[no-untyped-def]
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        yield url


@pytest.fixture(scope="module")
def server(db_url: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    proc = ServerProcess(data_dir=tmp_path_factory.mktemp("srv"), database_url=db_url)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def join(http: httpx.Client, token: str, run_id: str, body: Any = None) -> httpx.Response:
    return http.post(f"{API}/runs/{run_id}/join", headers=auth(token), json=body)


def joined_between(
    http: httpx.Client, token: str, run_id: str, body: Any = None
) -> tuple[dict[str, Any], datetime, datetime]:
    before = datetime.now(UTC)
    r = join(http, token, run_id, body)
    after = datetime.now(UTC)
    assert r.status_code == 200, r.text
    return r.json(), before, after


def expected_range(
    lease: dict[str, Any], before: datetime, after: datetime, **speed: float | None
) -> tuple[int, int]:
    """The fewest and the most steps the rule gives between ``before`` and ``after``."""
    cfg = parse_config(lease["config"])
    deadline = datetime.fromisoformat(lease["deadline"])
    bounds = StepBounds.of(cfg.inner)
    late, early = (
        size_lease(t, deadline, bounds, tokens_per_step=cfg.tokens_per_step, **speed).steps
        for t in (after, before)
    )
    return late, early


def test_a_leases_h_follows_the_reported_speed_within_the_bounds(http):
    # Prepare: a run whose round stays open (quorum 5), four volunteers
    run_id = create_run(
        http, server_run_config(inner=INNER, rounds={"quorum": 5, "timeout_s": 600})
    )["id"]
    slow, fast, unknown, middling = (register(http, n) for n in ("slow", "fast", "unk", "mid"))

    # Execute: 1 token/s fits 3 steps in ~590 x 0.8 s; 10^6 fits millions; 10 fits ~36
    slow_lease = join(http, slow, run_id, {"tokens_per_s": 1.0}).json()
    fast_lease = join(http, fast, run_id, {"tokens_per_s": 1e6}).json()
    unknown_lease = join(http, unknown, run_id).json()
    mid_lease, before, after = joined_between(http, middling, run_id, {"tokens_per_s": 10.0})
    again = join(http, slow, run_id, {"tokens_per_s": 1e6}).json()

    # Assert: bounded, nominal when unknown, in between as the rule says
    assert slow_lease["inner_steps"] == 10  # min_steps
    assert fast_lease["inner_steps"] == 80  # max_steps
    assert unknown_lease["inner_steps"] == 40  # the nominal H
    low, high = expected_range(mid_lease, before, after, reported=10.0)
    assert low <= mid_lease["inner_steps"] <= high
    assert 10 < mid_lease["inner_steps"] < 40
    # a renewed lease keeps its H whatever is reported now
    assert (again["lease_id"], again["inner_steps"]) == (slow_lease["lease_id"], 10)
    # the lr schedule keeps indexing by the nominal H; the deadline comes with its seconds
    assert {x["start_step"] for x in (slow_lease, fast_lease, mid_lease)} == {0}
    assert 500 < mid_lease["deadline_in_s"] <= 600
    # the run view (the dashboard) shows each lease's H
    leases = http.get(f"{API}/runs/{run_id}").json()["current_round"]["leases"]
    assert [x["inner_steps"] for x in leases] == [10, 80, 40, mid_lease["inner_steps"]]


@pytest.mark.parametrize(
    "body", [{"tokens_per_s": 0}, {"tokens_per_s": -3}, {"tokens_per_s": 1e12},
             {"tokens_per_s": "fast"}, [1, 2]],
)  # fmt: skip
def test_a_join_body_that_is_no_speed_is_refused_with_422(http, body):
    run_id = create_run(http, server_run_config(inner=INNER))["id"]
    token = register(http, "liar")

    r = join(http, token, run_id, body)

    assert r.status_code == 422, r.text
    assert r.json()["error"] == "invalid_request"
    # nothing was leased: a proper join afterwards gets the round's first lease
    assert join(http, token, run_id).json()["inner_steps"] == 40


def test_a_claim_weighs_at_most_what_its_sized_lease_holds(http):
    # Prepare: a slow report gets a lease of min_steps = 10 (1,280 tokens)
    run_id = create_run(
        http, server_run_config(inner=INNER, rounds={"quorum": 5, "timeout_s": 600})
    )["id"]
    token = register(http, "braggart")
    assert join(http, token, run_id, {"tokens_per_s": 1.0}).json()["inner_steps"] == 10
    work = train(http, token, run_id, steps=2)  # its join renews the same lease
    assert work.lease["inner_steps"] == 10

    # Execute: upload 2 steps' work claiming a million tokens and 1,000 steps
    r = upload(http, token, work, work.body(tokens=10**6, inner_steps=1000))

    # Assert: it weighs 10 steps' tokens, not the nominal 40's, and records 10 steps
    assert r.status_code == 201, r.text
    rows = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"]
    # (at a new account's standing: diloco.protocol.reputation)
    counted = counted_weight(10 * 128, 0, standing(0, 0))
    assert [(c["weight"], c["inner_steps"]) for c in rows] == [(counted, 10)]


async def _samples(database_url: str, run_id: str) -> list[tuple[int, float]]:
    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        rows = await conn.fetch(
            "SELECT x.weight, extract(epoch FROM x.created_at - l.issued_at)::float8 AS s "
            "FROM contributions x JOIN leases l ON l.id = x.lease_id WHERE x.run_id = $1",
            run_id,
        )
        return [(int(r["weight"]), float(r["s"])) for r in rows]
    finally:
        await conn.close()


def test_without_a_report_the_servers_record_of_past_rounds_sizes_the_lease(http, db_url):
    # Prepare: rounds that close on one contribution and last 60 s
    run_id = create_run(
        http,
        server_run_config(inner=INNER, rounds={"quorum": 1, "timeout_s": 60, "max_rounds": 3}),
    )["id"]
    token = register(http, "steady")

    # Execute: round 1 with no speed known, uploaded ~2.5 s after the lease (2 steps, 256
    # tokens: ~100 tokens/s); then round 2's join, again without a report
    work = train(http, token, run_id, steps=2)
    time.sleep(2.5)
    assert upload(http, token, work).status_code == 201
    wait_for(
        lambda: http.get(f"{API}/runs/{run_id}").json()["current_round"]["index"] == 2,
        timeout=60,
        what="round 2 to open",
    )
    second, before, after = joined_between(http, token, run_id)

    # Assert: round 1 had the nominal H; round 2's follows the measured rate, which the
    # test reads back from the rows (tokens it weighs / seconds from lease to upload)
    assert work.lease["inner_steps"] == 40
    observed = observed_rate(asyncio.run(_samples(db_url, run_id)))
    assert observed is not None and 10 < observed < 256 / 2.5
    low, high = expected_range(second, before, after, observed=observed)
    assert low <= second["inner_steps"] <= high
    assert 10 <= second["inner_steps"] < 40
