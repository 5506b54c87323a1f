"""Issue 25's acceptance run: a real ``diloco serve``, two real ``diloco join`` processes and
``[compression] kind = "sparse"`` with every other compression setting its default, on a
model of about 0.4M parameters. Every stored upload weighs under 0.04 byte a parameter,
headers included; a returning volunteer downloads the round's compressed delta (sparse, 512
of each 4096 values: the download codec sparse uploads imply), under 0.3 byte a parameter,
counted by the server's own ``diloco_served_bytes_total``; every published version is
exactly the close an in-process reference computes from the stored uploads; and the eval
loss falls round over round."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diloco.config import parse_config
from diloco.wire import delta as deltas
from tests.support.contribute import API, assert_reference_closes
from tests.support.corpora import TINYSHAKESPEARE
from tests.support.pg import rows
from tests.support.volunteers import evaluated_rounds, live_run

ROUNDS = 4


def write_config(path: Path) -> Path:
    path.write_text(
        f"""name = "sparse-acceptance"
seed = 7
[model]
n_layer = 2
n_head = 4
n_embd = 128
block_size = 128
[data]
path = "{TINYSHAKESPEARE}"
chunk_size = 4096
[inner]
steps = 12
batch_size = 4
lr = 3e-3
warmup_steps = 4
[rounds]
quorum = 2
target = 2
timeout_s = 300
max_rounds = {ROUNDS}
heartbeat_interval_s = 1
[compression]
kind = "sparse"
"""
    )
    return path


def served(text: str, kind: str) -> float:
    found = re.search(rf'^diloco_served_bytes_total\{{kind="{kind}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
def test_a_sparse_run_with_two_volunteers_sends_little_and_closes_exactly(
    database_url: str, tmp_path: Path
) -> None:
    # Prepare: a server, a run created with the CLI, two volunteers
    with live_run(database_url, tmp_path, write_config(tmp_path / "run.toml")) as live:
        server, run_id, http = live.server, live.run_id, live.http
        for name in ("v1", "v2"):
            live.volunteers.start(name, server, run_id)

        # Execute: the run to its end
        live.volunteers.finish(http, run_id)
        metrics = http.get("/metrics").text
        run = http.get(f"{API}/runs/{run_id}").json()
        rounds = evaluated_rounds(http, run_id)

    # Assert: the run recorded the download codec its upload kind implies
    cfg = parse_config(run["config"])
    n = run["n_params"]
    assert 350_000 < n < 500_000, n
    recorded = run["config"]["compression"]
    assert (recorded["download"], recorded["download_topk"]) == ("sparse", 512)
    assert [r["state"] for r in rounds] == ["closed"] * ROUNDS
    blobs = server.data_dir / "blobs"
    uploads = rows(
        database_url,
        "SELECT round_index, blob_key, weight, staleness, standing, norm FROM contributions "
        "WHERE run_id = $1 AND aggregated_at IS NOT NULL ORDER BY created_at, id",
        run_id,
    )
    assert sorted(u["round_index"] for u in uploads) == sorted(list(range(1, ROUNDS + 1)) * 2)

    # every stored upload: under 0.04 byte a parameter, headers included
    sizes = [(blobs / u["blob_key"]).stat().st_size for u in uploads]
    assert max(sizes) <= 0.04 * n, [s / n for s in sizes]

    # downloads: each volunteer fetched the fp32 checkpoint once (its first round), then
    # one delta a round, each under 0.3 byte a parameter, headers and scales included
    checkpoint_bytes = (blobs / "runs" / run_id / "checkpoints" / "0.safetensors").stat().st_size
    assert served(metrics, "checkpoint") == 2 * checkpoint_bytes
    delta_files = [
        blobs / "runs" / run_id / "checkpoints" / f"{v}.delta.safetensors"
        for v in range(1, ROUNDS + 1)
    ]
    assert max(p.stat().st_size for p in delta_files) <= 0.3 * n
    returning = 2 * (ROUNDS - 1)  # rounds 2.. of both volunteers
    assert sum(p.stat().st_size for p in delta_files[:-1]) * 2 == served(metrics, "delta")
    assert served(metrics, "delta") / returning <= 0.3 * n

    # every version is the reference close of its round's stored uploads, bit for bit, and
    # its delta reads back
    assert assert_reference_closes(database_url, blobs, run_id, cfg) == ROUNDS
    shapes = {
        k: tuple(t.shape) for k, t in load_file(delta_files[0].parent / "0.safetensors").items()
    }
    for path in delta_files:
        assert deltas.read_delta(path, shapes)

    # the eval loss falls round over round (from version 0's, when it was measured)
    losses = [
        r["eval_loss"]
        for r in rows(
            database_url,
            "SELECT eval_loss FROM checkpoints WHERE run_id = $1 ORDER BY version",
            run_id,
        )
        if r["eval_loss"] is not None
    ]
    assert len(losses) >= ROUNDS
    assert all(a > b for a, b in itertools.pairwise(losses)), losses
