"""Audits by replay (issue 26, docs/verification.md), through real processes: `diloco serve`,
a `diloco join` volunteer whose uploads are all drawn for audit (its second lease began
from a saved AdamW state, which it reveals), a forger's upload, and `diloco verify` as a
verifier account: the honest leases replay to cosine ≥ 0.99 and pass, the forged one fails
with its figure and loses its credit. And the hostile side of every audit route."""

from __future__ import annotations

import hashlib
import re
import secrets
import sys
from pathlib import Path

import httpx
import pytest
import torch

from diloco.config import parse_config
from diloco.wire.contribution import encode_contribution
from diloco.wire.exchange import encode_delta
from tests.conftest import server_run_config
from tests.support.cli import volunteer_cli
from tests.support.contribute import (
    API,
    auth,
    close_rounds,
    create_run,
    register,
    train,
    upload,
)
from tests.support.live import ADMIN_TOKEN, Proc, ServerProcess, admin_headers, wait_for


def _config(rounds: int) -> dict:
    config = server_run_config(
        inner={"steps": 4, "batch_size": 4, "warmup_steps": 1},
        rounds={"quorum": 1, "target": 1, "max_rounds": rounds, "heartbeat_interval_s": 1},
    )
    config["audit"] = {"fraction": 1.0}  # every upload
    # the audit alone judges the work here: no scoring (a noise upload would be left out
    # by it, and the run's one upload a round with it)
    config["aggregation"] = {"score_windows": 0}
    return config


def _join(home: Path, url: str, run_id: str, rounds: int) -> Proc:
    home.mkdir()
    return Proc(
        [sys.executable, "-m", "client.cli", "join", url, "--run", run_id, "--name", home.name,
         "--threads", "1", "--max-rounds", str(rounds)],
        log=home / "join.log",
        env={"DILOCO_CONFIG_DIR": str(home / "config"), "DILOCO_CACHE_DIR": str(home / "cache")},
    )  # fmt: skip


def _audits(http: httpx.Client, run_id: str) -> list[dict]:
    r = http.get(f"{API}/runs/{run_id}/audits", headers=admin_headers())
    assert r.status_code == 200, r.text
    return list(r.json()["audits"])


def _forge(http: httpx.Client, token: str, run_id: str) -> None:
    """A lease trained honestly, then uploaded as noise of the same norm: what a freeloader
    who claims the work sends."""
    work = train(http, token, run_id)
    cfg = parse_config(work.lease["config"])
    gen = torch.Generator().manual_seed(7)
    noise = {n: torch.randn(d.shape, generator=gen) for n, d in work.delta.items()}
    scale = (
        torch.cat([d.flatten() for d in work.delta.values()]).norm()
        / torch.cat([x.flatten() for x in noise.values()]).norm()
    )
    encoded, _, _ = encode_delta({n: x * scale for n, x in noise.items()}, cfg.compression)
    r = upload(http, token, work, b"".join(encode_contribution(work.meta, encoded)))
    assert r.status_code == 201, r.text


