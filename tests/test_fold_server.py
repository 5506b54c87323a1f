"""Uploads folded into their round's sum as they arrive (server.rounds.folding), through a
real server: the round worker folds the uploads of an open round before its close, the close
adds only the last one, and the version it publishes is, bit for bit, the reference close of
the stored uploads; with folding failing, the close reads every upload and publishes the
same bits."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from diloco.config import parse_config
from tests.conftest import server_run_config
from tests.support.contribute import (
    API,
    assert_reference_closes,
    create_run,
    register,
    train,
    upload,
)
from tests.support.live import ServerProcess, wait_for

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
                server, lambda h: metric(h, "diloco_folded_uploads_total") >= 2
            )
            # round 2's first two uploads (at least) were summed on arrival
            assert metric(http, "diloco_close_folded_uploads_total") >= 2
        cfg = parse_config(run["config"])
        assert assert_reference_closes(database_url, server.data_dir / "blobs", run_id, cfg) == 2
        if not faults:  # the folds ran in a child, which does not outlive a killed server
            children = _children(server.pid)
            assert children, "no fold process"
            server.stop(sig=signal.SIGKILL)
            wait_for(
                lambda: not any(Path(f"/proc/{c}").exists() for c in children),
                timeout=30,
                what="the fold process to exit after its server was killed",
            )
    finally:
        server.stop()


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started that still run."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found += [int(c) for c in (task / "children").read_text().split()]
    return found
