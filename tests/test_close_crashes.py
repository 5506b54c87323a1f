"""Crashes and failures at every stage boundary of a close, with real server processes on a
real Postgres, armed with the fault injector (``DILOCO_FAULTS``).

For each stage (claim, aggregate, eval, write: the delta durable, publish: the version
published with its full files pending, full: its full files committed, the row not yet
marked): the server closing round 1 dies there (SIGKILL); a restarted server (no faults)
finishes the round, or, after publish, makes its full files durable (``server.rounds.
full_files``: rebuilt from the stored uploads after publish, found and marked after full).
Then:
- the published parameters and the outer momentum are ``torch.equal`` to a reference
  computed in this process from the same uploads with the same library calls, whichever
  order the uploads arrived in (a's first at every other stage, b's at the rest);
- the step was applied once: one checkpoint row per version, round 2 trains from version 1;
- every upload acknowledged with a 2xx is counted in the step and credited.
And a close that *fails* at each stage in turn (an exception, not a crash) is recorded on
the round, retried with backoff, and publishes the same bits in the end; so does a rebuild
that fails, and one that dies (a third server finishes it).
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
import torch
from safetensors.torch import load as safetensors_load

from server.storage import keys
from server.storage.base import Storage, open_storage
from tests.conftest import server_run_config
from tests.support.contribute import (
    API,
    Work,
    create_run,
    fetch_params,
    read_outer_state,
    reference_step,
    register,
    train,
    upload,
)
from tests.support.live import ServerProcess, wait_for

# Each a distinct position in the close. There is no "step" stage: the pass that aggregates
# is the pass that steps (``close.step`` is hit right after ``close.aggregate``, with nothing
# between), so killing there proved nothing the aggregate stage does not.
STAGES = ["claim", "aggregate", "eval", "write", "publish", "full"]
PUBLISHED = {"publish", "full"}  # the stages after the publishing transaction
FAILING = STAGES[:-1]  # a close failing after it publishes never reaches "full"
QUICK = {"claim_ttl_s": 2, "close_retry_base_s": 0.2, "close_retry_max_s": 0.5}


async def _checkpoint_rows(database_url: str, run_id: str) -> list[int]:
    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        rows = await conn.fetch(
            "SELECT version FROM checkpoints WHERE run_id = $1 ORDER BY version", run_id
        )
    finally:
        await conn.close()
    return [r["version"] for r in rows]


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    procs: list[ServerProcess] = []
    yield procs
    for proc in procs:
        proc.stop()


def _round_one_with_two_uploads(
    http: httpx.Client, arrival: str = "ab"
) -> tuple[dict, dict, list[Work]]:
    """A run whose round 1 closes once two uploads are in: a's and b's, trained in that
    order and uploaded (2xx) in the order ``arrival`` names; their work as trained."""
    config = server_run_config(rounds={"quorum": 2, "target": 2, "max_rounds": 3})
    run = create_run(http, config | {"seed": 7})
    tokens = {name: register(http, name) for name in "ab"}
    works = {name: train(http, tokens[name], run["id"], steps=2) for name in "ab"}
    for name in arrival:
        assert upload(http, tokens[name], works[name]).status_code == 201
    base = safetensors_load(http.get(works["a"].lease["checkpoint"]["url"]).content)
    return run, base, [works["a"], works["b"]]


def _state_file(store: Storage | ServerProcess, key: str) -> Path:
    """Where the outer state is: the server's data dir, or fetched from the bucket."""
    if isinstance(store, ServerProcess):
        return store.data_dir / "blobs" / key
    dest = Path(tempfile.mkdtemp(prefix="crash-state-")) / "state.safetensors"
    store.fetch(key, dest)
    return dest


def _assert_published_once_and_exact(
    http: httpx.Client, store: Storage | ServerProcess, database_url: str, run: dict, expected
) -> dict:  # type: ignore[no-untyped-def]
    run_id = run["id"]
    wait_for(
        lambda: http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"] == 1,
        timeout=90,
        what="round 1 to be published",
    )
    # the parameters volunteers download, and the state a restart continues from
    published = fetch_params(http, f"{API}/runs/{run_id}/checkpoints/1")
    assert published.keys() == expected.params.keys()
    for name, tensor in expected.params.items():
        assert torch.equal(published[name], tensor), name
    state = read_outer_state(_state_file(store, keys.version(run_id, 1).state))
    assert state.momentum.keys() == state.residual.keys() == expected.params.keys()
    for name in expected.params:
        assert torch.equal(state.momentum[name], expected.momentum[name]), name
        assert torch.equal(state.residual[name], expected.residual[name]), name
    # applied once: one row per version, and round 2 trains from version 1
    assert asyncio.run(_checkpoint_rows(database_url, run_id)) == [0, 1]
    rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
    assert [(r["index"], r["state"], r["base_version"]) for r in rounds] == [
        (1, "closed", 0),
        (2, "open", 1),
    ]
    # every acknowledged upload counted and credited
    listed = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()["contributions"]
    assert len(listed) == 2 and all(c["aggregated"] and c["credit"] > 0 for c in listed)
    assert rounds[0]["accepted"] == 2
    return rounds[0]


