"""Prepared datasets against a real `diloco serve`: registering, uploading (checked, resumed,
refused), runs on them, data leases with coverage, and the CLI's resumable upload."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from diloco.config import parse_config
from diloco.data.manifest import MANIFEST, Manifest, dataset_id
from diloco.data.units import UnitDealer
from diloco.wire.codec import Int8Codec
from diloco.wire.contribution import ContributionMeta, encode_contribution
from diloco.wire.header import FRESH, ReplayRecord
from tests.conftest import server_run_config
from tests.support.contribute import API, auth, register
from tests.support.datasets import make_dataset
from tests.support.live import ADMIN_TOKEN, admin_headers

REPO = Path(__file__).resolve().parents[1]
# a lease: 10 steps x 8 sequences x 32 tokens + 1 = 2,561 tokens: one unit per 4,096-token shard
STEPS, BATCH, BLOCK = 10, 8, 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    folder = tmp_path_factory.mktemp("data") / "ds"
    return folder, make_dataset(folder)


def register_manifest(http: httpx.Client, folder: Path) -> httpx.Response:
    return http.post(
        f"{API}/datasets", content=(folder / MANIFEST).read_bytes(), headers=admin_headers()
    )


def put(http: httpx.Client, ds: str, name: str, body: bytes, **headers: str) -> httpx.Response:
    return http.put(
        f"{API}/datasets/{ds}/files/{name}", content=body, headers=admin_headers() | headers
    )


def upload_all(http: httpx.Client, folder: Path, manifest: Manifest) -> str:
    ident = register_manifest(http, folder).json()["id"]
    for name in manifest.files():
        assert put(http, ident, name, (folder / name).read_bytes()).status_code in (200, 201)
    return str(ident)


def dataset_config(ident: str, **sections: dict) -> dict:
    raw = server_run_config(
        model={"arch": "llama", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": BLOCK},
        inner={"steps": STEPS, "batch_size": BATCH},
        rounds={"quorum": 1, "target": 100, "timeout_s": 600, "max_rounds": 5},
    )
    raw["data"] = {"dataset": ident}
    for name, values in sections.items():
        raw[name].update(values)
    return raw


def create(http: httpx.Client, config: dict, files: dict | None = None) -> httpx.Response:
    """Multipart with the config as a plain field, and ``files`` if any."""
    parts = {"config": (None, json.dumps(config))} | (files or {})
    return http.post(f"{API}/runs", files=parts, headers=admin_headers())


def test_files_are_kept_only_when_they_match_the_manifest(http, dataset):
    folder, manifest = dataset
    shard = (folder / "shard-00000.bin").read_bytes()

    first = register_manifest(http, folder)
    again = register_manifest(http, folder)
    ident = first.json()["id"]
    wrong_bytes = put(http, ident, "shard-00000.bin", bytes(len(shard)))
    wrong_size = put(http, ident, "shard-00000.bin", shard[:-2])
    unknown = put(http, ident, "shard-99999.bin", shard)
    traversal = http.put(f"{API}/datasets/{ident}/files/..%2Fx", content=b"x",
                         headers=admin_headers())  # fmt: skip
    no_admin = http.put(f"{API}/datasets/{ident}/files/val.bin", content=b"x")
    after_refusals = http.get(f"{API}/datasets/{ident}").json()
    ok = put(http, ident, "shard-00000.bin", shard)
    twice = put(http, ident, "shard-00000.bin", shard)

    assert first.status_code == 201 and again.status_code == 200
    assert ident == dataset_id(manifest)
    assert set(first.json()["missing"]) == set(manifest.files())
    assert wrong_bytes.status_code == 422 and "sha256 is not the manifest's" in wrong_bytes.text
    assert wrong_size.status_code == 422 and "Content-Length must be" in wrong_size.text
    assert unknown.status_code == 404 and traversal.status_code in (404, 422)
    assert no_admin.status_code == 401
    assert not after_refusals["files"]["shard-00000.bin"]["present"]  # nothing kept
    assert ok.status_code == 201 and twice.status_code == 200 and not twice.json()["stored"]
    got = http.get(f"{API}/datasets/{ident}/files/shard-00000.bin")
    assert got.content == shard and got.headers["etag"].strip('"') == manifest.shards[0].sha256


def test_an_invalid_manifest_is_refused_naming_the_key(http, dataset):
    folder, _ = dataset
    raw = json.loads((folder / MANIFEST).read_text())
    raw["dtype"] = "uint32"  # vocabulary 257 fits uint16

    r = http.post(f"{API}/datasets", content=json.dumps(raw), headers=admin_headers())
    garbage = http.post(f"{API}/datasets", content=b"{not json", headers=admin_headers())

    assert r.status_code == 422 and "dtype uint32 does not fit vocabulary 257" in r.text
    assert r.json()["error"] == "invalid_data"
    assert garbage.status_code == 422 and garbage.json()["error"] == "invalid_data"


def test_a_cut_upload_stores_nothing_and_the_cli_resumes_with_the_missing_files(
    server, http, tmp_path
):
    copy = tmp_path / "ds"  # a dataset of its own: other tests uploaded the shared one
    fresh = make_dataset(copy, documents=150, words=55)
    ident = register_manifest(http, copy).json()["id"]
    for name in ("tokenizer.json", "val.bin", "shard-00000.bin"):
        assert put(http, ident, name, (copy / name).read_bytes()).status_code == 201
    # a body cut halfway: the connection closes after half of shard-00001.bin
    body = (copy / "shard-00001.bin").read_bytes()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"PUT {API}/datasets/{ident}/files/shard-00001.bin HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body[: len(body) // 2])
    state = http.get(f"{API}/datasets/{ident}").json()
    assert not state["files"]["shard-00001.bin"]["present"]
    config = tmp_path / "run.toml"
    config.write_text(
        f'name = "resume"\n[model]\narch = "llama"\nn_layer = 1\nn_head = 2\nn_embd = 32\n'
        f'block_size = {BLOCK}\n[data]\ndataset = "{copy}"\n[inner]\nsteps = {STEPS}\n'
        f"batch_size = {BATCH}\n"
    )

    out = subprocess.run(
        [sys.executable, "-m", "client.cli", "run", "create", str(config), "--server",
         server.url, "--admin-token", ADMIN_TOKEN],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip

    assert out.returncode == 0, out.stderr
    sent = len(fresh.files()) - 3
    assert f"{sent} file(s) sent" in out.stderr and "3 already on the server" in out.stderr
    run = http.get(f"{API}/runs/{out.stdout.strip()}").json()
    assert run["data"]["dataset_id"] == ident and run["config"]["model"]["vocab_size"] == 257
    assert http.get(f"{API}/datasets/{ident}").json()["complete"]


def test_a_run_on_a_dataset_is_refused_when_it_cannot_use_it(http, dataset, tmp_path):
    folder, manifest = dataset
    partial = make_dataset(tmp_path / "partial", documents=120, words=50)
    partial_id = register_manifest(http, tmp_path / "partial").json()["id"]
    ident = upload_all(http, folder, manifest)

    unknown = create(http, dataset_config("ds_" + "0" * 24))
    incomplete = create(http, dataset_config(partial_id))
    vocab = create(http, dataset_config(ident, model={"vocab_size": 1000}))
    too_long = create(http, dataset_config(ident, inner={"steps": 100, "batch_size": 64}))
    with_file = create(http, dataset_config(ident), {"data": ("c.txt", b"abc", "text/plain")})

    assert unknown.status_code == 404 and "no dataset" in unknown.text
    assert incomplete.status_code == 422 and "is missing" in incomplete.text
    assert len(partial.files()) > 0
    assert vocab.status_code == 422 and "model.vocab_size: 1000 is not the dataset's" in vocab.text
    assert too_long.status_code == 422 and too_long.text.count("inner.steps") >= 1
    assert with_file.status_code == 422 and "takes no data file" in with_file.text


def join(http: httpx.Client, token: str, run_id: str) -> dict:
    r = http.post(f"{API}/runs/{run_id}/join", headers=auth(token))
    assert r.status_code == 200, r.text
    return dict(r.json())


def contribute(http: httpx.Client, token: str, lease: dict) -> httpx.Response:
    """A small, finite Δ for every tensor, as much work as the lease allows."""
    cfg = parse_config(lease["config"])
    from diloco.model.architectures import parameter_shapes

    codec = Int8Codec(cfg.compression.block_size)
    gen = torch.Generator().manual_seed(int.from_bytes(token.encode()[-6:], "little"))
    encoded = {
        n: codec.encode(torch.randn(s, generator=gen) * 1e-4)
        for n, s in parameter_shapes(cfg.model).items()
    }
    meta = ContributionMeta(
        run_id=lease["run_id"], round=lease["round"], base_version=lease["base_version"],
        tokens=cfg.lease_tokens, inner_steps=lease["inner_steps"], loss=3.0,
        codec=codec.describe(), replay=ReplayRecord(FRESH, "fp32", 1),
    )  # fmt: skip
    return http.put(
        f"{API}/runs/{lease['run_id']}/rounds/{lease['round']}/contribution",
        content=b"".join(encode_contribution(meta, encoded)),
        headers={**auth(token), "Content-Type": "application/octet-stream"},
    )


def test_no_unit_is_handed_out_twice_before_every_unit_once_and_accepted_work_is_covered(
    http, dataset
):
    folder, manifest = dataset
    ident = upload_all(http, folder, manifest)
    run = create(http, {**dataset_config(ident), "seed": 7}).json()
    run_id, n_units = run["id"], len(manifest.shards) - 1  # the last shard is too short
    assert http.get(f"{API}/runs/{run_id}/coverage").json()["units"] == n_units
    tokens = [register(http, f"cov{i}") for i in range(n_units + 3)]

    # Execute: the first three take units and give them back; the rest take one each
    given_back = []
    for t in tokens[:3]:
        lease = join(http, t, run_id)
        given_back.append(lease["data_range"]["unit"])
        released = http.delete(f"{API}/runs/{run_id}/rounds/1/lease", headers=auth(t))
        assert released.status_code in (200, 204), released.text
    first_pass = [join(http, t, run_id) for t in tokens[3:n_units]]
    second = [join(http, t, run_id) for t in tokens[n_units:]]
    accepted = [
        contribute(http, t, lease) for t, lease in zip(tokens[3:6], first_pass[:3], strict=True)
    ]

    # Assert: every unit once before any twice; the given-back units go first again
    units = given_back + [lease["data_range"]["unit"] for lease in first_pass]
    assert sorted(units) == list(range(n_units))
    assert {lease["data_range"]["unit"] for lease in second} == set(given_back)
    # in the order the simulator deals them (one definition: diloco.data.units)
    dealer = UnitDealer(n_units, 7)
    dealt = [dealer.pick() for _ in range(n_units + 3)]
    assert units + [lease["data_range"]["unit"] for lease in second] == dealt
    for lease in first_pass:
        rng, shard = lease["data_range"], lease["shard"]
        assert shard["dtype"] == "uint16" and rng["tokens"] == STEPS * BATCH * BLOCK + 1
        assert rng["start"] + rng["tokens"] <= manifest.shards[shard["index"]].tokens
        assert shard["url"].endswith(f"/shards/{shard['index']}")
    assert all(r.status_code == 201 for r in accepted), [r.text for r in accepted]
    cov = http.get(f"{API}/runs/{run_id}/coverage").json()
    assert cov["units_issued"] == n_units and cov["units_trained"] == 3
    assert cov["tokens_trained"] == 3 * STEPS * BATCH * BLOCK and cov["max_passes"] == 1
    assert cov["epochs"] == pytest.approx(cov["tokens_trained"] / manifest.train_tokens)
    data = http.get(f"{API}/runs/{run_id}").json()["data"]
    assert data["tokens_trained"] == cov["tokens_trained"] and data["token_dtype"] == "uint16"
    # a shard served for a dataset run is the dataset's file
    shard0 = http.get(f"{API}/runs/{run_id}/shards/0")
    assert shard0.content == (folder / "shard-00000.bin").read_bytes()


def test_units_of_expired_leases_wait_until_every_unit_was_handed_out_once(
    database_url, dataset, tmp_path
):
    from tests.support.live import ServerProcess, wait_for

    folder, manifest = dataset
    server = ServerProcess(data_dir=tmp_path / "srv", database_url=database_url)
    try:
        with server.wait_ready().client() as http:
            ident = upload_all(http, folder, manifest)
            leases = {"lease_ttl_s": 2, "heartbeat_interval_s": 1}
            run_id = create(http, dataset_config(ident, rounds=leases)).json()["id"]
            n_units = len(manifest.shards) - 1
            tokens = [register(http, f"exp{i}") for i in range(n_units + 2)]
            expired = [join(http, t, run_id)["data_range"]["unit"] for t in tokens[:2]]
            # their heartbeats stop: the leases expire without a contribution
            wait_for(
                lambda: all(
                    not lease["live"]
                    for lease in http.get(f"{API}/runs/{run_id}").json()["current_round"]["leases"]
                ),
                timeout=30,
                what="the two leases to expire",
            )
            rest = [join(http, t, run_id)["data_range"]["unit"] for t in tokens[2:n_units]]
            again = [join(http, t, run_id)["data_range"]["unit"] for t in tokens[n_units:]]
    finally:
        server.stop()

    assert sorted(expired + rest) == list(range(n_units))  # each once before any twice
    assert sorted(again) == sorted(expired)  # then the ones whose leases came to nothing
