"""Access control through a real server on a real Postgres: an admin bans a contributor (its
token is refused at once, its pending work is left out of the step and earns nothing), a
contributor rotates its token (by the API and by ``diloco rotate-token``), and registration,
the speed test and uploads are rate-limited per client address with 429 and Retry-After."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from client.api import ServerAPI
from client.http import RetryPolicy
from server.settings import Settings
from tests.conftest import server_run_config
from tests.support.cli import volunteer_cli
from tests.support.contribute import (
    API,
    auth,
    create_run,
    fetch_params,
    reference_step,
    register,
    train,
    upload,
)
from tests.support.live import ServerProcess, admin_headers, wait_for

REPO = Path(__file__).resolve().parents[1]


def me(http: httpx.Client, token: str) -> httpx.Response:
    return http.get(f"{API}/contributors/me", headers=auth(token))


def contributor_id(http: httpx.Client, token: str) -> str:
    r = me(http, token)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def ban(http: httpx.Client, cid: str, reason: str) -> httpx.Response:
    return http.post(
        f"{API}/contributors/{cid}/ban", json={"reason": reason}, headers=admin_headers()
    )


def assert_banned(r: httpx.Response, reason: str) -> None:
    assert r.status_code == 403, r.text
    assert r.json()["error"] == "banned"
    assert reason in r.json()["detail"]


def version(http: httpx.Client, run_id: str) -> int:
    return int(http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"])


# ---------------------------------------------------------------- bans


def test_a_contributor_banned_mid_round_is_refused_at_once_and_left_out_of_the_step(
    server: ServerProcess, http: httpx.Client
) -> None:
    # Prepare: two volunteers hold leases on round 1 (it closes when both have uploaded, or
    # at a far deadline); the one about to be banned uploads an accepted contribution first
    run = create_run(http, server_run_config(rounds={"quorum": 1, "target": 2, "max_rounds": 3}))
    run_id = run["id"]
    honest, cheat = register(http, "honest-ban"), register(http, "cheat-ban")
    base = fetch_params(http, f"{API}/runs/{run_id}/checkpoints/0")
    works = {token: train(http, token, run_id, steps=1) for token in (honest, cheat)}
    assert upload(http, cheat, works[cheat]).status_code == 201
    cheat_id = contributor_id(http, cheat)

    # Execute: the admin bans it while the round is open
    r = ban(http, cheat_id, "uploaded someone else's work")

    # Assert: the ban excluded its contribution and released its lease, and every path of
    # its token is refused at once, naming the reason
    assert r.status_code == 200, r.text
    state = r.json()
    assert (state["id"], state["excluded"], state["leases_released"]) == (cheat_id, 1, 1)
    assert state["banned_at"] is not None and state["ban_reason"] == "uploaded someone else's work"
    lease = works[cheat].lease
    beat = http.post(
        f"{API}/runs/{run_id}/rounds/1/heartbeat",
        json={"lease_id": lease["lease_id"]},
        headers=auth(cheat),
    )
    assert_banned(beat, "someone else's work")
    assert_banned(http.post(f"{API}/runs/{run_id}/join", headers=auth(cheat)), "someone else")
    assert_banned(upload(http, cheat, works[cheat]), "someone else's work")
    assert_banned(me(http, cheat), "someone else's work")
    assert_banned(
        http.delete(f"{API}/runs/{run_id}/rounds/1/lease", headers=auth(cheat)), "someone"
    )
    assert_banned(http.post(f"{API}/contributors/me/token", headers=auth(cheat)), "someone")
    assert version(http, run_id) == 0  # the banned work no longer counts toward a close

    # Execute: the honest volunteer uploads; the round closes
    assert upload(http, honest, works[honest]).status_code == 201
    wait_for(lambda: version(http, run_id) == 1, timeout=90, what="round 1 to close")

    # Assert: the banned contribution is listed as excluded with no credit, and the step is
    # exactly the one the honest upload alone makes
    listed = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"]
    by_name = {c["contributor_name"]: c for c in listed}
    assert by_name["cheat-ban"]["excluded"].startswith("banned: ")
    assert (by_name["cheat-ban"]["aggregated"], by_name["cheat-ban"]["credit"]) == (False, 0)
    assert by_name["honest-ban"]["aggregated"] and by_name["honest-ban"]["credit"] > 0
    rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
    assert rounds[0]["accepted"] == 1
    published = fetch_params(http, f"{API}/runs/{run_id}/checkpoints/1")
    expected = reference_step(run, base, [works[honest]]).params
    assert published.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(published[name], tensor), name
    board = http.get(f"{API}/contributors", params={"run": run_id}).json()["contributors"]
    assert {c["name"]: c["credit"] for c in board}["cheat-ban"] == 0


def test_a_ban_that_lands_while_the_step_computes_discards_it_and_recomputes_without_them(
    pg_admin_url: str, tmp_path: Path
) -> None:
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        # Prepare: a server whose first close stalls (5 s) once its step is computed, just
        # before it writes and publishes; both uploads in, the round closing
        proc = ServerProcess(
            data_dir=tmp_path / "srv", database_url=url, faults="close.write=stall"
        )
        try:
            http = proc.wait_ready().client()
            config = server_run_config(rounds={"quorum": 1, "target": 2, "max_rounds": 3})
            run = create_run(http, config)
            run_id = run["id"]
            honest, cheat = register(http, "honest-late"), register(http, "cheat-late")
            base = fetch_params(http, f"{API}/runs/{run_id}/checkpoints/0")
            works = {token: train(http, token, run_id, steps=1) for token in (cheat, honest)}
            for token in (cheat, honest):
                assert upload(http, token, works[token]).status_code == 201
            wait_for(
                lambda: "stalling at close.write" in proc.output(),
                timeout=60,
                what="the close to compute its step",
            )

            # Execute: the ban lands while the step that used the cheat's work is pending
            r = ban(http, contributor_id(http, cheat), "too late for the step")
            assert r.status_code == 200 and r.json()["excluded"] == 1, r.text

            # Assert: that step was never published; the one published is the honest upload's
            # alone, computed on the next attempt, and the round says why it took two
            wait_for(lambda: version(http, run_id) == 1, timeout=90, what="round 1 to close")
            closed = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"][0]
            assert closed["error"]["code"] == "contributor_banned", closed
            assert (closed["close_attempts"], closed["accepted"]) == (2, 1)
            published = fetch_params(http, f"{API}/runs/{run_id}/checkpoints/1")
            expected = reference_step(run, base, [works[honest]]).params
            for name, tensor in expected.items():
                assert torch.equal(published[name], tensor), name
            listed = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()
            by_name = {c["contributor_name"]: c for c in listed["contributions"]}
            assert by_name["cheat-late"]["excluded"].startswith("banned: ")
            assert by_name["cheat-late"]["credit"] == 0
        finally:
            proc.stop()


def test_unban_lets_the_same_token_work_again(http: httpx.Client) -> None:
    # Prepare
    token = register(http, "banned-then-forgiven")
    cid = contributor_id(http, token)
    assert ban(http, cid, "testing").status_code == 200
    assert_banned(me(http, token), "testing")

    # Execute
    r = http.post(f"{API}/contributors/{cid}/unban", headers=admin_headers())

    # Assert
    assert r.status_code == 200, r.text
    assert (r.json()["banned_at"], r.json()["ban_reason"]) == (None, None)
    assert me(http, token).status_code == 200


def test_banning_again_replaces_the_reason_and_keeps_the_time(http: httpx.Client) -> None:
    token = register(http, "banned-twice")
    cid = contributor_id(http, token)
    first = ban(http, cid, "first reason").json()

    second = ban(http, cid, "second reason").json()

    assert second["banned_at"] == first["banned_at"]
    assert_banned(me(http, token), "second reason")


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "unauthorized"),
        ({"Authorization": "Bearer nonsense"}, 401, "unauthorized"),
        ("contributor", 403, "forbidden"),
    ],
)
def test_ban_and_unban_need_the_admin_token(
    http: httpx.Client, headers: dict | str, status: int, code: str
) -> None:
    token = register(http, f"not-an-admin-{status}-{code}")
    cid = contributor_id(http, token)
    sent = auth(token) if headers == "contributor" else headers

    banned = http.post(f"{API}/contributors/{cid}/ban", json={"reason": "x"}, headers=sent)
    unbanned = http.post(f"{API}/contributors/{cid}/unban", headers=sent)

    for r in (banned, unbanned):
        assert (r.status_code, r.json()["error"]) == (status, code), r.text
    assert me(http, token).status_code == 200


def test_banning_an_unknown_contributor_is_404(http: httpx.Client) -> None:
    for action, body in (("ban", {"reason": "x"}), ("unban", None)):
        r = http.post(
            f"{API}/contributors/ctr_000000000000/{action}", json=body, headers=admin_headers()
        )
        assert (r.status_code, r.json()["error"]) == (404, "not_found"), r.text


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"reason": ""},
        {"reason": "   "},
        {"reason": "x" * 501},
        {"reason": "line\nbreak"},
        {"reason": 5},
        {"reason": "ok", "extra": 1},
        "not an object",
    ],
)
def test_a_bad_ban_body_is_422_and_bans_no_one(http: httpx.Client, body: object) -> None:
    token = register(http, "bad-ban-body")
    cid = contributor_id(http, token)

    r = http.post(f"{API}/contributors/{cid}/ban", json=body, headers=admin_headers())

    assert (r.status_code, r.json()["error"]) == (422, "invalid_request"), r.text
    assert me(http, token).status_code == 200


def test_a_malformed_contributor_id_is_422(http: httpx.Client) -> None:
    r = http.post(
        f"{API}/contributors/{'c' * 33}/ban", json={"reason": "x"}, headers=admin_headers()
    )
    assert (r.status_code, r.json()["error"]) == (422, "invalid_request"), r.text


# ---------------------------------------------------------------- token rotation


def test_a_rotated_token_replaces_the_old_one_at_once(http: httpx.Client) -> None:
    # Prepare
    old = register(http, "rotator")
    cid = contributor_id(http, old)

    # Execute
    r = http.post(f"{API}/contributors/me/token", headers=auth(old))

    # Assert: the new token is the same contributor; the old one is unknown from now on
    assert r.status_code == 200, r.text
    new = r.json()["token"]
    assert new != old and r.json()["id"] == cid and r.json()["name"] == "rotator"
    assert me(http, new).json()["id"] == cid
    for refused in (
        me(http, old),
        http.post(f"{API}/contributors/me/token", headers=auth(old)),
        http.post(f"{API}/runs/run_unknown/join", headers=auth(old)),
    ):
        assert (refused.status_code, refused.json()["error"]) == (401, "unauthorized")


def test_diloco_rotate_token_stores_the_new_token(
    server: ServerProcess, http: httpx.Client, tmp_path: Path
) -> None:
    # Prepare: registered with the CLI, its token in the credentials file
    diloco = volunteer_cli(tmp_path, timeout=120)

    done = diloco("register", server.url, "--name", "cli-rotator")
    assert done.returncode == 0, done.stderr
    stored = tmp_path / "config" / "credentials.json"
    old = next(iter(json.loads(stored.read_text()).values()))

    # Execute
    done = diloco("rotate-token", server.url)

    # Assert: the file holds the new token, which works; the old one does not
    assert done.returncode == 0, done.stderr
    assert "stored in" in done.stdout
    new = next(iter(json.loads(stored.read_text()).values()))
    assert new["contributor_id"] == old["contributor_id"] and new["token"] != old["token"]
    assert me(http, new["token"]).json()["id"] == old["contributor_id"]
    assert me(http, old["token"]).status_code == 401
    assert stored.stat().st_mode & 0o777 == 0o600


def test_a_banned_volunteer_stops_with_the_reason(
    server: ServerProcess, http: httpx.Client, tmp_path: Path
) -> None:
    # Prepare: a registered volunteer, then banned
    env = {**os.environ, "DILOCO_CONFIG_DIR": str(tmp_path / "config")}
    env.pop("DILOCO_HOME", None)
    token = register(http, "banned-volunteer")
    assert ban(http, contributor_id(http, token), "sybil accounts").status_code == 200

    # Execute
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", "join", server.url, "--token", token, "--quiet"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env=env,
    )

    # Assert: refused (exit 4), saying why
    assert done.returncode == 4, done.stdout + done.stderr
    assert "403 banned" in done.stderr and "sybil accounts" in done.stderr


def test_a_volunteer_banned_while_it_trains_stops_at_its_next_heartbeat(
    pg_admin_url: str, tmp_path: Path
) -> None:
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        proc = ServerProcess(data_dir=tmp_path / "srv", database_url=url)
        volunteer = None
        try:
            # Prepare: a volunteer training a round far too long to finish
            http = proc.wait_ready().client()
            config = server_run_config(inner={"steps": 100_000}, rounds={"heartbeat_interval_s": 1})
            run = create_run(http, config)
            token = register(http, "trains-then-banned")
            env = {**os.environ, "DILOCO_CONFIG_DIR": str(tmp_path / "config")}
            env.pop("DILOCO_HOME", None)
            args = ["join", proc.url, "--run", run["id"], "--token", token, "--quiet"]
            volunteer = subprocess.Popen(
                [sys.executable, "-m", "client.cli", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=REPO,
                env=env,
            )

            def training() -> bool:
                current = http.get(f"{API}/runs/{run['id']}").json()["current_round"]
                return any(lease["last_step"] for lease in current["leases"])

            wait_for(training, timeout=120, what="the volunteer to report training steps")

            # Execute
            assert ban(http, contributor_id(http, token), "bad actor").status_code == 200

            # Assert: it stops on its own within a few heartbeats, saying why
            out, _ = volunteer.communicate(timeout=60)
            assert volunteer.returncode == 4, out
            assert "403 banned" in out and "bad actor" in out
            assert "the hub's admin banned this contributor" in out
        finally:
            if volunteer is not None and volunteer.poll() is None:
                volunteer.kill()
                volunteer.wait()
            proc.stop()


def test_diloco_rotate_token_without_credentials_is_a_usage_error(
    server: ServerProcess, tmp_path: Path
) -> None:
    env = {**os.environ, "DILOCO_CONFIG_DIR": str(tmp_path / "empty")}
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", "rotate-token", server.url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert done.returncode == 2 and "not registered" in done.stderr


# ---------------------------------------------------------------- rate limits

LIMITS = {"rate_register": "2/minute", "rate_speedtest": "1/second", "rate_upload": "1/minute"}


@pytest.fixture(scope="module")
def limited(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A server with small limits, on its own database."""
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        proc = ServerProcess(
            data_dir=tmp_path_factory.mktemp("limited"), database_url=url, **LIMITS
        )
        try:
            yield proc.wait_ready()
        finally:
            proc.stop()


