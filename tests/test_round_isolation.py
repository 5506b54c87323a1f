"""One run's broken round never stops another's, with two runs on one real server.

- A contribution of run A whose stored blob is damaged on disk is left out of A's step with
  its reason (and earns nothing); A's round closes on the others, which make quorum, and
  says why. Run B closes its rounds meanwhile.
- When too few readable contributions are left, the round reopens and closes once more
  arrive.
- A close of run A that keeps failing (its base state file is gone) is recorded on A's
  round with its code and sentence and retried with backoff, while run B closes round
  after round.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.storage import keys
from tests.conftest import server_run_config
from tests.support.contribute import API, create_run, register, train, upload
from tests.support.live import ServerProcess, wait_for


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        data_dir=tmp_path / "srv",
        database_url=database_url,
        close_retry_base_s=0.5,
        close_retry_max_s=1,
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def new_run(http: httpx.Client, **rounds: object) -> str:
    config = server_run_config(rounds={"timeout_s": 600, "max_rounds": 20, **rounds})
    return str(create_run(http, config)["id"])


def contribute(http: httpx.Client, token: str, run_id: str) -> dict:
    work = train(http, token, run_id, steps=1)
    r = upload(http, token, work)
    assert r.status_code == 201, r.text
    return dict(r.json())


def blob_of(server: ServerProcess, run_id: str, index: int, contributor_id: str) -> Path:
    (blob,) = (server.data_dir / "blobs" / keys.rounds(run_id) / str(index)).glob(
        f"{contributor_id}-*.bin"
    )
    return blob


def version(http: httpx.Client, run_id: str) -> int:
    return int(http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"])


def contributor_id(http: httpx.Client, token: str) -> str:
    me = http.get(f"{API}/contributors/me", headers={"Authorization": f"Bearer {token}"})
    return str(me.json()["id"])


def close_run_b_round(http: httpx.Client, token: str, run_b: str) -> None:
    before = version(http, run_b)
    contribute(http, token, run_b)
    wait_for(lambda: version(http, run_b) == before + 1, timeout=60, what="run B's round")


def test_a_damaged_blob_is_left_out_and_its_round_closes_on_the_others(server):
    # Prepare: run A needs 2 of 3 (target 3); run B closes on each upload (quorum 1)
    http = server.client()
    run_a, run_b = new_run(http, quorum=2, target=3), new_run(http, quorum=1, target=1)
    a1, a2, a3, b = (register(http, name) for name in ("a1", "a2", "a3", "b"))
    works = {token: train(http, token, run_a, steps=1) for token in (a1, a2, a3)}  # 3 leases
    assert upload(http, a1, works[a1]).status_code == 201
    damaged = blob_of(server, run_a, 1, contributor_id(http, a1))
    damaged.write_bytes(damaged.read_bytes()[:-100] + b"\0" * 100)  # the trailer's digest fails
    close_run_b_round(http, b, run_b)

    # Execute: the target is reached (a3's live lease keeps the round open until then);
    # A's close reads the damaged blob
    assert upload(http, a2, works[a2]).status_code == 201
    assert upload(http, a3, works[a3]).status_code == 201
    wait_for(lambda: version(http, run_a) == 1, timeout=60, what="run A's round 1 to close")
    close_run_b_round(http, b, run_b)

    # Assert: A's round closed on the two others and says why; the damaged one earns nothing
    (round1, *_) = http.get(f"{API}/runs/{run_a}/rounds").json()["rounds"]
    assert round1["state"] == "closed" and round1["accepted"] == 2
    assert round1["close_code"] == "excluded_quorum"
    assert "1 contribution left out" in round1["close_reason"]
    assert "closing with the 2 others (quorum 2)" in round1["close_reason"]
    listed = http.get(f"{API}/runs/{run_a}/rounds/1/contributions").json()["contributions"]
    by_name = {c["contributor_name"]: c for c in listed}
    assert by_name["a1"]["excluded"].startswith("blob_unreadable: its stored upload is damaged")
    assert not by_name["a1"]["aggregated"] and by_name["a1"]["credit"] == 0
    assert all(by_name[n]["aggregated"] and by_name[n]["credit"] > 0 for n in ("a2", "a3"))
    assert version(http, run_b) == 2


def test_a_round_left_below_quorum_by_a_missing_blob_reopens_and_closes_later(server):
    # Prepare: quorum 2, target 2; the first upload's blob disappears from disk
    http = server.client()
    run_a = new_run(http, quorum=2, target=2)
    a1, a2, a3 = (register(http, name) for name in ("a1", "a2", "a3"))
    contribute(http, a1, run_a)
    blob_of(server, run_a, 1, contributor_id(http, a1)).unlink()

    # Execute: the target is reached, but only one contribution can be read
    contribute(http, a2, run_a)
    wait_for(
        lambda: (
            http.get(f"{API}/runs/{run_a}/rounds").json()["rounds"][0]["close_code"]
            == "excluded_below_quorum"
        ),
        timeout=60,
        what="the round to reopen",
    )
    reopened = http.get(f"{API}/runs/{run_a}").json()["current_round"]
    contribute(http, a3, run_a)
    wait_for(lambda: version(http, run_a) == 1, timeout=60, what="round 1 to close")

    # Assert: it was open again, counting one; then it closed on a2 and a3
    assert reopened["index"] == 1 and reopened["state"] == "open" and reopened["accepted"] == 1
    (round1, *_) = http.get(f"{API}/runs/{run_a}/rounds").json()["rounds"]
    assert round1["accepted"] == 2 and round1["close_code"] == "target"
    listed = http.get(f"{API}/runs/{run_a}/rounds/1/contributions").json()["contributions"]
    excluded = [c for c in listed if c["excluded"]]
    assert [c["contributor_name"] for c in excluded] == ["a1"]
    assert "cannot be read: No such file or directory" in excluded[0]["excluded"]


def test_a_run_whose_close_keeps_failing_never_holds_up_another_run(server):
    # Prepare: run A's base state file is gone, so every attempt to close its round fails
    http = server.client()
    run_a, run_b = new_run(http, quorum=1, target=1), new_run(http, quorum=1, target=1)
    a, b = register(http, "a"), register(http, "b")
    state = server.data_dir / "blobs" / keys.version(run_a, 0).state
    state.unlink()

    # Execute: A's round starts closing (and failing); B closes three rounds meanwhile
    contribute(http, a, run_a)
    wait_for(
        lambda: (
            (http.get(f"{API}/runs/{run_a}").json()["current_round"]["error"] or {}).get(
                "attempts", 0
            )
            >= 2
        ),
        timeout=60,
        what="run A's close to fail twice",
    )
    for _ in range(3):
        close_run_b_round(http, b, run_b)

    # Assert: A's round is still closing, says why and when it retries; B moved on
    current = http.get(f"{API}/runs/{run_a}").json()["current_round"]
    assert current["state"] == "closing" and version(http, run_a) == 0
    error = current["error"]
    assert error["code"] == "close_failed" and error["attempts"] >= 2
    assert error["detail"].startswith("attempt ") and "BlobMissing" in error["detail"]
    assert "0.state.safetensors" in error["detail"] and error["retry_at"] is not None
    assert current["reason"].startswith("closing")
    listed = http.get(f"{API}/runs/{run_a}/rounds").json()["rounds"]
    assert listed[0]["error"]["code"] == "close_failed"
    assert version(http, run_b) == 3
    metrics = http.get("/metrics").text
    assert 'diloco_round_close_failures_total{code="close_failed"}' in metrics