@pytest.fixture(params=["local", "s3"])
def audit_server(request, database_url, tmp_path):  # type: ignore[no-untyped-def]
    """A server on disk, or on the bucket (signed URLs for every file a verifier reads)."""
    settings: dict[str, object] = {}
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        bucket = request.getfixturevalue("s3_server").bucket
        settings["storage"] = f"s3://{bucket}/audits-{secrets.token_hex(4)}"
        settings["scratch_dir"] = tmp_path / "scratch"  # not the system's temp dir
    proc = ServerProcess(data_dir=tmp_path / "srv", database_url=database_url, **settings)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_honest_leases_replay_and_a_forged_upload_fails(audit_server, tmp_path):
    server = audit_server
    http = server.client()
    run_id = create_run(http, _config(3))["id"]

    # Execute: a real volunteer trains rounds 1 and 2; a forger takes round 3
    volunteer = _join(tmp_path / "alice", server.url, run_id, 2)
    try:
        wait_for(lambda: not volunteer.alive(), timeout=240, what="the volunteer's two rounds")
    finally:
        volunteer.stop()
    joined = volunteer.output()
    wait_for(  # the volunteer's last upload closes round 2: round 3 opens for the forger
        lambda: http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"] == 2,
        timeout=120,
        what="round 2 to close",
    )
    forger = register(http, "forger")
    _forge(http, forger, run_id)
    wait_for(
        lambda: http.get(f"{API}/runs/{run_id}").json()["status"] == "completed",
        timeout=120,
        what="the run to complete",
    )

    # the volunteer revealed the state its second lease began from; the first began fresh
    assert volunteer.popen.returncode == 0, joined[-3000:]
    assert "round 2: audited: sent the starting AdamW state" in joined, joined[-3000:]
    audits = {a["round"]: a for a in _audits(http, run_id)}
    assert sorted(audits) == [1, 2, 3]
    assert {a["status"] for a in audits.values()} == {"pending"}
    alice = audits[1]["contributor_id"]
    start = hashlib.sha256(
        (tmp_path / "alice" / "cache" / "runs" / run_id / "adamw.start.safetensors").read_bytes()
    ).hexdigest()
    ledger = http.get(
        f"{API}/runs/{run_id}/rounds/2/ledger/{alice}", headers=admin_headers()
    ).json()
    assert ledger["replay"]["start"] == start and ledger["state"]["sha256"] == start
    assert ledger["lease"]["base_version"] == 1 and ledger["lease"]["round"] == 2

    # one lease, replayed by the admin: it passes with its figures
    diloco = volunteer_cli(tmp_path / "verifier", timeout=240)
    one = diloco("verify", run_id, "2", alice, "--server", server.url, "--token", ADMIN_TOKEN)
    assert one.returncode == 0, one.stdout + one.stderr
    cosine = float(re.search(r"cosine (\S+) ", one.stdout).group(1))  # type: ignore[union-attr]
    assert cosine >= 0.99, one.stdout

    # the forged one, replayed by the admin: it fails, with the figure, and exits 6
    forged_id = audits[3]["contributor_id"]
    bad = diloco("verify", run_id, "3", forged_id, "--server", server.url, "--token", ADMIN_TOKEN)
    assert bad.returncode == 6, bad.stdout + bad.stderr
    assert "FAILED: the replay does not reproduce the upload: cosine" in bad.stdout, bad.stdout

    # a verifier account works through the pending audits and reports each finding
    verifier = register(http, "verifier")
    me = http.get(f"{API}/contributors/me", headers=auth(verifier)).json()["id"]
    r = http.post(
        f"{API}/contributors/{me}/roles", json={"role": "verifier"}, headers=admin_headers()
    )
    assert r.status_code == 200 and r.json()["roles"] == ["verifier"], r.text
    swept = diloco("verify", run_id, "--pending", "--server", server.url, "--token", verifier)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert "3 audit(s): 2 passed, 1 failed, 0 unverifiable" in swept.stdout, swept.stdout

    # Assert: what the server decided, and what the forger earned
    decided = {a["round"]: a for a in _audits(http, run_id)}
    assert [decided[i]["status"] for i in (1, 2, 3)] == ["passed", "passed", "failed"]
    assert decided[1]["cosine"] >= 0.99 and decided[2]["cosine"] >= 0.99
    assert decided[3]["cosine"] < 0.5, decided[3]
    assert "does not reproduce the upload: cosine" in decided[3]["detail"]
    assert all(decided[i]["claimed_by"] == me for i in (1, 2, 3))
    # the passed audit's revealed state is deleted: nothing to replay it from any more
    state = http.get(
        f"{API}/runs/{run_id}/audits/{decided[2]['id']}/state", headers=admin_headers()
    )
    assert state.status_code == 404, state.text
    again = http.get(f"{API}/runs/{run_id}/rounds/2/ledger/{alice}", headers=admin_headers())
    assert again.json()["state"] is None
    forged = http.get(f"{API}/runs/{run_id}/rounds/3/contributions").json()["contributions"]
    assert forged[0]["excluded"].startswith(f"replay: audit {decided[3]['id']}: the replay")
    profile = http.get(f"{API}/contributors/me", headers=auth(forger)).json()
    assert profile["totals"]["credit"] == 0.0
    board = http.get(f"{API}/contributors", params={"run": run_id}).json()
    credit = {c["id"]: c["credit"] for c in board["contributors"]}
    assert credit[alice] > 0.0 and credit.get(profile["id"], 0.0) == 0.0


def test_every_audit_route_refuses_what_it_should(server, tmp_path):
    http = server.client()
    run_id = create_run(http, _config(2))["id"]
    alice, bob = register(http, "alice"), register(http, "bob")
    work = train(http, alice, run_id)
    assert upload(http, alice, work).status_code == 201
    (audit,) = _audits(http, run_id)
    assert audit["status"] == "pending"  # a fresh start: nothing to reveal

    # a volunteer's token cannot read the ledger, list, claim or decide audits
    for method, path in (
        ("GET", f"/runs/{run_id}/audits"),
        ("POST", f"/runs/{run_id}/audits/claim"),
        ("GET", f"/runs/{run_id}/rounds/1/ledger/{audit['contributor_id']}"),
        ("GET", f"/runs/{run_id}/contributions/{audit['contribution_id']}/blob"),
    ):
        r = http.request(method, f"{API}{path}", headers=auth(bob))
        assert r.status_code == 403 and r.json()["error"] == "forbidden", (path, r.text)
    # a state for an audit that waits for none; another contributor's audit; no such audit
    put = f"{API}/runs/{run_id}/audits/{audit['id']}/state"
    r = http.put(put, content=b"x" * 10, headers=auth(alice))
    assert r.status_code == 409 and r.json()["error"] == "invalid_transition", r.text
    r = http.put(put, content=b"x" * 10, headers=auth(bob))
    assert r.status_code == 403, r.text
    r = http.put(f"{API}/runs/{run_id}/audits/aud_0000/state", content=b"x", headers=auth(bob))
    assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
    # a finding that is neither figures nor a sentence; then one, then one too many
    decide = f"{API}/runs/{run_id}/audits/{audit['id']}"
    for bad in ({}, {"cosine": 1.0}, {"cosine": 2.0, "rel_error": 0, "norm_ratio": 1},
                {"failure": "x", "cosine": 1.0, "rel_error": 0, "norm_ratio": 1}):  # fmt: skip
        r = http.post(decide, json=bad, headers=admin_headers())
        assert r.status_code == 422, (bad, r.text)
    assert _audits(http, run_id)[0]["status"] == "pending"  # no trace
    r = http.post(decide, json={"failure": "its state does not load"}, headers=admin_headers())
    assert r.status_code == 200 and r.json()["status"] == "failed", r.text
    r = http.post(decide, json={"failure": "again"}, headers=admin_headers())
    assert r.status_code == 409 and r.json()["error"] == "invalid_transition", r.text
    # roles: an unknown account, an unknown role
    r = http.post(f"{API}/contributors/ctr_nobody/roles", json={"role": "verifier"},
                  headers=admin_headers())  # fmt: skip
    assert r.status_code == 404, r.text
    me = http.get(f"{API}/contributors/me", headers=auth(bob)).json()["id"]
    r = http.post(f"{API}/contributors/{me}/roles", json={"role": "king"}, headers=admin_headers())
    assert r.status_code == 422, r.text
    r = http.post(f"{API}/contributors/{me}/roles", json={"role": "verifier"}, headers=auth(bob))
    assert r.status_code == 403, r.text
    r = http.delete(f"{API}/contributors/{me}/roles/verifier", headers=admin_headers())
    assert r.status_code == 200 and r.json()["roles"] == [], r.text