@pytest.mark.parametrize("stage", STAGES)
def test_a_server_killed_at_each_stage_of_a_close_publishes_the_exact_step_after_restart(
    stage, database_url, tmp_path: Path, started
):
    # Prepare: a server armed to die at the stage, two accepted uploads that close round 1
    data_dir = tmp_path / "srv"
    doomed = ServerProcess(
        data_dir=data_dir, database_url=database_url, faults=f"close.{stage}=die", **QUICK
    )
    started.append(doomed)
    http = doomed.wait_ready().client()
    # the uploads arrive in one order or the other (every other stage): the reference is
    # computed in a's then b's, and the exact sum makes the order no matter, to the bit
    arrival = "ba" if STAGES.index(stage) % 2 else "ab"
    run, base, works = _round_one_with_two_uploads(http, arrival)
    expected = reference_step(run, base, works)

    # Execute: it dies at the stage; a new server on the same database and data dir
    wait_for(lambda: not doomed.alive(), timeout=90, what=f"the server to die at {stage}")
    assert doomed.popen.returncode == -9
    assert f"fault injected: dying at close.{stage}" in doomed.output()
    survivor = ServerProcess(data_dir=data_dir, database_url=database_url, **QUICK)
    started.append(survivor)
    http = survivor.wait_ready().client()

    # Assert: the exact step, once, with both uploads
    round1 = _assert_published_once_and_exact(http, survivor, database_url, run, expected)
    if stage in PUBLISHED:  # it died after publishing: the close was not redone
        assert round1["close_attempts"] == 1 and round1["error"] is None
        how = "rebuilt and committed" if stage == "publish" else "found committed"
        assert f"version 1: full files {how}" in survivor.output()
    else:  # the restarted server took the dead one's claim over once it expired
        assert round1["close_attempts"] == 2
        assert round1["error"]["code"] == "claim_expired", round1


def test_a_close_failing_at_each_stage_in_turn_is_retried_and_publishes_the_exact_step(
    database_url, tmp_path: Path, started
):
    # Prepare: every stage fails once, so each attempt gets one stage further; the last one
    # fails once published, and the rebuild of its full files fails once too
    faults = ",".join([*(f"close.{stage}=fail" for stage in FAILING), "full.rebuild=fail"])
    server = ServerProcess(
        data_dir=tmp_path / "srv", database_url=database_url, faults=faults, **QUICK
    )
    started.append(server)
    http = server.wait_ready().client()

    # Execute
    run, base, works = _round_one_with_two_uploads(http)

    # Assert: a failed attempt recorded per stage before publish, the last one published
    # (then failed after its commit, which changes nothing), and the result is the exact step
    round1 = _assert_published_once_and_exact(
        http, server, database_url, run, reference_step(run, base, works)
    )
    assert round1["close_attempts"] == len(FAILING), round1
    assert round1["error"]["code"] == "injected_fault"
    assert (
        round1["error"]["detail"]
        == f"attempt {len(FAILING) - 1}: InjectedFault: fault injected at close.write (hit 1)"
    )
    assert round1["error"]["retry_at"] is None  # closed: nothing left to retry
    log = server.output()
    for attempt, stage in enumerate(FAILING[:-1], start=1):
        assert f"attempt {attempt}: InjectedFault: fault injected at close.{stage}" in log
    assert "rebuilding its full files failed (InjectedFault" in log
    assert "version 1: full files rebuilt and committed" in log


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_rebuild_that_dies_is_finished_by_another_server_with_the_exact_step(
    backend: str, request: pytest.FixtureRequest, database_url, tmp_path: Path, started
):
    # Prepare: three servers, each with a scratch dir of its own (three hosts), on disk or
    # on the bucket; the closer dies once it has published: its full files, written in its
    # scratch dir or beside their keys, are never committed
    settings: dict[str, object] = dict(QUICK)
    if backend == "s3":
        request.getfixturevalue("s3_env")
        bucket = request.getfixturevalue("s3_server").bucket
        settings["storage"] = f"s3://{bucket}/rebuild-{secrets.token_hex(4)}"
    data_dir = tmp_path / "srv"
    store = open_storage(str(settings.get("storage", "")), data_dir / "blobs")

    def server(host: str, faults: str = "") -> ServerProcess:
        proc = ServerProcess(data_dir=data_dir, database_url=database_url, faults=faults,
                             scratch_dir=tmp_path / host, **settings)  # fmt: skip
        started.append(proc)
        return proc.wait_ready()

    closer = server("a", "close.publish=die")
    http = closer.client()
    run, base, works = _round_one_with_two_uploads(http)
    expected = reference_step(run, base, works)
    wait_for(lambda: not closer.alive(), timeout=90, what="the closer to die once published")

    # Execute: a second server dies rebuilding them (the pass run again and checked, not
    # committed); a third one, with no faults, rebuilds them again
    rebuilder = server("b", "full.rebuild=die")
    wait_for(lambda: not rebuilder.alive(), timeout=90, what="the rebuilder to die")
    assert "fault injected: dying at full.rebuild" in rebuilder.output()
    survivor = server("c")
    http = survivor.client()

    # Assert: the exact step, once; the survivor rebuilt the files
    round1 = _assert_published_once_and_exact(http, store, database_url, run, expected)
    assert round1["close_attempts"] == 1 and round1["error"] is None
    assert "version 1: full files rebuilt and committed" in survivor.output()
