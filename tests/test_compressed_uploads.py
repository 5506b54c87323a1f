"""A run whose ``[compression]`` is one of the packed codecs (issue 25), on a real server:
uploads stored at their size, checked as they stream, and closed into exactly the step an
in-process reference computes from the same uploads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as safetensors_load

from diloco.config import parse_config
from diloco.model.architectures import build_model
from tests.conftest import server_run_config
from tests.support.contribute import API, create_run, reference_step, register, train, upload
from tests.support.live import wait_for


@pytest.mark.parametrize(
    "compression",
    [{"kind": "sparse", "chunk": 256, "topk": 8}, {"kind": "int2"}, {"kind": "int4"}],
    ids=["sparse", "int2", "int4"],
)
def test_two_volunteers_packed_uploads_close_into_the_reference_step(http, compression):
    run = create_run(http, server_run_config(rounds={"quorum": 2}, compression=compression))
    cfg = parse_config(run["config"])
    n_params = sum(p.numel() for p in build_model(cfg.model).parameters())
    a, b = register(http, "a"), register(http, "b")
    work_a, work_b = train(http, a, run["id"]), train(http, b, run["id"])
    base = safetensors_load(http.get(work_a.lease["checkpoint"]["url"]).content)

    for token, work in ((a, work_a), (b, work_b)):
        r = upload(http, token, work)
        assert r.status_code == 201, r.text
    wait_for(
        lambda: http.get(f"{API}/runs/{run['id']}").json()["checkpoint_version"] == 1,
        timeout=60,
        what="round 1 to close",
    )

    published = safetensors_load(http.get(f"{API}/runs/{run['id']}/checkpoints/1").content)
    expected = reference_step(run, base, [work_a, work_b]).params
    assert all(torch.equal(published[n], expected[n]) for n in expected)
    sizes = [len(work.body()) for work in (work_a, work_b)]
    per_param = max(sizes) / n_params
    limit = {"sparse": 0.2, "int2": 0.35, "int4": 0.6}[compression["kind"]]  # a tiny model
    assert per_param < limit, (sizes, n_params)


def test_a_malformed_packed_upload_is_refused_with_a_4xx_and_leaves_no_trace(http):
    compression = {"kind": "sparse", "chunk": 256, "topk": 8}
    run = create_run(http, server_run_config(rounds={"quorum": 1}, compression=compression))
    token = register(http, "c")
    work = train(http, token, run["id"])
    name = "wte.weight"  # 2,048 values: 8 chunks of 256
    data = work.encoded[name].data.clone()
    data[0] = 0xFF  # the first record's first index is now 255: no later index can follow
    work.encoded[name] = type(work.encoded[name])(
        work.encoded[name].shape, data, work.encoded[name].scales
    )

    r = upload(http, token, work)

    assert r.status_code == 400, r.text
    assert r.json()["error"] == "malformed_upload", r.json()
    assert f"tensor {name!r}: sparse codec: indices do not increase" in r.json()["detail"]
    assert http.get(f"{API}/runs/{run['id']}").json()["current_round"]["accepted"] == 0