def test_an_upload_without_a_replay_record_is_refused_where_audits_need_one(server):
    http = server.client()
    run_id = create_run(http, _config(2))["id"]
    alice = register(http, "alice")
    work = train(http, alice, run_id)
    r = upload(http, alice, work, work.body(replay=None))
    assert r.status_code == 400 and r.json()["error"] == "malformed_upload", r.text
    assert "replay record" in r.json()["detail"]
    assert http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"] == []


def test_an_audited_blob_outlives_retention_until_its_audit_passes(database_url, tmp_path):
    # Prepare: one server whose janitor passes often; two runs whose blobs go at once
    server = ServerProcess(
        data_dir=tmp_path / "srv", database_url=database_url, janitor_interval_s=0.3
    )
    runs = {}
    try:
        with server.wait_ready().client() as http:
            for fraction in (1.0, 0.0):
                config = _config(3)
                config["audit"] = {"fraction": fraction}
                config["retention"] = {"contribution_grace_s": 0}
                runs[fraction] = create_run(http, config)["id"]
                # Execute: two rounds close on one upload each
                close_rounds(http, register(http, f"steady-{fraction}"), runs[fraction], 2)

            def blobs(run_id: str) -> list[bool]:
                return [
                    c["blob_retained"]
                    for i in (1, 2)
                    for c in http.get(f"{API}/runs/{run_id}/rounds/{i}/contributions").json()[
                        "contributions"
                    ]
                ]

            wait_for(lambda: blobs(runs[0.0]) == [False, False], timeout=60, what="retention")
            undecided = blobs(runs[1.0])
            # then round 1's audit passes and round 2's fails
            by_round = {a["round"]: a for a in _audits(http, runs[1.0])}
            passed = {"cosine": 1.0, "rel_error": 0.0, "norm_ratio": 1.0}
            for index, finding in ((1, passed), (2, {"failure": "its state does not load"})):
                audit = by_round[index]["id"]
                r = http.post(
                    f"{API}/runs/{runs[1.0]}/audits/{audit}", json=finding, headers=admin_headers()
                )
                assert r.status_code == 200, r.text
            wait_for(lambda: blobs(runs[1.0]) == [False, True], timeout=60, what="retention")
    finally:
        server.stop()

    # Assert: the unaudited run's blobs went; the audited run's stayed while undecided, and
    # the failed one's stays (the evidence)
    assert undecided == [True, True]


def test_a_new_account_is_drawn_far_more_often_than_a_trusted_one():
    from diloco.protocol.audit import audit_share, drawn
    from diloco.protocol.reputation import standing

    new = standing(verified=0, failed=0)
    assert audit_share(0.05, new, newcomers=True) == pytest.approx(8 / 9)
    assert audit_share(0.05, standing(4, 0), newcomers=True) == pytest.approx(4 / 9)
    assert audit_share(0.05, 1.0, newcomers=True) == 0.05  # trusted: the run's fraction
    assert audit_share(0.05, new, newcomers=False) == 0.05
    assert audit_share(0.0, new, newcomers=True) == 0.0  # fraction 0: no audits at all
    # the draw is uniform: over many contributors, each share is hit about as often
    for share in (0.05, 8 / 9):
        hits = sum(drawn(12345, f"ctr_{i:012x}", share) for i in range(4000)) / 4000
        assert abs(hits - share) < 0.02, (share, hits)
    assert not any(drawn(1, f"ctr_{i}", 0.0) for i in range(100))
