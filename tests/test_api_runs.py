"""The REST API against a real `diloco serve` process on a fresh, Alembic-migrated Postgres:
runs, contributors, auth, leases, checkpoint and shard downloads, health and metrics."""

from __future__ import annotations

import hashlib
import json
import threading
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load as safetensors_load

from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import API, auth, register
from tests.support.live import ServerProcess, admin_headers, wait_for


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(make_corpus(120_000))
    return path


def create_run(http: httpx.Client, data_file: Path, config: dict | None = None) -> httpx.Response:
    return http.post(
        f"{API}/runs",
        data={"config": json.dumps(config or server_run_config())},
        files={"data": ("corpus.txt", data_file.read_bytes(), "text/plain")},
        headers=admin_headers(),
    )


def test_created_run_has_checkpoint_zero_and_an_open_first_round(http, data_file):
    r = create_run(http, data_file)

    assert r.status_code == 201, r.text
    run = r.json()
    assert run["id"].startswith("run_") and run["status"] == "active"
    assert run["checkpoint_version"] == 0
    assert run["current_round"]["index"] == 1 and run["current_round"]["state"] == "open"
    assert run["current_round"]["quorum"] == 1
    assert run["data"]["n_shards"] >= 1 and run["data"]["val_tokens"] > 0
    assert run["config"]["data"]["path"] == "corpus.txt"
    assert http.get(f"{API}/runs/{run['id']}").json()["id"] == run["id"]
    assert run["id"] in [x["id"] for x in http.get(f"{API}/runs").json()["runs"]]


def test_the_server_answers_others_while_it_creates_a_run_from_a_large_data_file(
    server: ServerProcess, http: httpx.Client, tmp_path: Path
) -> None:
    # Prepare: 48 MiB of text, whose copy, split and store the creation does
    big = tmp_path / "big.txt"
    big.write_text(make_corpus(1 << 20, seed=3) * 48)
    spool = server.data_dir / "tmp"
    before = set(spool.glob("*.txt")) if spool.exists() else set()
    order: list[str] = []

    def create() -> None:
        with server.client(timeout=300) as own:
            r = create_run(own, big)
        order.append(f"create {r.status_code}")

    creating = threading.Thread(target=create)
    creating.start()

    # Execute: once the server works on the file (its copy of the data exists), ask it
    # for its health and for the run list, each on a connection of its own
    wait_for(
        lambda: set(spool.glob("*.txt")) - before or not creating.is_alive(),
        timeout=120,
        what="the server's copy of the data file",
        every=0.01,
    )
    for path in ("/healthz", f"{API}/runs"):
        with server.client() as other:
            order.append(f"{path} {other.get(path).status_code}")
    creating.join(timeout=300)

    # Assert: both were answered while the run was being created, which then succeeded
    assert order == ["/healthz 200", f"{API}/runs 200", "create 201"]


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("inner", {"stepz": 3}, "inner.stepz: unknown key"),
        ("inner", {"lr": -1}, "inner.lr"),
        ("rounds", {"quorum": 3, "target": 2}, "rounds.target"),
        ("model", {"n_embd": 30, "n_head": 4}, "model.n_head"),
        ("compression", {"kind": "fp8"}, "compression.kind"),
    ],
)
def test_bad_run_config_is_422_naming_the_key(http, data_file, section, values, key):
    before = len(http.get(f"{API}/runs").json()["runs"])

    r = create_run(http, data_file, server_run_config(**{section: values}))

    assert r.status_code == 422, r.text
    assert r.json()["error"] == "invalid_config"
    assert key in r.json()["detail"]
    assert len(http.get(f"{API}/runs").json()["runs"]) == before


def test_unknown_top_level_key_and_non_json_config_are_422(http, data_file):
    r = create_run(http, data_file, {**server_run_config(), "colour": "blue"})
    assert r.status_code == 422 and "colour: unknown key" in r.json()["detail"]

    r = http.post(
        f"{API}/runs",
        data={"config": "{not json"},
        files={"data": ("c.txt", b"abc", "text/plain")},
        headers=admin_headers(),
    )
    assert r.status_code == 422 and r.json()["error"] == "invalid_config"


