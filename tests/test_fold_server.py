"""Uploads folded into their round's sum as they arrive (server.rounds.folding), through a
real server: the round worker folds the uploads of an open round before its close, the close
adds only the last one, and the version it publishes is, bit for bit, the reference close of
the stored uploads; with folding failing, the close reads every upload and publishes the
same bits."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest
from safetensors.torch import load_file

from diloco.config import parse_config
from tests.conftest import server_run_config
from tests.support.contribute import (
    API,
    create_run,
    read_outer_state,
    reference_close,
    register,
    train,
    upload,
)
from tests.support.live import ServerProcess, wait_for
from tests.test_compressed_run import rows

VOLUNTEERS = ("a", "b", "c")


def metric(http: httpx.Client, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", http.get("/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def run_two_rounds(
    server: ServerProcess, folded: Callable[[httpx.Client], bool]
) -> tuple[httpx.Client, str, dict]:
    """Round 1 (nothing to clip against yet: not folded), then round 2 (folded): its last
    upload sent once ``folded`` says the round worker dealt with the first two."""
    http = server.client()
    config = server_run_config(rounds={"quorum": 3, "target": 3, "max_rounds": 2})
    run_id = create_run(http, config)["id"]
    tokens = {name: register(http, name) for name in VOLUNTEERS}
    for index in (1, 2):
        works = {name: train(http, tokens[name], run_id) for name in VOLUNTEERS}
        for name in VOLUNTEERS[:2]:
            assert upload(http, tokens[name], works[name]).status_code == 201
        if index == 2:
            wait_for(lambda: folded(http), timeout=60, what="round 2's first uploads folded")
        assert upload(http, tokens["c"], works["c"]).status_code == 201
        wait_for(
            lambda i=index: http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"] == i,
            timeout=120,
            what=f"round {index} to close",
        )
    return http, run_id, http.get(f"{API}/runs/{run_id}").json()


def assert_reference(server: ServerProcess, database_url: str, run_id: str, run: dict) -> None:
    """Every version is the reference close of its round's stored uploads (weighed as the
    server counts them, clipped against the history round 2 had), bit for bit."""
    from diloco.protocol.reputation import counted_weight

    cfg = parse_config(run["config"])
    blobs = server.data_dir / "blobs"
    folder = blobs / "runs" / run_id / "checkpoints"
    uploads = rows(
        database_url,
        "SELECT round_index, blob_key, weight, staleness, standing, norm FROM contributions "
        "WHERE run_id = $1 AND aggregated_at IS NOT NULL ORDER BY created_at, id",
        run_id,
    )
    history: list[float] = []
    for v in (1, 2):
        base = load_file(folder / f"{v - 1}.safetensors")
        state = read_outer_state(folder / f"{v - 1}.state.safetensors") if v > 1 else None
        mine = [u for u in uploads if u["round_index"] == v]
        bodies = [
            (
                (blobs / u["blob_key"]).read_bytes(),
                float(counted_weight(u["weight"], u["staleness"], u["standing"] or 1.0)),
            )
            for u in mine
        ]
        want = reference_close(cfg, base, bodies, round=v, state=state, history=history)
        published = load_file(folder / f"{v}.safetensors")
        assert published.keys() == want.params.keys()
        for k, t in want.params.items():
            assert t.equal(published[k]), (v, k)
        history += [u["norm"] for u in mine]


@pytest.mark.slow
@pytest.mark.parametrize("faults", ["", "fold.arrival=fail*100"], ids=["folded", "folds fail"])
def test_a_folded_round_publishes_the_reference_close(database_url, tmp_path, faults):
    server = ServerProcess(data_dir=tmp_path / "srv", database_url=database_url, faults=faults)
    try:
        server.wait_ready()
        if faults:  # every fold fails: the close reads all three uploads again
            http, run_id, run = run_two_rounds(server, lambda _: "fold.arrival" in server.output())
            assert metric(http, "diloco_close_folded_uploads_total") == 0
        else:
            http, run_id, run = run_two_rounds(
                server, lambda h: metric(h, "diloco_fold_seconds_count") >= 2
            )
            # round 2's first two uploads (at least) were summed on arrival
            assert metric(http, "diloco_close_folded_uploads_total") >= 2
        assert_reference(server, database_url, run_id, run)
    finally:
        server.stop()
