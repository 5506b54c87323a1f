"""Retention (server.upkeep.retention): the pure plan, edge case by edge case, then a live server
on local disk and on a real S3 API server (SeaweedFS) that deletes exactly what the run's
policy says and nothing else, answers 410 for what it deleted and counts what remains."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from diloco.config import ConfigError, RetentionSection, parse_config
from server.db import make_engine, make_sessionmaker
from server.storage.base import LocalStorage, Storage, open_storage
from server.upkeep import retention
from server.upkeep.retention import Blob, Version, keeps, plan
from tests.conftest import server_run_config
from tests.support.contribute import API, close_rounds, create_run, register
from tests.support.live import ServerProcess, wait_for
from tests.support.pg import rows

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def versions(*numbers: int, pending: tuple[int, ...] = ()) -> list[Version]:
    return [Version(v, (f"ck/{v}.safetensors",), eval_pending=v in pending) for v in numbers]


def retired(
    policy: RetentionSection, rows: list[Version], open_bases: frozenset[int] = frozenset()
) -> list[int]:
    decided = plan(
        now=NOW, policy=policy, versions=rows, open_bases=open_bases, blobs=[], present=set()
    )
    return [v for v, _ in decided.versions]


# ---------------------------------------------------------------- the plan


def test_keep_last_zero_keeps_every_version() -> None:
    policy = RetentionSection(keep_last=0, milestone_every=3)

    assert retired(policy, versions(*range(10))) == []
    assert keeps(1, latest=9, open_bases=(), policy=policy) == "keep_last = 0 keeps every version"


def test_keep_last_one_keeps_only_the_latest() -> None:
    assert retired(RetentionSection(keep_last=1), versions(*range(6))) == [0, 1, 2, 3, 4]


def test_milestones_are_kept_and_version_zero_counts_as_one() -> None:
    policy = RetentionSection(keep_last=2, milestone_every=3)

    # latest 7; the last two: 6, 7; milestones: 0, 3, 6
    assert retired(policy, versions(*range(8))) == [1, 2, 4, 5]
    assert keeps(0, latest=7, open_bases=(), policy=policy) == "a milestone (every 3)"


def test_the_base_of_a_round_not_yet_closed_is_kept() -> None:
    policy = RetentionSection(keep_last=1)

    assert retired(policy, versions(*range(6)), open_bases=frozenset({3})) == [0, 1, 2, 4]


def test_a_version_whose_eval_is_pending_waits() -> None:
    policy = RetentionSection(keep_last=1)

    assert retired(policy, versions(*range(4), pending=(1,))) == [0, 2]


def test_the_latest_is_kept_even_alone() -> None:
    assert retired(RetentionSection(keep_last=1), versions(0)) == []


def test_files_a_retired_version_left_are_finished_and_nothing_else() -> None:
    rows = [Version(1, ("a", "b", "c"), retired=True), Version(2, ("d",), retired=True)]
    rows += versions(3)

    decided = plan(
        now=NOW, policy=RetentionSection(keep_last=1), versions=rows, open_bases=set(),
        blobs=[], present={"b", "x"},
    )  # fmt: skip

    assert decided.versions == []
    assert [key for key, _ in decided.finish] == ["b"]


def test_contribution_blobs_go_once_their_round_closed_and_the_grace_passed() -> None:
    policy = RetentionSection(contribution_grace_s=3600)
    blobs = [
        Blob("old", "r/1/a.bin", NOW - timedelta(hours=2)),
        Blob("exactly", "r/2/a.bin", NOW - timedelta(hours=1)),
        Blob("young", "r/3/a.bin", NOW - timedelta(minutes=59)),
        Blob("open", "r/4/a.bin", None),  # its round is not closed
        Blob("done", "r/0/a.bin", NOW - timedelta(days=9), retired=True),
        Blob("left", "r/0/b.bin", NOW - timedelta(days=9), retired=True),
    ]

    decided = plan(
        now=NOW, policy=policy, versions=[], open_bases=set(), blobs=blobs, present={"r/0/b.bin"}
    )

    assert [cid for cid, _ in decided.contributions] == ["old", "exactly"]
    assert [key for key, _ in decided.finish] == ["r/0/b.bin"]


def test_no_grace_keeps_contribution_blobs_for_ever() -> None:
    blobs = [Blob("old", "r/1/a.bin", NOW - timedelta(days=300))]

    decided = plan(
        now=NOW, policy=RetentionSection(contribution_grace_s=None), versions=[],
        open_bases=set(), blobs=blobs, present=set(),
    )  # fmt: skip

    assert decided.contributions == []


def test_the_retention_section_is_validated_and_defaults_delete_no_version() -> None:
    cfg = parse_config({"name": "x", "data": {"path": "d.txt"}})
    assert (cfg.retention.keep_last, cfg.retention.milestone_every) == (0, 0)
    assert cfg.retention.contribution_grace_s == 24 * 3600.0

    for bad, key in (
        ({"keep_last": -1}, "retention.keep_last"),
        ({"milestone_every": 1.5}, "retention.milestone_every"),
        ({"contribution_grace_s": -1}, "retention.contribution_grace_s"),
        ({"keep": 3}, "retention.keep"),
    ):
        with pytest.raises(ConfigError, match=re.escape(key)):
            parse_config({"name": "x", "data": {"path": "d.txt"}, "retention": bad})


# ---------------------------------------------------------------- a live server


def retired_versions(database_url: str, run_id: str) -> list[tuple[int, bool]]:
    """(version, whether retention deleted its files) for each checkpoint row."""
    found = rows(
        database_url,
        "SELECT version, files_deleted_at IS NOT NULL AS gone FROM checkpoints "
        "WHERE run_id = $1 ORDER BY version",
        run_id,
    )
    return [(r["version"], r["gone"]) for r in found]


def metric(text: str, kind: str) -> float:
    m = re.search(rf'^diloco_janitor_removed_total\{{kind="{kind}"\}} (\S+)$', text, re.M)
    assert m, kind
    return float(m.group(1))


# keep_last = 2, milestone_every = 3 after six rounds: kept are the latest (6), the last two
# (5, 6) and the milestones (0, 3, 6); version 0 has no delta
POLICY = {"keep_last": 2, "milestone_every": 3, "contribution_grace_s": 0}
EXPECTED = sorted(
    [f"checkpoints/{v}.safetensors" for v in (0, 3, 5, 6)]
    + [f"checkpoints/{v}.state.safetensors" for v in (0, 3, 5, 6)]
    + [f"checkpoints/{v}.delta.safetensors" for v in (3, 5, 6)]
)
RETIRED = [(0, False), (1, True), (2, True), (3, False), (4, True), (5, False), (6, False)]


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_live_server_deletes_what_the_policy_says_and_nothing_else(
    backend: str, request: pytest.FixtureRequest, database_url: str, tmp_path: Path
) -> None:
    # Prepare: a server whose janitor passes often, on disk or on the bucket
    settings: dict[str, object] = {"janitor_interval_s": 0.3}
    if backend == "s3":
        request.getfixturevalue("s3_env")
        bucket = request.getfixturevalue("s3_server").bucket
        settings["storage"] = f"s3://{bucket}/retention-{secrets.token_hex(4)}"
        settings["scratch_dir"] = tmp_path / "scratch"  # not the system's temp dir
    server = ServerProcess(data_dir=tmp_path / "srv", database_url=database_url, **settings)
    store: Storage = open_storage(str(settings.get("storage", "")), tmp_path / "srv" / "blobs")
    config = server_run_config(rounds={"quorum": 1, "max_rounds": 8})
    config["retention"] = POLICY
    # no audits: an audited upload's blob is kept for good (tests/test_audits.py)
    config["audit"] = {"fraction": 0.0}
    try:
        server.wait_ready()
        with server.client() as http:
            run_id = create_run(http, config)["id"]
            token = register(http, "steady")
            # Execute: six rounds close, one upload each; round 7 stays open on v6
            close_rounds(http, token, run_id, 6)
            prefix = f"runs/{run_id}/"

            def listing() -> list[str]:
                return sorted(b.key.removeprefix(prefix) for b in store.list_blobs(prefix))

            def settled() -> bool:
                return [k for k in listing() if not k.startswith("data/")] == EXPECTED

            wait_for(settled, timeout=60, what=f"retention to settle: {listing()}")
            keys = listing()
            answer = http.get(f"{API}/runs/{run_id}/storage")
            ledger = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()
            gone = http.get(f"{API}/runs/{run_id}/checkpoints/2")
            gone_delta = http.get(f"{API}/runs/{run_id}/checkpoints/4/delta")
            kept = http.get(f"{API}/runs/{run_id}/checkpoints/3", follow_redirects=False)
            plan_ = http.get(f"{API}/runs/{run_id}/checkpoints/6/catch-up", params={"from": 3})
            plan_late = http.get(f"{API}/runs/{run_id}/checkpoints/6/catch-up", params={"from": 4})
            metrics = http.get("/metrics").text
    finally:
        server.stop()

    # Assert: the store holds the data, the kept versions' files and nothing else
    assert [k for k in keys if not k.startswith("data/")] == EXPECTED
    assert any(k.startswith("data/") for k in keys)
    assert retired_versions(database_url, run_id) == RETIRED
    contributions = rows(
        database_url,
        "SELECT round_index, sha256, nbytes, blob_key, blob_deleted_at FROM contributions "
        "WHERE run_id = $1 ORDER BY round_index",
        run_id,
    )
    assert [r["round_index"] for r in contributions] == [1, 2, 3, 4, 5, 6]
    for r in contributions:  # the blob is gone, the ledger's record of it is not
        assert r["blob_deleted_at"] is not None
        assert re.fullmatch(r"[0-9a-f]{64}", r["sha256"]) and r["nbytes"] > 0
        assert r["blob_key"].removeprefix(prefix) not in keys
    # the API's round view says so, and still shows what was recorded
    (shown,) = ledger["contributions"]
    assert shown["blob_retained"] is False
    assert (shown["sha256"], shown["nbytes"]) == (
        contributions[0]["sha256"],
        contributions[0]["nbytes"],
    )

    # a retired version answers 410 gone, a kept one is served; catch-up never offers a
    # retired delta (v4's), and still offers kept ones
    assert gone.status_code == 410 and gone.json()["error"] == "gone", gone.text
    assert gone_delta.status_code == 410 and gone_delta.json()["error"] == "gone"
    assert kept.status_code in (200, 307), kept.text
    assert plan_.status_code == 200 and plan_.json()["kind"] == "full", plan_.text
    assert [d["version"] for d in plan_late.json()["deltas"]] == [5, 6], plan_late.text

    # /storage counts what the listing holds, by kind and in total
    usage = answer.json()
    by_kind: Counter[str] = Counter()
    for k in keys:
        by_kind[k.split("/")[0]] += 1
    assert usage["kinds"]["checkpoints"]["objects"] == 4
    assert usage["kinds"]["states"]["objects"] == 4
    assert usage["kinds"]["deltas"]["objects"] == 3
    assert usage["kinds"]["data"]["objects"] == by_kind["data"]
    assert usage["kinds"]["contributions"] == {"objects": 0, "bytes": 0}
    assert usage["total"]["objects"] == len(keys)
    assert usage["total"]["bytes"] == sum(b.nbytes for b in store.list_blobs(prefix))
    assert usage["retention"] == {
        "keep_last": 2, "milestone_every": 3, "contribution_grace_s": 0.0
    }  # fmt: skip
    assert (usage["versions_kept"], usage["versions_retired"]) == (4, 3)
    assert (usage["contributions_kept"], usage["contributions_retired"]) == (0, 6)
    # one server: each retirement counted once
    assert metric(metrics, "retired_checkpoint") == 3
    assert metric(metrics, "retired_contribution") == 6


def test_storage_of_an_unknown_run_is_404(server: ServerProcess) -> None:
    with server.client() as http:
        r = http.get(f"{API}/runs/nope/storage")

    assert r.status_code == 404 and r.json()["error"] == "run_not_found"


def six_closed_rounds(database_url: str, tmp_path: Path) -> tuple[str, LocalStorage]:
    """Six rounds closed and evaluated by a server whose janitor passes only at its start,
    then stopped (a pending eval holds its version); the run and its store."""
    server = ServerProcess(
        data_dir=tmp_path / "srv", database_url=database_url, janitor_interval_s=600
    )
    config = server_run_config(rounds={"quorum": 1, "max_rounds": 8})
    config["retention"] = POLICY
    # no audits: an audited upload's blob is kept for good (tests/test_audits.py)
    config["audit"] = {"fraction": 0.0}
    try:
        server.wait_ready()
        with server.client() as http:
            run_id = create_run(http, config)["id"]
            close_rounds(http, register(http, "steady"), run_id, 6)
        query = "SELECT count(*) AS n FROM checkpoints WHERE run_id = $1 AND eval_loss IS NULL"
        wait_for(lambda: rows(database_url, query, run_id)[0]["n"] == 0, timeout=60, what="evals")
    finally:
        server.stop()
    return run_id, LocalStorage(tmp_path / "srv" / "blobs")


def test_two_replicas_retiring_at_once_delete_each_thing_once(
    database_url: str, tmp_path: Path
) -> None:
    # Prepare: six rounds closed by a server whose janitor passes only at its start, then
    # stopped once every version's eval is in (a pending eval holds its version)
    run_id, store = six_closed_rounds(database_url, tmp_path)
    prefix = f"runs/{run_id}/"
    assert len([b for b in store.list_blobs(f"{prefix}rounds/")]) == 6, "nothing retired yet"
    # a replica that marked version 1 and crashed before deleting its files
    mark = "UPDATE checkpoints SET files_deleted_at = now() WHERE run_id = $1 AND version = 1"
    rows(database_url, mark, run_id)
    assert store.exists(f"{prefix}checkpoints/1.safetensors")

    def removed(kind: str) -> float:
        value = REGISTRY.get_sample_value("diloco_janitor_removed_total", {"kind": kind})
        return value or 0.0

    kinds = ("retired_checkpoint", "retired_contribution", "retired_leftover")
    before = {kind: removed(kind) for kind in kinds}

    # Execute: two replicas' passes at once, on one database and one store
    async def two_replicas() -> None:
        engine = make_engine(database_url)
        try:
            sessions = make_sessionmaker(engine)
            present = {b.key for b in store.list_blobs("runs/")}
            now = datetime.now(UTC)
            await asyncio.gather(
                *(retention.apply(sessions, store, present=present, now=now) for _ in range(2))
            )
        finally:
            await engine.dispose()

    asyncio.run(two_replicas())

    # Assert: each version and each blob retired once, by one of them; the files the
    # crashed replica left deleted (by either: deleting twice is harmless); the rest kept
    keys = sorted(b.key.removeprefix(prefix) for b in store.list_blobs(prefix))
    assert [k for k in keys if not k.startswith("data/")] == EXPECTED
    assert removed("retired_checkpoint") - before["retired_checkpoint"] == 2  # 2 and 4
    # each replica finishes v1's three files (6); one whose read follows the other's marks
    # also finds them marked and still listed (the listing is older) and deletes them again:
    # 2's and 4's six files, the six contributions' blobs, or both (one mark each)
    assert removed("retired_leftover") - before["retired_leftover"] in (6, 12, 18)
    assert removed("retired_contribution") - before["retired_contribution"] == 6
    assert retired_versions(database_url, run_id) == RETIRED


def test_a_version_whose_full_files_are_pending_keeps_its_base_and_its_blobs(
    database_url: str, tmp_path: Path
) -> None:
    # Prepare: six rounds closed and evaluated, the server stopped; then version 5 as its
    # closer would leave it had it died after publishing: its full files pending
    # (server.rounds.full_files), so a rebuild will read version 4 and round 5's upload
    run_id, store = six_closed_rounds(database_url, tmp_path)
    pending = (
        'UPDATE checkpoints SET full_files_at = NULL, rebuild = \'{"contributions": [], '
        '"history": []}\' WHERE run_id = $1 AND version = 5 RETURNING version'
    )
    assert len(rows(database_url, pending, run_id)) == 1
    prefix = f"runs/{run_id}/"

    # Execute: a retention pass
    async def one_pass() -> None:
        engine = make_engine(database_url)
        try:
            present = {b.key for b in store.list_blobs("runs/")}
            now = datetime.now(UTC)
            await retention.apply(make_sessionmaker(engine), store, present=present, now=now)
        finally:
            await engine.dispose()

    asyncio.run(one_pass())

    # Assert: version 4 (its base, otherwise retired) and 5 kept, 1 and 2 retired as the
    # policy says; round 5's blob kept, the other rounds' retired (no grace)
    assert retired_versions(database_url, run_id) == [
        (0, False), (1, True), (2, True), (3, False), (4, False), (5, False), (6, False)
    ]  # fmt: skip
    assert store.exists(f"{prefix}checkpoints/4.safetensors")
    blobs = rows(
        database_url,
        "SELECT merged_into_round AS r, blob_deleted_at IS NOT NULL AS gone FROM contributions "
        "WHERE run_id = $1 ORDER BY merged_into_round",
        run_id,
    )
    assert [(b["r"], b["gone"]) for b in blobs] == [
        (1, True), (2, True), (3, True), (4, True), (5, False), (6, True)
    ]  # fmt: skip