def test_data_too_small_for_the_model_is_422_invalid_data(http, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("tiny corpus")

    r = create_run(http, small)

    assert r.status_code == 422 and r.json()["error"] == "invalid_data"


def test_run_management_needs_the_admin_token(http, data_file):
    token = register(http, "not-admin")
    body = {"config": json.dumps(server_run_config())}
    files = {"data": ("corpus.txt", data_file.read_bytes(), "text/plain")}

    missing = http.post(f"{API}/runs", data=body, files=files)
    wrong = http.post(f"{API}/runs", data=body, files=files, headers=auth("adm_wrong"))
    contributor = http.post(f"{API}/runs", data=body, files=files, headers=auth(token))

    assert (missing.status_code, missing.json()["error"]) == (401, "unauthorized")
    assert (wrong.status_code, wrong.json()["error"]) == (401, "unauthorized")
    assert (contributor.status_code, contributor.json()["error"]) == (403, "forbidden")


def test_pause_resume_cancel_follow_the_state_machine(http, data_file):
    run_id = create_run(http, data_file).json()["id"]
    token = register(http, "pauser")

    def act(action: str) -> httpx.Response:
        return http.post(f"{API}/runs/{run_id}/{action}", headers=admin_headers())

    assert act("pause").json()["status"] == "paused"
    refused = http.post(f"{API}/runs/{run_id}/join", headers=auth(token))
    assert refused.status_code == 409 and refused.json() | {"detail": ""} == {
        "error": "run_not_active",
        "detail": "",
        "status": "paused",
    }
    assert act("pause").json()["error"] == "invalid_transition"
    assert act("resume").json()["status"] == "active"
    assert act("cancel").json()["status"] == "cancelled"
    again = act("resume")
    assert again.status_code == 409 and "cancelled" in again.json()["detail"]
    assert http.post(f"{API}/runs/run_nope/pause", headers=admin_headers()).status_code == 404


def test_contributor_token_is_shown_once_and_identifies_its_owner(http):
    r = http.post(f"{API}/contributors", json={"name": "alice"})

    assert r.status_code == 201
    me = http.get(f"{API}/contributors/me", headers=auth(r.json()["token"]))
    assert me.json()["id"] == r.json()["id"] and me.json()["name"] == "alice"
    board = http.get(f"{API}/contributors").json()["contributors"]
    assert r.json()["token"] not in json.dumps(board)
    assert all(
        set(entry)
        == {"rank", "id", "name", "accepted", "aggregated", "tokens", "credit", "pending_credit",
            "last_seen_at", "created_at", "device"}
        for entry in board
    )  # fmt: skip
    bad = http.get(f"{API}/contributors/me", headers=auth("ctr_forged"))
    assert bad.status_code == 401 and bad.json()["error"] == "unauthorized"
    assert http.get(f"{API}/contributors/me").status_code == 401


@pytest.mark.parametrize("name", ["", " leading-space", "x" * 65, "tab\tname"])
def test_bad_contributor_names_are_422(http, name):
    r = http.post(f"{API}/contributors", json={"name": name})

    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    assert "name" in r.json()["detail"]


def test_a_runs_heartbeats_lease_ttl_and_eval_are_its_configs_recorded_and_shown(http, data_file):
    # Prepare: a config that asks for other heartbeats, leases, extensions and eval windows
    rounds = {"heartbeat_interval_s": 3, "lease_ttl_s": 7, "max_extensions": 2}
    config = server_run_config(rounds=rounds)
    config["eval"] = {"windows": 16}

    # Execute
    run = create_run(http, data_file, config).json()
    token = register(http, "paced")
    lease = http.post(f"{API}/runs/{run['id']}/join", headers=auth(token)).json()

    # Assert: recorded with the run, shown by GET /runs/{id}, and what its leases say
    shown = http.get(f"{API}/runs/{run['id']}").json()["config"]
    assert {k: shown["rounds"][k] for k in rounds} == rounds
    assert shown["eval"] == {"windows": 16}
    assert lease["heartbeat_interval_s"] == 3
    issued = datetime.fromisoformat(lease["deadline"]) - timedelta(seconds=lease["deadline_in_s"])
    ttl = datetime.fromisoformat(lease["lease_expires_at"]) - issued
    assert ttl.total_seconds() == pytest.approx(7, abs=0.01)


def test_a_config_past_the_hubs_limits_is_422_naming_the_key_and_the_limit(http, data_file):
    config = server_run_config()
    config["eval"] = {"windows": 100_000}  # the hub scores at most 1024 (its default)

    r = create_run(http, data_file, config)

    assert (r.status_code, r.json()["error"]) == (422, "invalid_config")
    assert "eval.windows" in r.json()["detail"] and "DILOCO_MAX_EVAL_WINDOWS" in r.json()["detail"]


def test_join_hands_out_a_lease_and_renews_it_on_a_second_join(http, data_file):
    run = create_run(http, data_file).json()
    token = register(http, "joiner")

    first = http.post(f"{API}/runs/{run['id']}/join", headers=auth(token)).json()
    second = http.post(f"{API}/runs/{run['id']}/join", headers=auth(token)).json()

    assert first["lease_id"] == second["lease_id"]
    assert second["lease_expires_at"] >= first["lease_expires_at"]
    assert (first["round"], first["base_version"], first["start_step"]) == (1, 0, 0)
    assert first["inner_steps"] == 3
    assert first["checkpoint"]["url"].endswith("/checkpoints/0")
    # max upload: exact int8 frames (1 byte per value + fp32 scales) plus header room
    assert run["n_params"] < first["max_upload_bytes"] < 2 * run["n_params"] + 100_000
    beat = http.post(
        f"{API}/runs/{run['id']}/rounds/1/heartbeat",
        json={"lease_id": first["lease_id"], "step": 1, "loss": 5.0},
        headers=auth(token),
    )
    assert beat.status_code == 200 and beat.json()["round_state"] == "open"
    stranger = http.post(
        f"{API}/runs/{run['id']}/rounds/1/heartbeat",
        json={"lease_id": first["lease_id"]},
        headers=auth(register(http, "stranger")),
    )
    assert stranger.status_code == 409 and stranger.json()["error"] == "no_lease"


def test_checkpoint_download_has_etag_range_and_conditional_get(http, data_file):
    run = create_run(http, data_file).json()
    token = register(http, "downloader")
    lease = http.post(f"{API}/runs/{run['id']}/join", headers=auth(token)).json()
    url = lease["checkpoint"]["url"]

    full = http.get(url)
    part = http.get(url, headers={"Range": "bytes=10-29"})
    tail = http.get(url, headers={"Range": "bytes=-5"})
    cached = http.get(url, headers={"If-None-Match": full.headers["etag"]})
    outside = http.get(url, headers={"Range": f"bytes={len(full.content) + 5}-"})

    assert full.status_code == 200
    sha = hashlib.sha256(full.content).hexdigest()
    assert full.headers["etag"] == f'"{sha}"' and sha == lease["checkpoint"]["sha256"]
    assert full.headers["x-checkpoint-version"] == "0"
    params = safetensors_load(full.content)
    assert sum(t.numel() for t in params.values()) == run["n_params"]
    assert (part.status_code, part.content) == (206, full.content[10:30])
    assert part.headers["content-range"] == f"bytes 10-29/{len(full.content)}"
    assert tail.content == full.content[-5:]
    assert cached.status_code == 304
    assert outside.status_code == 416 and outside.json()["error"] == "range_not_satisfiable"
    assert http.get(f"{API}/runs/{run['id']}/checkpoints/latest").content == full.content
    assert http.get(f"{API}/runs/{run['id']}/checkpoints/7").status_code == 404
    assert http.get(f"{API}/runs/{run['id']}/checkpoints/x").status_code == 422


def test_shard_download_matches_the_lease(http, data_file):
    run = create_run(http, data_file).json()
    lease = http.post(f"{API}/runs/{run['id']}/join", headers=auth(register(http, "s"))).json()

    r = http.get(lease["shard"]["url"])

    assert r.status_code == 200
    assert hashlib.sha256(r.content).hexdigest() == lease["shard"]["sha256"]
    assert len(r.content) == lease["shard"]["nbytes"]
    assert len(r.content) % lease["shard"]["chunk_len"] == 0
    assert http.get(f"{API}/runs/{run['id']}/shards/999").status_code == 404


def test_healthz_metrics_docs_and_unknown_paths(http):
    assert http.get("/healthz").json()["status"] == "ok"
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and "diloco_uploads_total" in metrics.text
    assert http.get("/openapi.json").json()["info"]["title"] == "DiLoCo Hub"
    missing = http.get("/api/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"
    assert "DiLoCo Hub" in http.get("/").text
