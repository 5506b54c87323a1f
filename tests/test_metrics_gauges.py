"""/metrics' per-run gauges (``server.metrics.RunGauges``), read from real ``diloco serve``
processes, an API one and a round worker on one database (both serve /metrics), and the
Grafana dashboard (deploy/grafana/) checked against what a live scrape names."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.db import asyncpg_dsn
from tests.conftest import server_run_config
from tests.support.contribute import API, auth, create_run, register, train, upload
from tests.support.live import ServerProcess, admin_headers, wait_for

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "diloco-hub.json"
RUN_GAUGES = (
    "diloco_run_status",
    "diloco_run_round",
    "diloco_run_open_round_accepted",
    "diloco_run_active_volunteers",
    "diloco_run_eval_loss",
    "diloco_run_eval_version",
    "diloco_run_seconds_since_close",
)
METRIC_NAME = re.compile(r"\b((?:diloco|process|python)_[a-z0-9_]+)")


@pytest.fixture(scope="module")
def hub(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """An API process and a round worker on one fresh database and data dir."""
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        data_dir = tmp_path_factory.mktemp("gauges")
        procs = {
            "api": ServerProcess(data_dir=data_dir, database_url=url, role="api"),
            "worker": ServerProcess(data_dir=data_dir, database_url=url, role="worker"),
        }
        try:
            yield {"url": url, **{name: p.wait_ready() for name, p in procs.items()}}
        finally:
            for proc in procs.values():
                proc.stop()


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(proc: ServerProcess) -> tuple[Samples, set[str]]:
    """The samples of one /metrics scrape, and every name it declares: each family's, each
    sample's, and what a query may add to a family (``_total``, ``_bucket``, ...)."""
    r = httpx.get(f"{proc.url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    samples: Samples = {}
    names: set[str] = set()
    for family in text_string_to_metric_families(r.text):
        names.add(family.name)
        suffixes = {
            "counter": ("_total", "_created"),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"),
        }.get(family.type, ())
        names.update(family.name + s for s in suffixes)
        for s in family.samples:
            names.add(s.name)
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, names


def run_values(samples: Samples, run_id: str) -> dict[str, Any]:
    """The per-run gauges of one run: name -> value (status: status -> value)."""
    out: dict[str, Any] = {}
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if lab.get("run") != run_id:
            continue
        if name == "diloco_run_status":
            out.setdefault(name, {})[lab["status"]] = value
        else:
            out[name] = value
    return out


def wait_gauges(proc: ServerProcess, run_id: str, want: dict[str, Any], what: str) -> dict:
    """Scrape until the run's gauges include ``want`` (a refresh is at most 2 s old)."""
    seen: dict[str, Any] = {}

    def matches() -> bool:
        nonlocal seen
        seen = run_values(scrape(proc)[0], run_id)
        return all(seen.get(k) == v for k, v in want.items())

    try:
        wait_for(matches, timeout=30, what=what, every=0.5)
    except AssertionError as err:
        raise AssertionError(f"{err}; last seen {seen}") from None
    return seen


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_per_run_gauges_follow_a_run_from_every_role(hub):
    # Prepare: a run whose rounds need two uploads, leases that outlive the test
    api = httpx.Client(base_url=hub["api"].url, timeout=60)
    config = server_run_config(
        rounds={"quorum": 2, "target": 2, "max_rounds": 5, "lease_ttl_s": 900}
    )
    run = create_run(api, {**config, "name": "gauged"})
    run_id = run["id"]
    tokens = [register(api, f"gauge-{i}") for i in range(2)]
    fresh = wait_gauges(hub["api"], run_id, {"diloco_run_round": 1}, "the new run's gauges")
    assert fresh["diloco_run_status"] == {
        "active": 1.0, "paused": 0.0, "completed": 0.0, "cancelled": 0.0,
    }  # fmt: skip
    assert fresh["diloco_run_open_round_accepted"] == 0
    assert fresh["diloco_run_seconds_since_close"] < 120  # since it was created

    # Execute: round 1 closes with two uploads; in round 2 one upload, and a lease
    for token in tokens:
        assert upload(api, token, train(api, token, run_id, steps=1)).status_code == 201
    wait_for(
        lambda: api.get(f"{API}/runs/{run_id}/rounds").json()["rounds"][0]["eval_loss"],
        timeout=120,
        what="round 1 to close and its version to be evaluated",
    )
    assert upload(api, tokens[0], train(api, tokens[0], run_id, steps=1)).status_code == 201
    assert api.post(f"{API}/runs/{run_id}/join", headers=auth(tokens[1])).status_code == 200
    first = api.get(f"{API}/runs/{run_id}/rounds").json()["rounds"][0]

    # Assert: the API process and the worker say the same, as the API does
    want = {
        "diloco_run_round": 2,
        "diloco_run_open_round_accepted": 1,
        "diloco_run_active_volunteers": 2,
        "diloco_run_eval_version": 1,
    }
    for role in ("api", "worker"):
        got = wait_gauges(hub[role], run_id, want, f"round 2's gauges from the {role} process")
        assert got["diloco_run_eval_loss"] == pytest.approx(first["eval_loss"])
        since = time.time() - epoch(first["closed_at"])
        assert got["diloco_run_seconds_since_close"] == pytest.approx(since, abs=10)
        assert got["diloco_run_status"]["active"] == 1.0

    # a cancelled run keeps its series for an hour after it ended, then they go
    assert api.post(f"{API}/runs/{run_id}/cancel", headers=admin_headers()).status_code == 200
    cancelled = {"active": 0.0, "paused": 0.0, "completed": 0.0, "cancelled": 1.0}
    ended = wait_gauges(hub["worker"], run_id, {"diloco_run_status": cancelled}, "the cancel")
    assert ended["diloco_run_round"] == 2

    async def age_it() -> None:
        conn = await asyncpg.connect(asyncpg_dsn(hub["url"]))
        try:
            await conn.execute(
                "UPDATE runs SET updated_at = now() - interval '2 hours' WHERE id = $1", run_id
            )
        finally:
            await conn.close()

    asyncio.run(age_it())
    wait_for(
        lambda: not run_values(scrape(hub["api"])[0], run_id),
        timeout=30,
        what="the run that ended two hours ago to leave /metrics",
        every=0.5,
    )


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' (rows' too) and variables'."""
    exprs: list[str] = []

    def panels(items: list[dict[str, Any]]) -> None:
        for panel in items:
            panels(panel.get("panels", []))
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))

    panels(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def test_the_grafana_dashboard_queries_only_what_metrics_has(hub):
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = dashboard_exprs(dashboard)
    queried = {m for e in exprs for m in METRIC_NAME.findall(e)}
    declared = scrape(hub["api"])[1] | scrape(hub["worker"])[1]

    assert queried - declared == set(), "the dashboard queries metrics /metrics lacks"
    assert set(RUN_GAUGES) <= queried, "a per-run gauge has no panel"
    # importable anywhere: the Prometheus data source is a variable every query uses
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = []
    for panel in dashboard["panels"]:
        ids.append(panel["id"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    assert len(ids) == len(set(ids))
    assert isinstance(dashboard["schemaVersion"], int)
