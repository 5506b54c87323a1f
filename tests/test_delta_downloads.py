"""int8 delta downloads: the delta route, the catch-up plan, served-bytes metrics, and a
volunteer that missed rounds catching up by deltas to the very bytes of the checkpoint.

A real ``diloco serve`` on a fresh migrated database. Most tests publish versions themselves
(``publish``, marked TEST SETUP), so that sizes, missing deltas and older versions can be
chosen: the files go into the server's data dir in the published layout
(``diloco.checkpoint.write_params``, ``diloco.wire.delta.write_delta``) and the ``checkpoints``
rows are inserted with SQL. The last test drives real rounds and reads the deltas real
closes wrote.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest
import torch
from safetensors.torch import load as safetensors_load

from client import credentials
from client.api import RetryPolicy, ServerAPI
from client.fetch import Fetcher
from client.progress import Reporter
from diloco.checkpoint import checkpoint_params_only, write_params
from diloco.protocol.messages import CheckpointRef, Lease
from diloco.wire.codec import Int8Codec
from diloco.wire.delta import apply_delta, read_delta, write_delta
from server.storage import keys
from tests.conftest import server_run_config
from tests.support.contribute import API, auth, create_run, register, train, upload
from tests.support.live import ServerProcess, wait_for

FAST = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.05, total_s=10.0)


@dataclass
class Hub:
    server: ServerProcess
    database_url: str

    @property
    def blobs(self) -> Path:
        return self.server.data_dir / "blobs"


@pytest.fixture(scope="module")
def hub(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """A server whose database this module can write to (the test setup below)."""
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        proc = ServerProcess(data_dir=tmp_path_factory.mktemp("srv"), database_url=url)
        try:
            yield Hub(proc.wait_ready(), url)
        finally:
            proc.stop()


@pytest.fixture
def http(hub: Hub) -> Iterator[httpx.Client]:
    with hub.server.client() as client:
        yield client


# ---------------------------------------------------------------- TEST SETUP: publishing


@dataclass(frozen=True)
class Published:
    version: int
    sha256: str
    nbytes: int
    delta_sha256: str | None
    delta_nbytes: int | None
    params: dict[str, torch.Tensor]


def _sql(hub: Hub, query: str, *args: object) -> None:
    async def go() -> None:
        conn = await asyncpg.connect(hub.database_url.replace("+asyncpg", ""))
        try:
            await conn.execute(query, *args)
        finally:
            await conn.close()

    asyncio.run(go())


def publish(
    hub: Hub, run_id: str, base: dict[str, torch.Tensor], version: int, *, delta: bool = True
) -> Published:
    """TEST SETUP, in place of a close: version ``version`` = ``base`` + a random int8
    change, as the files and the ``checkpoints`` row a close writes (``delta=False``: a
    version published before deltas existed)."""
    folder = hub.blobs / keys.checkpoints(run_id)
    gen = torch.Generator().manual_seed(version)
    codec = Int8Codec(256)
    encoded = {n: codec.encode(1e-3 * torch.randn(p.shape, generator=gen)) for n, p in base.items()}
    delta_key = keys.version(run_id, version).delta
    delta_sha = write_delta(
        hub.blobs / delta_key, encoded, run_id=run_id, version=version, base_version=version - 1,
        codec=codec,
    )  # fmt: skip
    params = {n: p.clone() for n, p in base.items()}
    shapes = {n: tuple(p.shape) for n, p in base.items()}
    apply_delta(params, read_delta(hub.blobs / delta_key, shapes))
    params_key = keys.version(run_id, version).params
    sha = write_params(hub.blobs / params_key, params, version=version, metadata={"run_id": run_id})
    nbytes, delta_nbytes = (folder / f"{version}.safetensors").stat().st_size, None
    if delta:
        delta_nbytes = (hub.blobs / delta_key).stat().st_size
    else:
        (hub.blobs / delta_key).unlink()
    _sql(
        hub,
        "INSERT INTO checkpoints (run_id, version, params_key, state_key, sha256, nbytes, "
        "eval_loss, delta_key, delta_sha256, delta_nbytes, full_files_at) "
        "VALUES ($1, $2, $3, $3, $4, $5, 1.0, $6, $7, $8, now())",
        run_id, version, params_key, sha, nbytes,
        delta_key if delta else None, delta_sha if delta else None, delta_nbytes,
    )  # fmt: skip
    return Published(version, sha, nbytes, delta_sha if delta else None, delta_nbytes, params)


def base_params(http: httpx.Client, run_id: str) -> dict[str, torch.Tensor]:
    r = http.get(f"{API}/runs/{run_id}/checkpoints/0")
    assert r.status_code == 200, r.text
    return dict(safetensors_load(r.content))


@dataclass
class History:
    run_id: str
    versions: dict[int, Published]  # 1..5 with deltas, 6 without


@pytest.fixture(scope="module")
def history(hub: Hub) -> History:
    """A run with versions 1..5 published with deltas and 6 without one."""
    with hub.server.client() as http:
        run_id = create_run(http, server_run_config())["id"]
        params = base_params(http, run_id)
    versions: dict[int, Published] = {}
    for v in range(1, 7):
        versions[v] = publish(hub, run_id, params, v, delta=v <= 5)
        params = versions[v].params
    return History(run_id, versions)


def served(http: httpx.Client, kind: str) -> float:
    text = http.get("/metrics").text
    found = re.search(rf'^diloco_served_bytes_total\{{kind="{kind}"\}} (\S+)$', text, re.M)
    assert found, f"no served bytes of kind {kind} in /metrics"
    return float(found.group(1))


# ---------------------------------------------------------------- the delta route


def test_a_delta_is_served_with_its_etag_versions_ranges_and_304(
    http: httpx.Client, history: History
) -> None:
    v3 = history.versions[3]
    url = f"{API}/runs/{history.run_id}/checkpoints/3/delta"

    whole = http.get(url)
    part = http.get(url, headers={"Range": "bytes=10-99"})
    same = http.get(url, headers={"If-None-Match": f'"{v3.delta_sha256}"'})

    assert whole.status_code == 200, whole.text
    assert hashlib.sha256(whole.content).hexdigest() == v3.delta_sha256
    assert len(whole.content) == v3.delta_nbytes
    assert whole.headers["ETag"] == f'"{v3.delta_sha256}"'
    assert (whole.headers["X-Checkpoint-Version"], whole.headers["X-Base-Version"]) == ("3", "2")
    assert part.status_code == 206 and part.content == whole.content[10:100]
    assert part.headers["Content-Range"] == f"bytes 10-99/{v3.delta_nbytes}"
    assert same.status_code == 304 and same.content == b""


def test_a_version_without_a_delta_is_404_not_found(http: httpx.Client, history: History) -> None:
    for version in (0, 6):
        r = http.get(f"{API}/runs/{history.run_id}/checkpoints/{version}/delta")
        assert r.status_code == 404, r.text
        assert r.json()["error"] == "not_found" and "has no delta" in r.json()["detail"]
    r = http.get(f"{API}/runs/run_000000000000/checkpoints/1/delta")
    assert (r.status_code, r.json()["error"]) == (404, "run_not_found")


def test_served_bytes_count_what_was_streamed_by_kind(http: httpx.Client, history: History) -> None:
    # Prepare
    v2 = history.versions[2]
    run = f"{API}/runs/{history.run_id}"
    before = {k: served(http, k) for k in ("checkpoint", "delta", "shard")}

    # Execute: a whole delta, a range of one, a 304, a whole checkpoint, a range of a shard
    http.get(f"{run}/checkpoints/2/delta")
    http.get(f"{run}/checkpoints/2/delta", headers={"Range": "bytes=-100"})
    http.get(f"{run}/checkpoints/2/delta", headers={"If-None-Match": f'"{v2.delta_sha256}"'})
    http.get(f"{run}/checkpoints/2")
    http.get(f"{run}/shards/0", headers={"Range": "bytes=0-9"})

    # Assert
    after = {k: served(http, k) for k in ("checkpoint", "delta", "shard")}
    assert after["delta"] - before["delta"] == v2.delta_nbytes + 100
    assert after["checkpoint"] - before["checkpoint"] == v2.nbytes
    assert after["shard"] - before["shard"] == 10


# ---------------------------------------------------------------- the catch-up plan


def test_the_plan_is_the_deltas_when_they_are_smaller_than_the_file(
    http: httpx.Client, history: History
) -> None:
    v = history.versions
    assert v[4].delta_nbytes and v[5].delta_nbytes
    assert v[4].delta_nbytes + v[5].delta_nbytes < v[5].nbytes  # the premise, by hand

    r = http.get(f"{API}/runs/{history.run_id}/checkpoints/5/catch-up", params={"from": 3})

    assert r.status_code == 200, r.text
    run = f"{API}/runs/{history.run_id}"
    assert r.json() == {
        "version": 5,
        "from": 3,
        "kind": "deltas",
        "deltas": [
            {
                "version": n,
                "base_version": n - 1,
                "url": f"{run}/checkpoints/{n}/delta",
                "sha256": v[n].delta_sha256,
                "nbytes": v[n].delta_nbytes,
            }
            for n in (4, 5)
        ],
        "full": {
            "version": 5,
            "url": f"{run}/checkpoints/5",
            "sha256": v[5].sha256,
            "nbytes": v[5].nbytes,
        },
        "delta_nbytes": v[4].delta_nbytes + v[5].delta_nbytes,
    }


def test_the_plan_is_the_full_file_when_the_deltas_weigh_more_or_one_is_missing(
    http: httpx.Client, history: History
) -> None:
    v = history.versions
    assert sum(v[n].delta_nbytes or 0 for n in range(1, 6)) >= v[5].nbytes  # the premise
    run = f"{API}/runs/{history.run_id}"

    heavier = http.get(f"{run}/checkpoints/5/catch-up", params={"from": 0})
    missing = http.get(f"{run}/checkpoints/6/catch-up", params={"from": 4})
    latest = http.get(f"{run}/checkpoints/latest/catch-up", params={"from": 5})

    for r, version in ((heavier, 5), (missing, 6), (latest, 6)):
        assert r.status_code == 200, r.text
        plan = r.json()
        assert (plan["version"], plan["kind"], plan["deltas"], plan["delta_nbytes"]) == (
            version, "full", [], 0,
        )  # fmt: skip
        assert plan["full"]["sha256"] == v[version].sha256


@pytest.mark.parametrize(
    ("version", "query"),
    [
        ("5", {"from": "abc"}),
        ("5", {"from": "-1"}),
        ("5", {"from": "5"}),
        ("5", {"from": "7"}),
        ("5", {"from": "99999999999"}),
        ("5", {}),
        ("0", {"from": "0"}),
        ("latest", {"from": "6"}),
    ],
)
def test_a_bad_from_is_422_invalid_request(
    http: httpx.Client, history: History, version: str, query: dict[str, str]
) -> None:
    r = http.get(f"{API}/runs/{history.run_id}/checkpoints/{version}/catch-up", params=query)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "invalid_request" and "from" in r.json()["detail"]


def test_the_plan_of_an_unknown_run_or_version_is_404(http: httpx.Client, history: History) -> None:
    r = http.get(f"{API}/runs/run_000000000000/checkpoints/5/catch-up", params={"from": 1})
    assert (r.status_code, r.json()["error"]) == (404, "run_not_found")
    r = http.get(f"{API}/runs/{history.run_id}/checkpoints/60/catch-up", params={"from": 1})
    assert (r.status_code, r.json()["error"]) == (404, "not_found")


# ---------------------------------------------------------------- the volunteer's side


class Recorder(Reporter):
    def __init__(self) -> None:
        super().__init__(quiet=False, bar=False)
        self.lines: list[str] = []

    def _print(self, message: str) -> None:
        self.lines.append(message)


async def _lease_for(server: ServerProcess, token: str, run_id: str) -> Lease:
    async with ServerAPI(server.url, token=token, retry=FAST) as api:
        return await api.join(run_id)


async def _fetch(server: ServerProcess, lease: Lease, root: Path) -> tuple[Fetcher, Recorder]:
    say = Recorder()
    async with ServerAPI(server.url, retry=FAST) as api:
        fetcher = Fetcher(api, say, root)
        await fetcher.inputs(lease, int(lease.config["model"]["block_size"]))
    return fetcher, say


def _hold(root: Path, run_id: str, version: Published) -> Path:
    """A volunteer's cache that holds ``version`` of the run (as a past round left it)."""
    path = credentials.checkpoint_path(run_id, version.version, version.sha256, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_params(path, version.params, version=version.version, metadata={"run_id": run_id})
    return path


def _ref(run_id: str, version: Published) -> CheckpointRef:
    return CheckpointRef(
        url=f"{API}/runs/{run_id}/checkpoints/{version.version}",
        sha256=version.sha256,
        nbytes=version.nbytes,
        version=version.version,
    )


def _run_with_versions(hub: Hub, name: str, n: int) -> tuple[str, str, dict[int, Published]]:
    """TEST SETUP: a run with versions 1..n published with deltas; a volunteer's token."""
    with hub.server.client() as http:
        run_id = create_run(http, server_run_config())["id"]
        token = register(http, name)
        params = base_params(http, run_id)
    versions: dict[int, Published] = {}
    for v in range(1, n + 1):
        versions[v] = publish(hub, run_id, params, v)
        params = versions[v].params
    return run_id, token, versions


def test_a_volunteer_holding_an_older_version_catches_up_by_deltas(
    hub: Hub, tmp_path: Path
) -> None:
    # Prepare: a volunteer's cache holds v1; its lease (a real join answer) is pointed at
    # v3, as leases will be once the close path publishes versions with deltas
    run_id, token, versions = _run_with_versions(hub, "catcher", 3)
    lease = asyncio.run(_lease_for(hub.server, token, run_id))
    lease = lease.model_copy(update={"checkpoint": _ref(run_id, versions[3])})
    _hold(tmp_path, run_id, versions[1])

    # Execute
    fetcher, say = asyncio.run(_fetch(hub.server, lease, tmp_path))

    # Assert: the cached v3 is the published file, bit for bit, rebuilt from two deltas
    cached = credentials.checkpoint_path(run_id, 3, versions[3].sha256, tmp_path)
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == versions[3].sha256
    assert fetcher.caught_up == 1
    assert fetcher.delta_bytes == sum(versions[v].delta_nbytes or 0 for v in (2, 3))
    assert fetcher.full_bytes == lease.shard.nbytes  # the shard only
    assert any("caught up from v1 by 2 deltas" in line for line in say.lines), say.lines
    assert list((credentials.run_cache_dir(run_id, tmp_path) / "deltas").iterdir()) == []


def test_a_corrupted_delta_makes_the_volunteer_download_the_full_checkpoint(
    hub: Hub, tmp_path: Path
) -> None:
    # Prepare: as above, but one int8 of v3's delta is flipped on the server and its row
    # announces the corrupted file's sha256, so the download checks out and only the
    # rebuilt checkpoint's sha256 can tell
    run_id, token, versions = _run_with_versions(hub, "catcher-corrupt", 3)
    delta = hub.blobs / keys.version(run_id, 3).delta
    body = bytearray(delta.read_bytes())
    body[-1] ^= 0x01  # the last byte: an int8 of the last parameter's delta
    delta.write_bytes(body)
    _sql(
        hub,
        "UPDATE checkpoints SET delta_sha256 = $1 WHERE run_id = $2 AND version = 3",
        hashlib.sha256(body).hexdigest(), run_id,
    )  # fmt: skip
    lease = asyncio.run(_lease_for(hub.server, token, run_id))
    lease = lease.model_copy(update={"checkpoint": _ref(run_id, versions[3])})
    _hold(tmp_path, run_id, versions[1])

    # Execute
    fetcher, say = asyncio.run(_fetch(hub.server, lease, tmp_path))

    # Assert: warned, then the full checkpoint was downloaded and verified
    cached = credentials.checkpoint_path(run_id, 3, versions[3].sha256, tmp_path)
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == versions[3].sha256
    assert fetcher.caught_up == 0
    assert fetcher.full_bytes == versions[3].nbytes + lease.shard.nbytes
    assert any("by deltas failed" in line and "sha256" in line for line in say.lines), say.lines
    assert not [p for p in cached.parent.iterdir() if p.name.startswith(".")]  # no temp left


# ---------------------------------------------------------------- end to end


def test_a_volunteer_that_missed_rounds_catches_up_by_deltas_bit_for_bit(
    hub: Hub, tmp_path: Path
) -> None:
    # every close publishes its version's int8 delta (server.rounds.outer_step): the
    # deltas here are the real ones, from real rounds
    with hub.server.client() as http:
        run_id = create_run(http, server_run_config(rounds={"quorum": 1, "max_rounds": 8}))["id"]
        steady, late = register(http, "every-round"), register(http, "missed-rounds")

        def version() -> int:
            return int(http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"])

        def close_round(index: int) -> None:
            work = train(http, steady, run_id, steps=1)
            assert upload(http, steady, work).status_code == 201
            wait_for(lambda: version() == index, timeout=120, what=f"round {index} to close")

        # Prepare: round 1 closes; the late volunteer joins round 2 (fetching v1 into its
        # cache) and leaves; rounds 2 and 3 close without it
        close_round(1)
        lease = asyncio.run(_lease_for(hub.server, late, run_id))
        assert lease.checkpoint.version == 1
        asyncio.run(_fetch(hub.server, lease, tmp_path))
        r = http.delete(f"{API}/runs/{run_id}/rounds/{lease.round}/lease", headers=auth(late))
        assert r.status_code in (200, 204), r.text
        close_round(2)
        close_round(3)

        # Execute: it comes back for round 4, leased v3
        lease = asyncio.run(_lease_for(hub.server, late, run_id))
        fetcher, say = asyncio.run(_fetch(hub.server, lease, tmp_path))

        # Assert: caught up by the deltas of v2 and v3, and its parameters are the full
        # checkpoint's, bit for bit
        assert lease.checkpoint.version == 3
        assert fetcher.caught_up == 1, say.lines
        assert any("caught up from v1 by 2 deltas" in line for line in say.lines), say.lines
        full = dict(safetensors_load(http.get(f"{API}/runs/{run_id}/checkpoints/3").content))
    mine = checkpoint_params_only(
        credentials.checkpoint_path(run_id, 3, lease.checkpoint.sha256, tmp_path)
    )
    assert mine.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(mine[name], tensor), name
