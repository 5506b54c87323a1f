"""Stateless replicas on object storage, end to end with real processes: a real S3 API
server (SeaweedFS), three `diloco serve` replicas sharing only one Postgres and one bucket
(each with its own data dir), a round-robin load balancer in front of them, and three
`diloco join` volunteers that hold no storage credentials.

Replica A closes the first round and is killed mid-close (SIGKILL by the fault injector,
after the version's files are in the bucket and before its row commits); replica C,
started then, takes the lapsed claim over and finishes the round, then the run. Every
checkpoint, delta, shard and contribution byte moves between the volunteers and the
bucket: the replicas' own byte counters show none, their data dirs hold nothing but logs.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import httpx
import pytest

from tests.support.contribute import API
from tests.support.live import ServerProcess, free_port, wait_for
from tests.support.tcpproxy import Balancer
from tests.support.volunteers import Volunteers, create_run
from tests.test_e2e import write_config

COMMON = {
    "n_shards": 4,
    "claim_ttl_s": 3,  # a dead replica's claim lapses quickly
    "close_retry_base_s": 0.2,
    "close_retry_max_s": 0.5,
}
BLOB_KINDS = ("checkpoint", "delta", "shard")


def metric_sum(text: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples whose labels contain ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


@pytest.mark.slow
def test_three_replicas_on_one_bucket_close_each_round_once_with_no_blob_through_them(
    s3_server, s3_env, database_url: str, tmp_path: Path
) -> None:
    # Prepare: the bucket prefix, replicas A (closes, dies mid-close) and B (API only)
    storage = f"s3://{s3_server.bucket}/replicas-{secrets.token_hex(4)}"
    ports = [free_port() for _ in range(3)]
    balancer = Balancer([("127.0.0.1", p) for p in ports])
    replicas: dict[str, ServerProcess] = {}

    def replica(name: str, port: int, **settings: object) -> ServerProcess:
        proc = ServerProcess(
            data_dir=tmp_path / f"data-{name}",
            database_url=database_url,
            port=port,
            storage=storage,
            scratch_dir=tmp_path / f"scratch-{name}",
            **COMMON,
            **settings,
        )
        replicas[name] = proc
        return proc.wait_ready()

    volunteers = Volunteers(tmp_path / "volunteers")
    try:
        replica("a", ports[0], faults="close.write=die")
        replica("b", ports[1], role="api")
        config = write_config(
            tmp_path / "run.toml", steps=20, quorum=2, target=3, timeout_s=120, max_rounds=4
        )
        run_id = create_run(replicas["b"], config)
        lb = f"http://127.0.0.1:{balancer.port}"
        no_credentials = {
            "AWS_ACCESS_KEY_ID": "",
            "AWS_SECRET_ACCESS_KEY": "",
            "AWS_ENDPOINT_URL": "",
        }
        for name in ("v1", "v2", "v3"):
            volunteers.start(name, lb, run_id, **no_credentials)
        http = httpx.Client(base_url=replicas["b"].url, timeout=30)

        # Execute: A takes round 1's close and dies in it; C starts and finishes the run
        wait_for(lambda: not replicas["a"].alive(), timeout=400, what="replica A to die mid-close")
        assert replicas["a"].popen.returncode == -9, replicas["a"].output()[-2000:]
        first = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"][0]
        assert first["index"] == 1 and first["state"] != "closed", first
        replica("c", ports[2])
        volunteers.finish(http, run_id)

        # Assert: every round closed once, by C (A published nothing: its row never committed)
        rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
        assert [r["state"] for r in rounds] == ["closed"] * 4
        assert all(r["accepted"] >= 2 for r in rounds), [r["accepted"] for r in rounds]
        assert http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"] == 4
        metrics = {
            name: httpx.get(f"{p.url}/metrics").text for name, p in replicas.items() if name != "a"
        }
        assert metric_sum(metrics["c"], "diloco_rounds_closed_total") == 4
        assert metric_sum(metrics["b"], "diloco_rounds_closed_total") == 0

        # no blob byte through the surviving replicas, either way
        for name, text in metrics.items():
            for kind in BLOB_KINDS:
                assert metric_sum(text, "diloco_served_bytes_total", f'kind="{kind}"') == 0, name
            assert metric_sum(text, "diloco_upload_bytes_total") == 0, name
        direct = sum(metric_sum(t, "diloco_direct_upload_bytes_total") for t in metrics.values())
        assert direct > 0
        # the volunteers' connections were spread over the replicas (A and B in round 1;
        # kept alive, they stay, so C may get none of them)
        assert balancer.connections[0] > 0 and balancer.connections[1] > 0, balancer.connections

        # the bucket holds exactly the run's files; the replicas' dirs hold none of them
        s3 = s3_server.client()
        prefix = storage.removeprefix(f"s3://{s3_server.bucket}/") + f"/runs/{run_id}/"
        listed = s3.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix).get("Contents", [])
        keys = sorted(o["Key"].removeprefix(prefix) for o in listed)
        versions = [k for k in keys if k.startswith("checkpoints/")]
        assert versions == sorted(
            [f"checkpoints/{v}.safetensors" for v in range(5)]
            + [f"checkpoints/{v}.state.safetensors" for v in range(5)]
            + [f"checkpoints/{v}.delta.safetensors" for v in range(1, 5)]
        )
        contributions = [k for k in keys if k.startswith("rounds/")]
        # every accepted upload's blob, whether its round's close aggregated it or left it
        # out (the close's checks and scoring may leave honest work out: protocol.md)
        stored = [
            c
            for r in rounds
            for c in http.get(f"{API}/runs/{run_id}/rounds/{r['index']}/contributions").json()[
                "contributions"
            ]
            if c["merged_into_round"] == r["index"]
        ]
        assert len(contributions) == len(stored), [c["excluded"] for c in stored]
        assert sum(r["accepted"] for r in rounds) == len([c for c in stored if not c["excluded"]])
        assert not [k for k in keys if k.startswith("incoming/")], "every upload was committed"
        assert not s3.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=prefix).get("Uploads")
        for name, proc in replicas.items():
            files = [p for p in proc.data_dir.rglob("*") if p.is_file()]
            assert all(p.suffix == ".log" for p in files), (name, files)
        # no stage is left; what remains is the cache of published versions (params, state)
        # and of the uploads and data its folds, scores, closes and evals fetched, never a delta
        assert not list((tmp_path / "scratch-c").glob("diloco-stage-*"))
        kept = [p.name for p in (tmp_path / "scratch-c" / "diloco-cache").iterdir()]
        assert any("__checkpoints__" in n for n in kept), kept
        assert all(".delta." not in n for n in kept), kept
        kinds = ("__checkpoints__", "__rounds__", "__data__")
        assert all(any(k in n for k in kinds) for n in kept), kept
    finally:
        volunteers.stop_all()
        for proc in replicas.values():
            proc.stop()
        balancer.cut()