def assert_limited(r: httpx.Response, *, at_most: int) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"] == "rate_limited"
    wait = r.headers["Retry-After"]
    assert wait.isdigit() and 1 <= int(wait) <= at_most, wait
    assert r.json()["retry_after_s"] == int(wait)


def test_registration_over_the_limit_is_429_with_retry_after(limited: ServerProcess) -> None:
    with limited.client() as http:
        # Prepare: the address's two registrations a minute
        for i in range(2):
            assert http.post(f"{API}/contributors", json={"name": f"r{i}"}).status_code == 201

        # Execute
        third = http.post(f"{API}/contributors", json={"name": "r2"})

        # Assert: refused, and only for this address (uvicorn trusts X-Forwarded-For from
        # 127.0.0.1, a local proxy, as it does by default)
        assert_limited(third, at_most=60)
        other = http.post(
            f"{API}/contributors", json={"name": "r3"}, headers={"X-Forwarded-For": "10.1.2.3"}
        )
        assert other.status_code == 201, other.text
        board = http.get(f"{API}/contributors").json()
        assert sorted(c["name"] for c in board["contributors"]) == ["r0", "r1", "r3"]


def test_the_speed_test_over_the_limit_is_429_both_ways(limited: ServerProcess) -> None:
    with limited.client() as http:
        time.sleep(1.1)  # a fresh window
        assert http.get(f"{API}/speedtest", params={"bytes": 10}).status_code == 200

        again = http.post(f"{API}/speedtest", content=b"x" * 10)

        assert_limited(again, at_most=1)


