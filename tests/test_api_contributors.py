"""Accounts and credit against a real server on a real Postgres: credit is tokens x 6 x N for
contributions that went into an outer step and for nothing else; the leaderboard, one's own
profile and hardware report; lease release; the speed test; request metrics."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from diloco.protocol.reputation import counted_weight, standing
from server.http.errors import BodyTooLarge
from server.speedtest import MAX_BYTES, drain
from tests.conftest import server_run_config
from tests.support.contribute import API, Work, auth, create_run, register, train, upload
from tests.support.live import ServerProcess, admin_headers, wait_for

FLOPS = 6  # training FLOPs per parameter per token


@pytest.fixture(scope="module")
def server(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        proc = ServerProcess(data_dir=tmp_path_factory.mktemp("srv"), database_url=url)
        try:
            yield proc.wait_ready()
        finally:
            proc.stop()


def new_run(http: httpx.Client, **rounds: object) -> dict:
    """Leases live 10 minutes here: a round waits for a live lease unless it is released.
    Credit is confirmed at the close (no escrow: tests/test_escrow.py follows credit that
    waits for audits), so that these tests count what a close credits."""
    rounds = {"quorum": 1, "timeout_s": 600, "lease_ttl_s": 600, **rounds}
    config = server_run_config(rounds=rounds)
    config["audit"] = {"escrow": False}
    return create_run(http, config)


def board(http: httpx.Client, **params: object) -> dict:
    r = http.get(f"{API}/contributors", params=params)
    assert r.status_code == 200, r.text
    return dict(r.json())


def me(http: httpx.Client, token: str) -> dict:
    r = http.get(f"{API}/contributors/me", headers=auth(token))
    assert r.status_code == 200, r.text
    return dict(r.json())


def checkpoint_version(http: httpx.Client, run_id: str) -> int:
    return int(http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"])


# ---------------------------------------------------------------- credit


@dataclass
class Scenario:
    run: dict  # round 1 closed with zed, amy and mia aggregated
    cancelled: dict  # zed's contribution accepted, then the run cancelled: never aggregated
    tokens: dict[str, str]  # name -> bearer token
    ids: dict[str, str]  # name -> contributor id
    work: dict[str, Work]  # name -> its contribution to `run`
    cancelled_work: Work


@pytest.fixture(scope="module")
def scenario(server: ServerProcess) -> Scenario:
    with server.client() as http:
        run = new_run(http, quorum=3, target=3, max_staleness=0)  # "late" is refused
        tokens = {name: register(http, name) for name in ("zed", "amy", "mia", "late")}
        ids = {name: me(http, t)["id"] for name, t in tokens.items()}
        steps = {"zed": 3, "amy": 1, "mia": 2, "late": 1}  # distinct tokens, so distinct credit
        work = {name: train(http, tokens[name], run["id"], steps=steps[name]) for name in tokens}

        # rejected: a wrong base version and a truncated body leave no row
        bad_base = upload(http, tokens["late"], work["late"], work["late"].body(base_version=3))
        assert (bad_base.status_code, bad_base.json()["error"]) == (409, "base_version_mismatch")
        truncated = upload(http, tokens["late"], work["late"], work["late"].body()[:-100])
        assert (truncated.status_code, truncated.json()["error"]) == (400, "malformed_upload")
        for name in ("zed", "amy", "mia"):
            assert upload(http, tokens[name], work[name]).status_code == 201
        wait_for(
            lambda: checkpoint_version(http, run["id"]) == 1,
            timeout=120,
            what="round 1 to close at its target",
        )
        # late: the round closed without it
        late = upload(http, tokens["late"], work["late"])
        assert (late.status_code, late.json()["error"]) == (409, "round_closed")

        cancelled = new_run(http, quorum=2)
        cancelled_work = train(http, tokens["zed"], cancelled["id"], steps=1)
        assert upload(http, tokens["zed"], cancelled_work).status_code == 201
        r = http.post(f"{API}/runs/{cancelled['id']}/cancel", headers=admin_headers())
        assert r.json()["status"] == "cancelled"
    return Scenario(run, cancelled, tokens, ids, work, cancelled_work)


def test_credit_is_tokens_times_6n_for_aggregated_contributions_only(http, scenario):
    run, ids, work = scenario.run, scenario.ids, scenario.work
    n = http.get(f"{API}/runs/{run['id']}").json()["n_params"]
    # each one's first contribution: a new account's standing (diloco.protocol.reputation)
    new = standing(verified=0, failed=0)
    credit = {
        name: counted_weight(work[name].meta.tokens, 0, new) * FLOPS * n
        for name in ("zed", "amy", "mia")
    }

    per_run = board(http, run=run["id"])
    overall = {e["id"]: e for e in board(http, limit=1000)["contributors"]}
    cancelled = board(http, run=scenario.cancelled["id"])

    # the run's board: the three aggregated contributions, exactly; nobody else
    assert per_run["run_id"] == run["id"] and per_run["total"] == 3
    assert [(e["id"], e["credit"]) for e in per_run["contributors"]] == [
        (ids["zed"], credit["zed"]),
        (ids["mia"], credit["mia"]),
        (ids["amy"], credit["amy"]),
    ]
    for e in per_run["contributors"]:
        name = next(k for k, v in ids.items() if v == e["id"])
        assert (e["accepted"], e["aggregated"], e["tokens"]) == (1, 1, work[name].meta.tokens)
    # overall: zed's cancelled-run contribution counts as accepted, earns nothing
    zed = overall[ids["zed"]]
    assert (zed["accepted"], zed["aggregated"]) == (2, 1)
    assert (zed["tokens"], zed["credit"]) == (work["zed"].meta.tokens, credit["zed"])
    late = overall[ids["late"]]  # rejected twice, then late: registered, nothing earned
    assert (late["accepted"], late["aggregated"], late["tokens"], late["credit"]) == (0, 0, 0, 0)
    assert cancelled["total"] == 1
    (only,) = cancelled["contributors"]
    assert (only["id"], only["accepted"], only["aggregated"]) == (ids["zed"], 1, 0)
    assert (only["tokens"], only["credit"]) == (0, 0)


def test_profile_totals_runs_and_recent_contributions(http, scenario):
    run, cancelled, work = scenario.run, scenario.cancelled, scenario.work
    n = http.get(f"{API}/runs/{run['id']}").json()["n_params"]
    # its first contribution, at a new account's standing
    earned = counted_weight(work["zed"].meta.tokens, 0, standing(0, 0)) * FLOPS * n

    zed = me(http, scenario.tokens["zed"])
    late = me(http, scenario.tokens["late"])

    # one contribution verified (a step took it): one more share of its weight
    assert (zed["standing"], late["standing"]) == (standing(1, 0), standing(0, 0))

    assert zed["totals"] == {
        "accepted": 2,
        "aggregated": 1,
        "tokens": work["zed"].meta.tokens,
        "credit": earned,
        "pending_credit": 0,
    }
    assert [
        (r["run_id"], r["run_name"], r["accepted"], r["aggregated"], r["credit"], r["last_round"])
        for r in zed["runs"]
    ] == [
        (run["id"], run["name"], 1, 1, earned, 1),
        (cancelled["id"], cancelled["name"], 1, 0, 0, 1),
    ]
    assert [
        (c["run_id"], c["round"], c["aggregated"], c["credit"], c["credit_status"])
        for c in zed["recent"]
    ] == [(cancelled["id"], 1, False, 0, "confirmed"), (run["id"], 1, True, earned, "confirmed")]
    assert zed["recent"][0]["tokens"] == scenario.cancelled_work.meta.tokens
    assert zed["recent"][1]["loss"] == pytest.approx(work["zed"].meta.loss)
    assert late["totals"] == {
        "accepted": 0, "aggregated": 0, "tokens": 0, "credit": 0, "pending_credit": 0
    }  # fmt: skip
    assert (late["runs"], late["recent"]) == ([], [])


@pytest.mark.parametrize(
    ("sort", "order", "expected"),
    [
        ("credit", None, ["zed", "mia", "amy"]),
        ("credit", "asc", ["amy", "mia", "zed"]),
        ("tokens", None, ["zed", "mia", "amy"]),
        ("name", None, ["amy", "mia", "zed"]),  # names default to A to Z
        ("name", "desc", ["zed", "mia", "amy"]),
        ("created", None, ["mia", "amy", "zed"]),  # registered zed, amy, mia
        ("created", "asc", ["zed", "amy", "mia"]),
        ("accepted", None, ["zed", "amy", "mia"]),  # all 1: ties by registration
        ("aggregated", "asc", ["zed", "amy", "mia"]),
        ("last_seen", None, ["zed", "mia", "amy"]),  # zed uploaded to the cancelled run last
        ("last_seen", "asc", ["amy", "mia", "zed"]),
    ],
)
def test_run_board_sorts_and_orders(http, scenario, sort, order, expected):
    params = {"run": scenario.run["id"], "sort": sort} | ({"order": order} if order else {})

    answer = board(http, **params)

    names = {v: k for k, v in scenario.ids.items()}
    assert [names[e["id"]] for e in answer["contributors"]] == expected
    assert answer["sort"] == sort
    assert answer["order"] == order or ("asc" if sort == "name" else "desc")
    assert [e["rank"] for e in answer["contributors"]] == [1, 2, 3]


def test_pages_rank_across_offsets_and_the_overall_board_lists_everyone(http, scenario):
    full = board(http, limit=1000)
    page = board(http, limit=2, offset=1)
    run_page = board(http, run=scenario.run["id"], limit=1, offset=1)
    past_the_end = board(http, offset=full["total"])

    assert full["total"] == len(full["contributors"]) >= 4
    assert set(scenario.ids.values()) <= {e["id"] for e in full["contributors"]}
    assert [e["rank"] for e in full["contributors"]] == list(range(1, full["total"] + 1))
    credits = [e["credit"] for e in full["contributors"]]
    assert credits == sorted(credits, reverse=True)
    assert page["contributors"] == full["contributors"][1:3]
    assert [e["rank"] for e in page["contributors"]] == [2, 3]
    assert page["total"] == full["total"]
    assert [(e["rank"], e["id"]) for e in run_page["contributors"]] == [(2, scenario.ids["mia"])]
    assert run_page["total"] == 3
    assert past_the_end["contributors"] == [] and past_the_end["total"] == full["total"]


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"sort": "karma"}, "sort"),
        ({"order": "up"}, "order"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"offset": -1}, "offset"),
        ({"run": "x" * 33}, "run"),
    ],
)
def test_bad_board_parameters_are_422_naming_them(http, params, named):
    r = http.get(f"{API}/contributors", params=params)

    assert (r.status_code, r.json()["error"]) == (422, "invalid_request")
    assert r.json()["detail"].startswith(f"{named}:"), r.json()["detail"]


def test_board_of_an_unknown_run_is_404_run_not_found(http):
    r = http.get(f"{API}/contributors", params={"run": "run_000000000000"})

    assert (r.status_code, r.json()["error"]) == (404, "run_not_found")


# ---------------------------------------------------------------- profile and hardware

HARDWARE = {
    "device": "cuda",
    "device_name": "NVIDIA H100 80GB HBM3",
    "memory_bytes": 85_520_809_984,
    "ram_bytes": 135_000_000_000,
    "cpu_count": 16,
    "os": "Linux-6.8.0-x86_64-with-glibc2.39",
    "python": "3.12.3",
    "torch": "2.5.1+cu124",
    "client_version": "0.1.0",
}


def test_hardware_report_is_stored_and_shown_on_the_board(http):
    token = register(http, "reporter")

    r = http.patch(f"{API}/contributors/me", json={"hardware": HARDWARE}, headers=auth(token))
    partial = http.patch(
        f"{API}/contributors/me", json={"hardware": {"device": "mps"}}, headers=auth(token)
    )

    assert r.status_code == 200, r.text
    assert r.json()["hardware"] == HARDWARE
    assert set(r.json()) == {
        "id", "name", "created_at", "last_seen_at", "hardware", "totals", "runs", "recent",
        "quarantined_at", "quarantine_reason", "standing",
    }  # fmt: skip
    assert (r.json()["quarantined_at"], r.json()["quarantine_reason"]) == (None, None)
    assert r.json()["standing"] == standing(verified=0, failed=0)  # a new account
    assert me(http, token)["hardware"] == {k: None for k in HARDWARE} | {"device": "mps"}
    assert partial.json() == me(http, token)
    entry = next(e for e in board(http, limit=1000)["contributors"] if e["id"] == r.json()["id"])
    assert entry["device"] == "mps"


@pytest.mark.parametrize(
    ("hardware", "named"),
    [
        ({"gpu": "yes"}, "hardware.gpu"),  # unknown key
        ({"device": "c" * 17}, "hardware.device"),
        ({"device_name": "x" * 129}, "hardware.device_name"),
        ({"memory_bytes": -1}, "hardware.memory_bytes"),
        ({"cpu_count": 4097}, "hardware.cpu_count"),
        ({"ram_bytes": "16G"}, "hardware.ram_bytes"),
        ({"os": "linux\nrm -rf"}, "hardware.os"),
    ],
)
def test_bad_hardware_is_422_naming_the_field_and_keeps_what_was_stored(http, hardware, named):
    token = register(http, "bad-hardware")
    assert (
        http.patch(
            f"{API}/contributors/me", json={"hardware": {"device": "cpu"}}, headers=auth(token)
        ).status_code
        == 200
    )

    r = http.patch(f"{API}/contributors/me", json={"hardware": hardware}, headers=auth(token))

    assert (r.status_code, r.json()["error"]) == (422, "invalid_request")
    assert named in r.json()["detail"], r.json()["detail"]
    assert me(http, token)["hardware"]["device"] == "cpu"


def test_profile_needs_a_contributor_token(http):
    for headers in ({}, auth("ctr_forged")):
        got = http.get(f"{API}/contributors/me", headers=headers)
        patched = http.patch(f"{API}/contributors/me", json={"hardware": {}}, headers=headers)
        assert (got.status_code, got.json()["error"]) == (401, "unauthorized")
        assert (patched.status_code, patched.json()["error"]) == (401, "unauthorized")


def test_last_seen_moves_forward_with_actions_and_not_with_reads(http):
    token = register(http, "seen")
    run = new_run(http)
    fresh = me(http, token)

    patched = http.patch(f"{API}/contributors/me", json={"hardware": {}}, headers=auth(token))
    after_patch = me(http, token)
    assert http.post(f"{API}/runs/{run['id']}/join", headers=auth(token)).status_code == 200
    after_join = me(http, token)
    entry = next(e for e in board(http, limit=1000)["contributors"] if e["id"] == fresh["id"])

    assert fresh["last_seen_at"] is None  # registered, never active
    assert patched.json()["last_seen_at"] == after_patch["last_seen_at"] is not None
    assert me(http, token)["last_seen_at"] == after_join["last_seen_at"]  # reads do not count
    seen = [datetime.fromisoformat(m["last_seen_at"]) for m in (after_patch, after_join)]
    assert seen[0] < seen[1]
    assert datetime.fromisoformat(entry["last_seen_at"]) == seen[1]


# ---------------------------------------------------------------- lease release


def release(http: httpx.Client, run_id: str, index: int, token: str | None) -> httpx.Response:
    headers = auth(token) if token else {}
    return http.delete(f"{API}/runs/{run_id}/rounds/{index}/lease", headers=headers)


def test_released_lease_lets_a_round_at_quorum_close(http):
    # Prepare: quorum reached, one live lease (10 minutes) holds the round open
    run = new_run(http, quorum=1)
    worker, quitter = register(http, "worker"), register(http, "quitter")
    assert http.post(f"{API}/runs/{run['id']}/join", headers=auth(quitter)).status_code == 200
    work = train(http, worker, run["id"], steps=1)
    assert upload(http, worker, work).status_code == 201
    waiting = http.get(f"{API}/runs/{run['id']}").json()
    assert waiting["checkpoint_version"] == 0
    assert "1 live lease" in waiting["current_round"]["reason"]

    # Execute
    r = release(http, run["id"], 1, quitter)

    # Assert: the round closes without waiting for the lease to lapse
    assert r.status_code == 204 and r.content == b""
    wait_for(
        lambda: checkpoint_version(http, run["id"]) == 1,
        timeout=60,
        what="round 1 to close after the release",
    )
    (round1, *_) = http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"]
    assert round1["close_code"] == "quorum_no_live_leases" and round1["accepted"] == 1
    assert release(http, run["id"], 1, quitter).status_code == 204  # idempotent


def test_lease_release_errors(http):
    run = new_run(http)
    holder, stranger = register(http, "holder"), register(http, "stranger")
    assert http.post(f"{API}/runs/{run['id']}/join", headers=auth(holder)).status_code == 200

    no_lease = release(http, run["id"], 1, stranger)
    other_round = release(http, run["id"], 2, holder)
    unknown_run = release(http, "run_000000000000", 1, holder)
    no_token = release(http, run["id"], 1, None)
    bad_index = release(http, run["id"], 0, holder)

    assert (no_lease.status_code, no_lease.json()["error"]) == (409, "no_lease")
    assert (other_round.status_code, other_round.json()["error"]) == (409, "no_lease")
    assert (unknown_run.status_code, unknown_run.json()["error"]) == (404, "run_not_found")
    assert (no_token.status_code, no_token.json()["error"]) == (401, "unauthorized")
    assert (bad_index.status_code, bad_index.json()["error"]) == (422, "invalid_request")
    live = http.get(f"{API}/runs/{run['id']}").json()["current_round"]["reason"]
    assert "1 live lease" in live  # none of the refused releases touched the holder's lease
    assert release(http, run["id"], 1, holder).status_code == 204
    assert "0 live leases" in http.get(f"{API}/runs/{run['id']}").json()["current_round"]["reason"]


# ---------------------------------------------------------------- speed test


@pytest.mark.parametrize("nbytes", [1, (1 << 20) + 7, None])
def test_speedtest_download_streams_the_asked_size(http, nbytes):
    params = {} if nbytes is None else {"bytes": nbytes}

    r = http.get(f"{API}/speedtest", params=params)

    expected = 8 << 20 if nbytes is None else nbytes
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/octet-stream"
    assert int(r.headers["content-length"]) == len(r.content) == expected
    if expected > 4096:  # random bytes, not zeros: a compressing proxy cannot cheat
        assert len(set(r.content[:4096])) > 200


@pytest.mark.parametrize("nbytes", ["0", str(MAX_BYTES + 1), "lots"])
def test_speedtest_download_of_a_bad_size_is_422(http, nbytes):
    r = http.get(f"{API}/speedtest", params={"bytes": nbytes})

    assert (r.status_code, r.json()["error"]) == (422, "invalid_request")
    assert r.json()["detail"].startswith("bytes:")


def test_speedtest_upload_counts_the_bytes_with_or_without_content_length(http):
    sized = http.post(f"{API}/speedtest", content=b"\x01" * (3 << 20))
    chunked = http.post(f"{API}/speedtest", content=iter([b"ab" * 1000, b"c" * 5]))
    empty = http.post(f"{API}/speedtest", content=b"")

    assert sized.status_code == 200 and sized.json()["bytes"] == 3 << 20
    assert sized.json()["seconds"] >= 0
    assert chunked.json()["bytes"] == 2005
    assert empty.json()["bytes"] == 0


def test_speedtest_upload_over_the_cap_is_413_before_reading(server):
    head = (
        "POST /api/v1/speedtest HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {MAX_BYTES + 1}\r\n\r\n"
    )
    answer = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode())
        while len(answer) < 65536 and (chunk := sock.recv(4096)):
            answer += chunk

    status_line, _, rest = answer.partition(b"\r\n")
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert status_line.split()[1] == b"413"
    assert body["error"] == "body_too_large"


def test_draining_a_stream_stops_past_the_limit():
    async def stream(sizes: list[int]) -> AsyncIterator[bytes]:
        for size in sizes:
            yield b"x" * size

    assert asyncio.run(drain(stream([4, 4, 2]), limit=10)) == 10
    with pytest.raises(BodyTooLarge):
        asyncio.run(drain(stream([4, 4, 3]), limit=10))


# ---------------------------------------------------------------- request metrics

CHECKPOINT_ROUTE = "/api/v1/runs/{run_id}/checkpoints/{version}"


def request_counts(http: httpx.Client) -> dict[tuple[str, str, str], float]:
    text = http.get("/metrics").text
    return {
        (s.labels["method"], s.labels["route"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "diloco_http_requests_total"
    }


def test_metrics_count_downloads_by_route_template_and_status(http):
    run = new_run(http)
    url = f"{API}/runs/{run['id']}/checkpoints/0"
    before = request_counts(http)

    full = http.get(url)
    http.get(url, headers={"Range": "bytes=0-9"})
    http.get(url, headers={"If-None-Match": full.headers["etag"]})
    http.get(f"{API}/runs/{run['id']}/checkpoints/latest")
    http.get("/no/such/path")

    def counted() -> dict[tuple[str, str, str], float] | None:
        now = request_counts(http)
        grown = {k: now[k] - before.get(k, 0) for k in now}
        wanted = {
            ("GET", CHECKPOINT_ROUTE, "200"): 2,
            ("GET", CHECKPOINT_ROUTE, "206"): 1,
            ("GET", CHECKPOINT_ROUTE, "304"): 1,
            ("GET", "unmatched", "404"): 1,
        }
        return now if all(grown.get(k) == v for k, v in wanted.items()) else None

    counts = wait_for(counted, timeout=10, what="the downloads to be counted")
    assert not [route for (_, route, _) in counts if run["id"] in route]  # templates only


def test_holding_no_lease_is_409_no_lease_for_a_heartbeat_an_upload_and_a_release(http):
    # Prepare: a round 1 whose lease is the holder's; a stranger holds none
    run = new_run(http)
    holder, stranger = register(http, "holder-of-one"), register(http, "stranger-of-one")
    lease = http.post(f"{API}/runs/{run['id']}/join", headers=auth(holder)).json()
    round1 = f"{API}/runs/{run['id']}/rounds/1"

    # Execute: the stranger names the holder's lease; the holder names one it never got
    answers = {
        "heartbeat": http.post(
            f"{round1}/heartbeat", json={"lease_id": lease["lease_id"]}, headers=auth(stranger)
        ),
        "forged heartbeat": http.post(
            f"{round1}/heartbeat", json={"lease_id": "lease_0000"}, headers=auth(holder)
        ),
        "upload": http.put(
            f"{round1}/contribution",
            content=b"x" * 64,
            headers={**auth(stranger), "Content-Type": "application/octet-stream"},
        ),
        "release": release(http, run["id"], 1, stranger),
    }
    unknown_round = http.post(
        f"{API}/runs/{run['id']}/rounds/9/heartbeat",
        json={"lease_id": lease["lease_id"]},
        headers=auth(holder),
    )

    # Assert: one code and status for "you hold no lease", with a sentence
    for what, r in answers.items():
        body = r.json()
        assert (r.status_code, body["error"]) == (409, "no_lease"), (what, r.text)
        assert "no lease" in body["detail"] or "no such lease" in body["detail"], (what, body)
    assert unknown_round.status_code == 409, unknown_round.text
    assert unknown_round.json()["error"] == "round_closed"
    assert unknown_round.json()["current_round"] == 1
    ok = http.post(
        f"{round1}/heartbeat", json={"lease_id": lease["lease_id"]}, headers=auth(holder)
    )
    assert ok.status_code == 200, ok.text
