"""Scores by the loss taken as uploads arrive (server.rounds.arrival_scores), through a real
server: an upload of an open round is scored before its round closes, and the close uses
that score as it is; when scoring on arrival fails, the close scores the upload itself."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import server_run_config
from tests.support.contribute import API, create_run, register, train, upload
from tests.support.live import ServerProcess, wait_for


def _contributions(http: httpx.Client, run_id: str) -> dict[str, dict]:
    r = http.get(f"{API}/runs/{run_id}/rounds/1/contributions")
    assert r.status_code == 200, r.text
    return {c["contributor_name"]: c for c in r.json()["contributions"]}


def _round_one(http: httpx.Client) -> tuple[str, dict[str, str]]:
    """A run whose round 1 closes on two uploads, with scoring (the default), and its
    first upload sent; the second volunteer's token."""
    config = server_run_config(rounds={"quorum": 2, "target": 2, "max_rounds": 1})
    run_id = create_run(http, config)["id"]
    tokens = {name: register(http, name) for name in ("early", "last")}
    assert upload(http, tokens["early"], train(http, tokens["early"], run_id)).status_code == 201
    return run_id, tokens


def _close_with_the_last(http: httpx.Client, run_id: str, token: str) -> None:
    assert upload(http, token, train(http, token, run_id)).status_code == 201
    wait_for(
        lambda: http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"] == 1,
        timeout=120,
        what="round 1 to close",
    )


def test_an_upload_is_scored_while_its_round_is_open_and_the_close_uses_that_score(http):
    run_id, tokens = _round_one(http)

    # Execute: the round waits for its second upload; the round worker scores the first
    wait_for(
        lambda: _contributions(http, run_id)["early"]["score"] is not None,
        timeout=120,
        what="the first upload's score on arrival",
    )
    early = _contributions(http, run_id)["early"]
    assert early["checks"] is None  # the round is still open
    _close_with_the_last(http, run_id, tokens["last"])

    # Assert: its score is what the close's checks say, to the bit (taken, not recomputed);
    # honest work takes loss off its own lease's windows
    closed = _contributions(http, run_id)["early"]
    score = early["score"]
    assert score["own_gain"] > 0 and score["own_base"] > 0 and score["other_base"] > 0
    assert closed["checks"]["own_gain"] == score["own_gain"]
    assert closed["checks"]["other_gain"] == score["other_gain"]
    assert isinstance(score["own_alignment"], float)  # measured with it, carried to the checks
    assert closed["checks"]["own_alignment"] == score["own_alignment"]
    assert closed["aggregated"] and closed["excluded"] is None


@pytest.fixture
def failing_scorer(database_url, tmp_path):  # type: ignore[no-untyped-def]
    """A server whose scoring on arrival always fails (an injected fault)."""
    proc = ServerProcess(
        data_dir=tmp_path / "srv", database_url=database_url, faults="score.arrival=fail"
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_an_upload_not_scored_on_arrival_is_scored_by_its_close(failing_scorer):
    http = failing_scorer.client()
    run_id, tokens = _round_one(http)
    wait_for(  # the scorer tried, failed, and left it to the close
        lambda: "score.arrival" in failing_scorer.output(),
        timeout=120,
        what="the scorer's failed try",
    )
    assert _contributions(http, run_id)["early"]["score"] is None

    _close_with_the_last(http, run_id, tokens["last"])

    closed = _contributions(http, run_id)
    assert all(c["checks"]["own_gain"] is not None for c in closed.values()), closed
    assert all(c["score"] is None for c in closed.values())