def test_the_client_waits_out_a_429_within_its_retry_budget(limited: ServerProcess) -> None:
    async def twice() -> float:
        policy = RetryPolicy(attempts=3, base_delay_s=0.1, total_s=10.0)
        async with ServerAPI(limited.url, retry=policy) as api:
            await api.speedtest_download(10)
            started = time.monotonic()
            got, _ = await api.speedtest_download(10)  # 429 Retry-After: 1, then again
            assert got == 10
            return time.monotonic() - started

    time.sleep(1.1)
    assert asyncio.run(twice()) >= 0.9


def test_uploads_over_the_limit_are_429_before_the_token_or_body_is_looked_at(
    limited: ServerProcess,
) -> None:
    with limited.client() as http:
        # Prepare: this minute's one upload, refused for want of a lease, still counts
        elsewhere = {"X-Forwarded-For": "10.9.9.9"}  # this address registered its share
        made = http.post(f"{API}/contributors", json={"name": "uploader"}, headers=elsewhere)
        token = made.json()["token"]
        url = f"{API}/runs/run_unknown/rounds/1/contribution"
        first = http.put(url, content=b"junk", headers=auth(token))
        assert first.status_code == 404, first.text

        # Execute: no token, and a body far over any limit
        again = http.put(url, content=b"x" * (1 << 20), headers={"Content-Length": str(1 << 20)})

        # Assert
        assert_limited(again, at_most=60)


def test_a_rate_limit_setting_must_parse() -> None:
    assert Settings(rate_upload="").rate_upload == ""
    assert Settings(rate_upload="5/minute;100/day").rate_upload == "5/minute;100/day"
    for bad in ("fast", "20/fortnight", "0/hour", "-1/hour"):
        with pytest.raises(ValueError, match="rate_upload"):
            Settings(rate_upload=bad)
