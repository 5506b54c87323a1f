"""A version is published as soon as its files are written; its eval loss is measured
afterwards, off the round's critical path, and filled in on the checkpoint and the round.

The eval is held back by a fault armed on it (``eval.version``), so that the pending state
is there to see for as long as the test needs, whatever the machine's speed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as safetensors_load

from diloco.config import parse_config
from diloco.model.gpt import GPT
from diloco.train import evaluate, load_parameters
from server.storage import keys
from tests.conftest import server_run_config
from tests.support.contribute import API, create_run, register, train, upload
from tests.support.live import ServerProcess, wait_for

EVAL_WINDOWS = 8


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    # version 0's eval (the first hit) passes; version 1's fails ten times, 0.3 s apart
    proc = ServerProcess(
        data_dir=tmp_path / "srv",
        database_url=database_url,
        faults="eval.version=fail@2*10",
        close_retry_base_s=0.3,
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_a_version_is_published_with_its_eval_pending_and_the_eval_fills_it_in(server):
    # Prepare: a run whose round 1 closes on one upload
    http = server.client()
    config = server_run_config(rounds={"quorum": 1, "max_rounds": 3})
    config["eval"] = {"windows": EVAL_WINDOWS}  # the run's, recorded with it
    run = create_run(http, config)
    assert run["config"]["eval"] == {"windows": EVAL_WINDOWS}
    token = register(http, "only")
    assert upload(http, token, train(http, token, run["id"], steps=2)).status_code == 201

    # Execute: the round closes and version 1 is published
    wait_for(
        lambda: http.get(f"{API}/runs/{run['id']}").json()["checkpoint_version"] == 1,
        timeout=60,
        what="version 1 to be published",
    )

    # Assert: published and downloadable, round 2 open, the eval loss pending
    rounds = http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"]
    assert [(r["index"], r["state"], r["eval_loss"]) for r in rounds] == [
        (1, "closed", None),
        (2, "open", None),
    ]
    published = http.get(f"{API}/runs/{run['id']}/checkpoints/1")
    assert published.status_code == 200
    # the close's log line says so, rather than "eval loss nan"
    closed_line = next(
        line for line in server.output().splitlines() if f"{run['id']} round 1 closed (" in line
    )
    assert "eval pending" in closed_line and "nan" not in closed_line.split("update norm")[0]

    # ... then filled in, once the eval gets through
    def evaluated() -> dict | None:
        first = http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"][0]
        return first if first["eval_loss"] is not None else None

    round1 = wait_for(evaluated, timeout=60, what="round 1's eval loss")
    assert "eval failed (InjectedFault" in server.output()
    # the figure is the published parameters' loss on the run's validation windows,
    # computed here with the library's own model and eval
    cfg = parse_config(run["config"])
    model = GPT(cfg.model.gpt_config())
    load_parameters(model, safetensors_load(published.content))
    val_path = server.data_dir / "blobs" / keys.val(run["id"])
    val = torch.from_numpy(np.fromfile(val_path, dtype=np.uint8))
    expected = evaluate(model, val, block_size=cfg.model.block_size, max_windows=EVAL_WINDOWS)
    assert round1["eval_loss"] == pytest.approx(expected, rel=1e-6)
    latest = http.get(f"{API}/runs/{run['id']}").json()["latest"]
    assert latest["round"] == 1 and latest["eval_loss"] == round1["eval_loss"]
