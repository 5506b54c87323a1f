"""Credit that waits for audits (issue 26; diloco.protocol.audit.settle, server.rounds.escrow),
through a real server and `diloco verify`: what a step credits stays pending until an audit of
the contributor's work decides; honest work is then confirmed, and the quiet cheats the
close's checks let through (a stale base, other data than the lease's, ALIE) are replayed,
fail, and earn nothing — their unaudited earlier work included."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest

from diloco.config import parse_config
from diloco.protocol.audit import AuditStatus as S
from diloco.protocol.audit import CreditStatus, settle
from diloco.simulate.attacks import tamper_delta
from diloco.wire.exchange import encode_delta
from tests.conftest import server_run_config
from tests.support.cli import volunteer_cli
from tests.support.contribute import API, Work, create_run, fetch_params, register, train, upload
from tests.support.live import ADMIN_TOKEN, admin_headers, wait_for

HONEST = ("honest-1", "honest-2")
CHEATS = ("stale", "other-data", "alie")


def test_settle_takes_the_first_audit_decided_at_or_after_the_round() -> None:
    at = [datetime(2026, 11, 28, 12, minute, tzinfo=UTC) for minute in range(4)]
    assert settle(3, []) == CreditStatus.PENDING
    assert settle(3, [(2, at[0], S.PASSED)]) == CreditStatus.PENDING  # an earlier round's
    assert settle(3, [(3, at[1], S.PASSED)]) == CreditStatus.CONFIRMED
    assert settle(3, [(5, at[1], S.FAILED)]) == CreditStatus.FORFEITED  # a later round's
    # two decided at or after it: the first one decided settles it
    assert settle(3, [(4, at[2], S.PASSED), (6, at[1], S.FAILED)]) == CreditStatus.FORFEITED
    assert settle(3, [(4, at[1], S.PASSED), (6, at[2], S.FAILED)]) == CreditStatus.CONFIRMED


def _config() -> dict:
    config = server_run_config(
        rounds={"quorum": 5, "target": 5, "max_rounds": 2, "lease_ttl_s": 600},
    )
    config["audit"] = {"fraction": 1.0}  # every upload replayed; escrow is the default
    # the audits alone judge the work here: no scoring by the loss (it may leave a cheat out
    # first, which costs it its credit too, but is not what this test follows)
    config["aggregation"] = {"score_windows": 0}
    return config


def _round(http: httpx.Client, run_id: str, tokens: dict[str, str], stale_from: dict) -> None:
    """One round's five uploads: two honest, three cheats."""
    works = {name: train(http, tokens[name], run_id) for name in HONEST}
    works["stale"] = train(http, tokens["stale"], run_id, start=stale_from)
    works["other-data"] = train(http, tokens["other-data"], run_id, seed=12345)
    mine = train(http, tokens["alie"], run_id)
    cfg = parse_config(mine.lease["config"])
    forged = tamper_delta("alie", mine.delta, seed=0, peers=[works[n].delta for n in HONEST])
    encoded, _, _ = encode_delta(forged, cfg.compression)
    for name, work in works.items():
        assert upload(http, tokens[name], work).status_code == 201, name
    alie = Work(mine.lease, mine.meta, encoded)
    assert upload(http, tokens["alie"], mine, body=alie.body()).status_code == 201


def _board(http: httpx.Client, run_id: str) -> dict[str, dict]:
    r = http.get(f"{API}/contributors", params={"run": run_id})
    assert r.status_code == 200, r.text
    return {e["name"]: e for e in r.json()["contributors"]}


