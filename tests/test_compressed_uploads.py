"""A run whose ``[compression]`` is one of the packed codecs (issue 25), on a real server:
uploads stored at their size, checked as they stream, and closed into exactly the step an
in-process reference computes from the same uploads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as safetensors_load

from diloco.config import parse_config
from diloco.model.architectures import build_model
from diloco.wire.codec import EncodedTensor
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


def _set_byte(e: EncodedTensor) -> EncodedTensor:
    data = e.data.clone()
    data[:2] = 0xFF  # the first codes (int4, int2) or the first record's first field (sparse)
    return EncodedTensor(e.shape, data, e.scales)


def _with_scale(value: float):  # type: ignore[no-untyped-def]
    def mutate(e: EncodedTensor) -> EncodedTensor:
        scales = e.scales.clone()
        scales[0] = value
        return EncodedTensor(e.shape, e.data, scales)

    return mutate


SPARSE = {"kind": "sparse", "chunk": 256, "topk": 8}


@pytest.mark.parametrize(
    ("compression", "mutate", "code", "message"),
    [
        # the first record's first index becomes 255: no later index can follow it
        (SPARSE, _set_byte, "malformed_upload", "sparse codec: indices do not increase"),
        # chunks of 200 count indices in 8 bits: 255 is past every chunk
        ({**SPARSE, "chunk": 200}, _set_byte, "malformed_upload",
         "sparse codec: an index is past its chunk of 200"),
        ({"kind": "int4"}, _set_byte, "malformed_upload", "int4 codec: a code is out of range"),
        ({"kind": "int2"}, _set_byte, "malformed_upload", "int2 codec: a code is out of range"),
        (SPARSE, _with_scale(float("nan")), "non_finite", "non-finite value(s)"),
        (SPARSE, _with_scale(-1.0), "malformed_upload", "negative scales"),
        (SPARSE, _with_scale(1e9), "malformed_upload", "not finite in [0, 10000"),
        ({"kind": "int2"}, _with_scale(float("inf")), "non_finite", "non-finite value(s)"),
        (SPARSE, "truncate", "malformed_upload", "body is truncated"),
    ],
    ids=[
        "unsorted indices", "index out of range", "int4 code out of range",
        "int2 code out of range", "NaN scale", "negative scale", "huge scale",
        "infinite int2 scale", "a body cut short",
    ],
)  # fmt: skip
def test_a_malformed_packed_upload_is_refused_with_a_4xx_and_leaves_no_trace(
    http, compression, mutate, code, message
):
    run = create_run(http, server_run_config(rounds={"quorum": 1}, compression=compression))
    token = register(http, "c")
    work = train(http, token, run["id"])
    name = "wte.weight"  # 2,048 values
    body = None
    if mutate == "truncate":
        body = work.body()[:-100]
    else:
        work.encoded[name] = mutate(work.encoded[name])

    r = upload(http, token, work, body)

    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"] == code, r.json()
    assert message in r.json()["detail"], r.json()
    if mutate != "truncate":
        assert f"tensor {name!r}" in r.json()["detail"]
    assert http.get(f"{API}/runs/{run['id']}").json()["current_round"]["accepted"] == 0
    listed = http.get(f"{API}/runs/{run['id']}/rounds/1/contributions").json()
    assert listed["contributions"] == [], listed
