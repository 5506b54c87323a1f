"""Late contributions against a real server and Postgres (issue 15, item 2).

A volunteer whose round closed while it trained uploads to its lease's round as always;
within ``[rounds] max_staleness`` the server merges the work into the round open now,
its weight ⌈w / (1 + s)⌉ (``diloco.protocol.late``), and the receipt says so. Past the
bound, or with late work turned off, the answer is ``409 round_closed`` naming the current
round; without a lease on the late round it is ``409 no_lease``.

Every run here closes a round as soon as one fresh contribution arrives (quorum = target =
1), so a test decides which round is open by uploading. The config's H = 3, batch 4 and
block 32 make every upload worth 384 tokens: 192 one version late.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import torch

from diloco.protocol.reputation import counted_weight, standing
from server.storage import keys
from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import (
    API,
    auth,
    create_run,
    fetch_params,
    read_outer_state,
    reference_step,
    register,
    train,
    upload,
)
from tests.support.live import Proc, ServerProcess, admin_headers, wait_for

TOKENS = 3 * 4 * 32  # H x batch x block: each upload's tokens and undiscounted weight
# what a new account's upload counts for in the step and in credit, late (half) or not
# (diloco.protocol.reputation: its standing scales both; the round's tokens are not scaled)
LATE = counted_weight(TOKENS, 1, standing(0, 0))
ON_TIME = counted_weight(TOKENS, 0, standing(0, 0))


def new_run(http: httpx.Client, **rounds: object) -> dict:
    return create_run(
        http, server_run_config(rounds={"quorum": 1, "target": 1, "max_rounds": 5, **rounds})
    )


def version(http: httpx.Client, run_id: str) -> int:
    return int(http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"])


def closed_through(http: httpx.Client, run_id: str, v: int) -> None:
    wait_for(lambda: version(http, run_id) >= v, timeout=90, what=f"version {v} of {run_id}")


def test_a_late_contribution_is_merged_into_the_open_round_with_half_its_weight(
    server: ServerProcess, http: httpx.Client
) -> None:
    # Prepare: b trains for round 1 too, but a's upload closes round 1 (target 1) first
    run = new_run(http)
    run_id = run["id"]
    a, b = register(http, "late-a"), register(http, "late-b")
    late_work = train(http, b, run_id)
    fresh_a = train(http, a, run_id)
    assert upload(http, a, fresh_a).status_code == 201
    closed_through(http, run_id, 1)
    base = fetch_params(http, f"{API}/runs/{run_id}/checkpoints/1")

    # Execute: b's round-1 work arrives late (round 2 is open), then b's own round-2 work,
    # which closes round 2
    late = upload(http, b, late_work)
    fresh_b = train(http, b, run_id)  # b may join round 2: its late work is round 1's
    assert fresh_b.lease["round"] == 2
    fresh = upload(http, b, fresh_b)
    closed_through(http, run_id, 2)

    # Assert: the receipt names the round it joined, its staleness and its weight
    assert late.status_code == 201, late.text
    receipt = late.json()
    assert (receipt["round"], receipt["merged_into_round"]) == (1, 2)
    assert (receipt["staleness"], receipt["weight"]) == (1, LATE)
    assert fresh.status_code == 201, fresh.text
    assert (fresh.json()["merged_into_round"], fresh.json()["staleness"]) == (2, 0)
    assert fresh.json()["weight"] == ON_TIME
    # round 2's step took both of b's contributions, the late one counted as late
    round2 = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"][1]
    assert (round2["accepted"], round2["late"], round2["tokens"]) == (2, 1, TOKENS + TOKENS // 2)
    listed = http.get(f"{API}/runs/{run_id}/rounds/2/contributions").json()["contributions"]
    by_id = {c["id"]: c for c in listed}
    late_row, fresh_row = by_id[receipt["contribution_id"]], by_id[fresh.json()["contribution_id"]]
    assert (late_row["round"], late_row["merged_into_round"], late_row["staleness"]) == (1, 2, 1)
    assert (late_row["weight"], fresh_row["weight"]) == (LATE, ON_TIME)
    assert late_row["aggregated"] and fresh_row["aggregated"]
    # credit follows the weight used: tokens x 6 x n_params, half for the late work
    flops = 6 * http.get(f"{API}/runs/{run_id}").json()["n_params"]
    assert late_row["credit"] == pytest.approx(LATE * flops)
    assert fresh_row["credit"] == pytest.approx(ON_TIME * flops)
    # round 1's listing shows the late work too, merged into round 2
    round1 = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"]
    assert receipt["contribution_id"] in {c["id"] for c in round1}
    # the published version is the in-process reference with those weights, bit for bit
    state = read_outer_state(server.data_dir / "blobs" / keys.version(run_id, 1).state)
    history = [c["norm"] for c in round1 if c["merged_into_round"] == 1]  # a's, the reference
    expected = reference_step(
        run, base, [late_work, fresh_b], state, staleness=[1, 0], round=2, history=history
    )
    published = fetch_params(http, f"{API}/runs/{run_id}/checkpoints/2")
    assert published.keys() == expected.params.keys()
    for name, tensor in expected.params.items():
        assert torch.equal(published[name], tensor), name

    # Execute / Assert: a retry of the late upload, after round 2 closed, gets its receipt
    again = upload(http, b, late_work)
    assert again.status_code == 200, again.text
    assert again.json() == receipt


def test_the_run_and_its_rounds_count_the_open_round_alike_and_weigh_its_loss_by_tokens(
    server: ServerProcess, http: httpx.Client
) -> None:
    # Prepare: quorum = target = 2; a and b close round 1 while c still trains for it
    run_id = new_run(http, quorum=2, target=2)["id"]
    a, b, c, d = (register(http, f"alike-{n}") for n in "abcd")
    works = {t: train(http, t, run_id) for t in (c, a, b)}
    for t in (a, b):
        assert upload(http, t, works[t]).status_code == 201
    closed_through(http, run_id, 1)

    # Execute: c's round-1 work arrives late into round 2, then d's fresh work of 1 step
    # (fewer tokens, another loss): one fresh contribution, short of quorum 2
    late = upload(http, c, works[c])
    short = train(http, d, run_id, steps=1)
    fresh = upload(http, d, short)

    # Assert: both endpoints count the round's step alike, the late one shown as late
    assert (late.json()["staleness"], fresh.json()["staleness"]) == (1, 0)
    current = http.get(f"{API}/runs/{run_id}").json()["current_round"]
    round2 = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"][1]
    assert (current["index"], round2["index"], round2["state"]) == (2, 2, "open")
    assert (current["accepted"], current["late"]) == (round2["accepted"], round2["late"]) == (2, 1)
    # the open round's train loss is weighted by the tokens each counts for, as a close's
    # (the tokens each counts for in the round: discounted for lateness, not by standing)
    weights = [TOKENS // 2, short.meta.tokens]
    assert [late.json()["weight"], fresh.json()["weight"]] == [
        counted_weight(TOKENS, 1, standing(0, 0)),
        counted_weight(short.meta.tokens, 0, standing(0, 0)),
    ]
    losses = [works[c].meta.loss, short.meta.loss]
    assert weights[0] != weights[1] and losses[0] != losses[1]
    assert round2["tokens"] == sum(weights)
    weighted = sum(w * x for w, x in zip(weights, losses, strict=True)) / sum(weights)
    assert round2["train_loss"] == pytest.approx(weighted, rel=1e-6)
    assert round2["train_loss"] != pytest.approx(sum(losses) / 2, rel=1e-6)


def test_work_two_versions_old_is_refused_past_max_staleness_1_naming_the_current_round(
    http: httpx.Client,
) -> None:
    # Prepare: b trains for round 1; a closes rounds 1 and 2
    run_id = new_run(http, max_staleness=1)["id"]
    a, b = register(http, "bound-a"), register(http, "bound-b")
    stale = train(http, b, run_id)
    for v in (1, 2):
        assert upload(http, a, train(http, a, run_id)).status_code == 201
        closed_through(http, run_id, v)

    # Execute: b's round-1 work is two versions old now that round 3 is open
    r = upload(http, b, stale)

    # Assert
    assert r.status_code == 409, r.text
    body = r.json()
    assert (body["error"], body["current_round"]) == ("round_closed", 3)
    assert "max_staleness of 1" in body["detail"]


def test_with_max_staleness_0_late_work_is_refused_naming_the_current_round(
    http: httpx.Client,
) -> None:
    # Prepare
    run_id = new_run(http, max_staleness=0)["id"]
    a, b = register(http, "off-a"), register(http, "off-b")
    late = train(http, b, run_id)
    assert upload(http, a, train(http, a, run_id)).status_code == 201
    closed_through(http, run_id, 1)

    # Execute
    r = upload(http, b, late)

    # Assert: refused as before late work existed, and nothing counted
    assert r.status_code == 409, r.text
    assert (r.json()["error"], r.json()["current_round"]) == ("round_closed", 2)
    listed = http.get(f"{API}/runs/{run_id}/rounds/2/contributions").json()["contributions"]
    assert listed == []


def test_a_late_upload_without_a_lease_on_its_round_is_refused(http: httpx.Client) -> None:
    # Prepare: b trains for round 1; c never joined round 1
    run_id = new_run(http)["id"]
    a, b, c = (register(http, f"nolease-{n}") for n in "abc")
    work = train(http, b, run_id)
    assert upload(http, a, train(http, a, run_id)).status_code == 201
    closed_through(http, run_id, 1)

    # Execute: c sends b's round-1 body to round 1 (within the staleness bound)
    r = upload(http, c, work)

    # Assert
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "no_lease"
    assert "no lease on round 1" in r.json()["detail"]
    assert http.get(f"{API}/runs/{run_id}/rounds/2/contributions").json()["contributions"] == []


def test_a_late_replay_of_another_contributors_tensors_is_refused(http: httpx.Client) -> None:
    # Prepare: a and b both hold leases on round 1; a's upload closes it
    run_id = new_run(http)["id"]
    a, b = register(http, "replay-a"), register(http, "replay-b")
    train(http, b, run_id)  # b's lease on round 1
    work_a = train(http, a, run_id)
    assert upload(http, a, work_a).status_code == 201
    closed_through(http, run_id, 1)

    # Execute: b sends a's very tensors late, in a header of its own
    r = upload(http, b, work_a)

    # Assert
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "replayed_upload"


@pytest.mark.parametrize(("value", "accepted"), [(-1, False), (0, True), (10, True), (11, False)])
def test_max_staleness_is_validated(http: httpx.Client, value: int, accepted: bool) -> None:
    config = server_run_config(rounds={"max_staleness": value})
    r = http.post(
        f"{API}/runs",
        data={"config": json.dumps(config)},
        files={"data": ("corpus.txt", make_corpus(120_000).encode(), "text/plain")},
        headers=admin_headers(),
    )
    if accepted:
        assert r.status_code == 201, r.text
        assert r.json()["config"]["rounds"]["max_staleness"] == value
    else:
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "invalid_config"
        assert r.json()["detail"].startswith("rounds.max_staleness")


def test_the_lease_carries_max_staleness_defaulting_to_1(http: httpx.Client) -> None:
    run_id = new_run(http)["id"]
    token = register(http, "lease-reader")
    r = http.post(f"{API}/runs/{run_id}/join", headers=auth(token))
    assert r.status_code == 200, r.text
    assert r.json()["config"]["rounds"]["max_staleness"] == 1


def test_the_client_finishes_a_round_that_closed_and_reports_it_accepted_late(
    server: ServerProcess, http: httpx.Client, tmp_path: Path
) -> None:
    # Prepare: a real `diloco join` whose upload stalls 5 s (the fault injector) once its
    # H steps are done; meanwhile another volunteer's upload closes round 1 (target 1)
    run_id = new_run(http)["id"]
    other = register(http, "closer")
    closing_work = train(http, other, run_id)
    home = tmp_path / "volunteer"
    volunteer = Proc(
        [sys.executable, "-m", "client.cli", "join", server.url, "--run", run_id,
         "--name", "late-client", "--threads", "1", "--max-rounds", "1", "--device", "cpu"],
        log=tmp_path / "join.log",
        env={"DILOCO_CONFIG_DIR": str(home / "config"), "DILOCO_CACHE_DIR": str(home / "cache"),
             "DILOCO_FAULTS": "volunteer.upload=stall"},
    )  # fmt: skip
    try:
        wait_for(
            lambda: "stalling at volunteer.upload" in volunteer.output(),
            timeout=120,
            what="the client to finish its steps",
        )

        # Execute: round 1 closes while the client waits to upload its round-1 work
        assert upload(http, other, closing_work).status_code == 201
        wait_for(lambda: not volunteer.alive(), timeout=120, what="the client to exit")

        # Assert: it uploaded instead of abandoning, and says where its work went
        out = volunteer.output()
        assert volunteer.popen.returncode == 0, out[-3000:]
        assert f"accepted late into round 2 (staleness 1, weight {LATE})" in out, out
        assert "1 contributions accepted" in out
        listed = http.get(f"{API}/runs/{run_id}/rounds/2/contributions").json()
        (late,) = [c for c in listed["contributions"] if c["contributor_name"] == "late-client"]
        assert (late["round"], late["staleness"], late["weight"]) == (1, 1, LATE)
    finally:
        volunteer.stop()