def _version(http: httpx.Client, run_id: str) -> int:
    return int(http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"])


@pytest.mark.timeout(600)
def test_credit_waits_for_audits_and_quiet_cheats_earn_nothing(server, http, tmp_path) -> None:
    # Prepare: two rounds of two honest volunteers and three quiet cheats; the stale one
    # trains from version 0 whatever its lease's base, the other-data one on batches of its
    # own choosing, the ALIE one sends the honest mean minus a standard deviation
    run_id = create_run(http, _config())["id"]
    tokens = {name: register(http, name) for name in (*HONEST, *CHEATS)}
    version0 = fetch_params(http, f"{API}/runs/{run_id}/checkpoints/0")
    for index in (1, 2):
        _round(http, run_id, tokens, version0)
        wait_for(lambda i=index: _version(http, run_id) == i, timeout=120, what=f"round {index}")

    # Assert: every step credited its work, and all of it waits for an audit
    before = _board(http, run_id)
    assert all(before[n]["credit"] == 0 and before[n]["pending_credit"] > 0 for n in HONEST)
    for round_ in (1, 2):
        listed = http.get(f"{API}/runs/{run_id}/rounds/{round_}/contributions").json()
        pending = [c for c in listed["contributions"] if c["credit_status"] == "pending"]
        assert {c["contributor_name"] for c in pending} >= set(HONEST)
    audits = http.get(f"{API}/runs/{run_id}/audits", headers=admin_headers()).json()["audits"]
    assert len(audits) == 10 and {a["status"] for a in audits} == {"pending"}
    who = {e["id"]: name for name, e in before.items()}

    # Execute: the other-data cheat's round-2 audit is decided first (by the admin's replay),
    # then a verifier's sweep decides the rest, oldest first
    diloco = volunteer_cli(tmp_path / "verifier", timeout=300)
    other = before["other-data"]["id"]
    one = diloco("verify", run_id, "2", other, "--report", "--server", server.url,
                 "--token", ADMIN_TOKEN)  # fmt: skip
    assert one.returncode == 6, one.stdout + one.stderr
    # its round-1 work, not yet audited, is forfeited with it: the failed audit settles
    # everything of its since the last decided one
    first = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"]
    row = next(c for c in first if c["contributor_id"] == other)
    assert (row["credit_status"], row["credit"]) == ("forfeited", 0), row
    swept = diloco("verify", run_id, "--pending", "--server", server.url, "--token", ADMIN_TOKEN)
    assert swept.returncode == 0, swept.stdout + swept.stderr

    # Assert: honest work replays and is confirmed; the stale base's round-1 work was honest
    # (it trained from its lease's base, version 0) and is confirmed, its round 2 fails; the
    # other-data and ALIE cheats fail every audit and earn nothing
    decided = http.get(f"{API}/runs/{run_id}/audits", headers=admin_headers()).json()["audits"]
    outcome = {(who[a["contributor_id"]], a["round"]): a["status"] for a in decided}
    assert outcome == {
        **{(n, r): "passed" for n in HONEST for r in (1, 2)},
        ("stale", 1): "passed", ("stale", 2): "failed",
        ("other-data", 1): "failed", ("other-data", 2): "failed",
        ("alie", 1): "failed", ("alie", 2): "failed",
    }, decided  # fmt: skip
    after = _board(http, run_id)
    for name in HONEST:
        assert after[name]["credit"] == before[name]["pending_credit"] > 0, after[name]
        assert after[name]["pending_credit"] == 0
    for name in ("other-data", "alie"):
        assert (after[name]["credit"], after[name]["pending_credit"]) == (0, 0), after[name]
    round1 = {
        c["contributor_name"]: c
        for c in http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"]
    }
    assert after["stale"]["credit"] == round1["stale"]["credit"] > 0
    assert after["stale"]["pending_credit"] == 0
    for round_ in (1, 2):
        listed = http.get(f"{API}/runs/{run_id}/rounds/{round_}/contributions").json()
        by_name = {c["contributor_name"]: c for c in listed["contributions"]}
        for name in ("other-data", "alie"):
            assert by_name[name]["credit"] == 0
            assert by_name[name]["credit_status"] == "forfeited"
            assert by_name[name]["excluded"].startswith("replay: audit"), by_name[name]
