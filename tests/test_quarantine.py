"""Quarantine through a real server (``diloco.protocol.reputation``): a volunteer whose
uploads fail verification round after round is quarantined by the close that sees the
third failure; its next upload is taken and stored but neither aggregated nor credited,
and it is told why; an admin lifts it and its work counts again."""

from __future__ import annotations

import httpx

from diloco.config import parse_config
from diloco.simulate.attacks import hostile_body
from tests.conftest import server_run_config
from tests.support.contribute import API, auth, create_run, register, train, upload
from tests.support.live import admin_headers, wait_for


def version(http: httpx.Client, run_id: str) -> int:
    return int(http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"])


def play_round(http: httpx.Client, run: dict, honest: str, other: str, *, zeros: bool) -> dict:
    """Both train; the honest one uploads, then the other (an update of zeros, or its
    honest work); the round closes. The other's contribution, as the round lists it."""
    before = version(http, run["id"])
    works = {token: train(http, token, run["id"], steps=1) for token in (honest, other)}
    assert upload(http, honest, works[honest]).status_code == 201
    cfg = parse_config(run["config"])
    body = None
    if zeros:
        mine = works[other]
        body = hostile_body(
            "zeros", mine.delta, mine.meta,
            kind=cfg.compression.kind, block_size=cfg.compression.block_size,
        )  # fmt: skip
    assert upload(http, other, works[other], body=body).status_code == 201  # taken, stored
    wait_for(lambda: version(http, run["id"]) == before + 1, timeout=60, what="the round")
    index = before + 1
    listed = http.get(f"{API}/runs/{run['id']}/rounds/{index}/contributions").json()
    return next(c for c in listed["contributions"] if c["contributor_name"] == "freeloader")


def test_repeated_failures_quarantine_a_volunteer_until_an_admin_lifts_it(
    http: httpx.Client,
) -> None:
    # Prepare: rounds close on two uploads (quorum 1: the honest one alone makes a step)
    config = server_run_config(rounds={"quorum": 1, "target": 2, "max_rounds": 6})
    run = create_run(http, config)
    honest, other = register(http, "steady"), register(http, "freeloader")
    me = lambda: http.get(f"{API}/contributors/me", headers=auth(other)).json()  # noqa: E731

    # Execute: three rounds of zeros
    failed = [play_round(http, run, honest, other, zeros=True) for _ in range(3)]

    # Assert: each left out, unpaid; the third close quarantined it, saying why
    assert [c["excluded"].split(":")[0] for c in failed] == ["zero_update"] * 3
    assert all(c["credit"] == 0 for c in failed)
    profile = me()
    assert profile["quarantined_at"] is not None
    assert (
        "3 of its last 3 judged contributions failed verification (zero_update ×3)"
        in (profile["quarantine_reason"])
    )

    # Execute: now it does honest work, while quarantined
    held = play_round(http, run, honest, other, zeros=False)

    # Assert: taken and stored, but not aggregated or credited, with the reason
    assert held["excluded"].startswith("quarantined: 3 of its last 3"), held
    assert held["credit"] == 0 and not held["aggregated"] and held["blob_retained"]

    # Execute: the admin lifts it (a volunteer's token cannot)
    cid = profile["id"]
    refused = http.post(f"{API}/contributors/{cid}/unquarantine", headers=auth(other))
    assert refused.status_code in (401, 403), refused.text
    lifted = http.post(f"{API}/contributors/{cid}/unquarantine", headers=admin_headers())
    assert lifted.status_code == 200 and lifted.json()["quarantined_at"] is None, lifted.text
    counted = play_round(http, run, honest, other, zeros=False)

    # Assert: its honest work counts again
    assert counted["aggregated"] and counted["credit"] > 0 and counted["excluded"] is None
    assert me()["quarantined_at"] is None
    missing = http.post(f"{API}/contributors/ctr_nobody/unquarantine", headers=admin_headers())
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"


def test_only_repeated_verification_failures_in_the_latest_window_quarantine() -> None:
    from diloco.protocol.reputation import quarantine_reason

    assert quarantine_reason([None, "copy", None, "no_gain", None]) is None  # 2 of 5
    assert quarantine_reason(["copy", "no_gain", None, "copy"]) is not None  # 3 of 4
    # the guard's blame and a damaged blob are not verification failures
    assert quarantine_reason(["guard", "guard", "blob_unreadable", "copy"]) is None
    # older than the window: forgotten
    assert quarantine_reason([None] * 5 + ["copy"] * 3) is None
    reason = quarantine_reason(["unaligned", "copy", "unaligned"])
    assert reason is not None and "(copy ×1, unaligned ×2)" in reason


def test_an_account_earns_its_weight_by_verified_work_and_loses_it_by_failures() -> None:
    from diloco.protocol.reputation import EARNED_AT, counted_weight, standing

    new = standing(verified=0, failed=0)
    assert new == 1 / (EARNED_AT + 1)  # a new account (or a banned one registered again)
    assert [standing(v, 0) for v in (1, 2, EARNED_AT)] == [2 * new, 3 * new, 1.0]
    assert standing(10 * EARNED_AT, 0) == 1.0  # never more than the whole
    assert standing(4, 1) == standing(2, 0)  # a failure takes two shares away
    assert standing(0, 5) == new  # and never below one
    # what an upload counts for: its weight, discounted when late, times the standing,
    # rounded up; a standing of 1 changes nothing
    assert counted_weight(384, 0, 1.0) == 384 and counted_weight(384, 1, 1.0) == 192
    assert counted_weight(384, 0, new) == 43 and counted_weight(384, 1, new) == 22
