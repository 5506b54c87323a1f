"""Bad uploads against a real server: each gets its documented 4xx and leaves no trace —
no contribution row (the round's accepted count and the leaderboard stay put) and no
blob left in storage. Plus the good paths: 201, identical retry 200, durable blob."""

from __future__ import annotations

import dataclasses
import json
import math

import httpx
import pytest
import torch

from diloco.wire.codec import EncodedTensor
from diloco.wire.contribution import MAGIC
from server.storage import keys
from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import API, Work, auth, register, train, upload
from tests.support.live import ServerProcess, admin_headers, wait_for


@pytest.fixture(scope="module")
def data_bytes() -> bytes:
    return make_corpus(120_000).encode()


def new_run(http: httpx.Client, data: bytes, **rounds: object) -> str:
    config = server_run_config(rounds={"quorum": 5, "timeout_s": 600, **rounds})
    r = http.post(
        f"{API}/runs",
        data={"config": json.dumps(config)},
        files={"data": ("corpus.txt", data, "text/plain")},
        headers=admin_headers(),
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


@dataclasses.dataclass
class Volunteer:
    token: str
    work: Work


@pytest.fixture
def run_id(http: httpx.Client, data_bytes: bytes) -> str:
    return new_run(http, data_bytes)


@pytest.fixture
def volunteer(http: httpx.Client, run_id: str) -> Volunteer:
    token = register(http, "uploader")
    return Volunteer(token, train(http, token, run_id, steps=1))


def traces(server: ServerProcess, http: httpx.Client, run_id: str) -> tuple[int, list[str]]:
    """What an upload may leave: the round's accepted count and blob files on disk."""
    rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
    blob_dir = server.log_path.parent / "blobs" / keys.rounds(run_id)
    files = sorted(p.name for p in blob_dir.rglob("*") if p.is_file()) if blob_dir.exists() else []
    return rounds[0]["accepted"], files


def with_tensor(work: Work, name: str, enc: EncodedTensor, new_name: str | None = None) -> Work:
    encoded = {(new_name if k == name and new_name else k): v for k, v in work.encoded.items()}
    encoded[new_name or name] = enc
    return Work(work.lease, work.meta, encoded)


def first(work: Work) -> tuple[str, EncodedTensor]:
    return next(iter(work.encoded.items()))


def malformed_header(work: Work) -> bytes:
    garbage = b"\xc1\xc1 not msgpack"
    return MAGIC + len(garbage).to_bytes(4, "little") + garbage + b"\0" * 64


def wrong_shape(work: Work) -> bytes:
    name, enc = first(work)
    flat = torch.zeros(enc.numel + 1)
    from diloco.wire.codec import make_codec

    codec = make_codec("int8", 256)
    return with_tensor(work, name, codec.encode(flat)).body()


def wrong_name(work: Work) -> bytes:
    name, enc = first(work)
    return with_tensor(work, name, enc, new_name="transformer.extra.weight").body()


def non_finite(value: float):  # type: ignore[no-untyped-def]
    def body(work: Work) -> bytes:
        name, enc = first(work)
        scales = enc.scales.clone()
        scales[0] = value
        return with_tensor(work, name, dataclasses.replace(enc, scales=scales)).body()

    return body


def truncated(work: Work) -> bytes:
    return work.body()[:-100]


def corrupted(work: Work) -> bytes:
    """The body with its last byte changed: its trailer no longer its SHA-256."""
    body = bytearray(work.body())
    body[-1] ^= 1
    return bytes(body)


def header_for_other_run(work: Work) -> bytes:
    return work.body(run_id="run_000000000000")


def fp32_codec(work: Work) -> bytes:
    from diloco.wire.codec import make_codec

    codec = make_codec("none", 256)
    encoded = {n: codec.encode(torch.zeros(e.shape)) for n, e in work.encoded.items()}
    return Work(work.lease, dataclasses.replace(work.meta, codec=codec.describe()), encoded).body()


@pytest.mark.parametrize(
    ("make_body", "status", "error"),
    [
        (malformed_header, 400, "malformed_upload"),
        (truncated, 400, "malformed_upload"),
        (corrupted, 400, "malformed_upload"),  # checksum mismatch, seen once all is hashed
        (wrong_shape, 400, "wrong_tensors"),
        (wrong_name, 400, "wrong_tensors"),
        (non_finite(math.nan), 400, "non_finite"),
        (non_finite(math.inf), 400, "non_finite"),
        # finite values (127 x 1e20) whose squares overflow float32: no finite step takes it
        (non_finite(1e20), 400, "non_finite"),
        (header_for_other_run, 400, "header_mismatch"),
        (fp32_codec, 413, "upload_too_large"),  # 4 bytes a value: over the int8 round's limit
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_bad_body_is_rejected_and_leaves_no_trace(
    server, http, run_id, volunteer, make_body, status, error
):
    before = traces(server, http, run_id)

    r = upload(http, volunteer.token, volunteer.work, make_body(volunteer.work))

    assert (r.status_code, r.json()["error"]) == (status, error), r.text
    assert r.json()["detail"]
    assert traces(server, http, run_id) == before
    # and the volunteer can still deliver its real contribution afterwards
    assert upload(http, volunteer.token, volunteer.work).status_code == 201


def test_base_version_mismatch_is_409_with_the_expected_version(server, http, run_id, volunteer):
    before = traces(server, http, run_id)

    r = upload(http, volunteer.token, volunteer.work, volunteer.work.body(base_version=3))

    assert r.status_code == 409
    assert r.json()["error"] == "base_version_mismatch" and r.json()["expected"] == 0
    assert traces(server, http, run_id) == before


def test_oversized_body_is_413_before_it_is_read(server, http, run_id, volunteer):
    limit = volunteer.work.lease["max_upload_bytes"]
    before = traces(server, http, run_id)

    r = upload(http, volunteer.token, volunteer.work, b"\0" * (limit + 1))

    assert (r.status_code, r.json()["error"]) == (413, "upload_too_large")
    assert traces(server, http, run_id) == before


def test_upload_without_content_length_is_411(http, run_id, volunteer):
    lease = volunteer.work.lease
    r = http.put(
        f"{API}/runs/{run_id}/rounds/{lease['round']}/contribution",
        content=iter([volunteer.work.body()]),  # a generator: sent chunked
        headers=auth(volunteer.token),
    )

    assert (r.status_code, r.json()["error"]) == (411, "length_required")


@pytest.mark.parametrize(
    "headers", [{}, auth("ctr_not-a-real-token"), {"Authorization": "Basic x"}]
)
def test_missing_or_bad_token_is_401(server, http, run_id, volunteer, headers):
    lease = volunteer.work.lease
    before = traces(server, http, run_id)

    r = http.put(
        f"{API}/runs/{run_id}/rounds/{lease['round']}/contribution",
        content=volunteer.work.body(),
        headers=headers,
    )

    assert (r.status_code, r.json()["error"]) == (401, "unauthorized")
    assert traces(server, http, run_id) == before


def test_upload_without_a_lease_is_409_no_lease(server, http, run_id, volunteer):
    stranger = register(http, "no-lease")

    r = upload(http, stranger, volunteer.work)

    assert (r.status_code, r.json()["error"]) == (409, "no_lease")


def test_identical_retry_is_idempotent_and_a_different_body_is_409(server, http, run_id, volunteer):
    first_upload = upload(http, volunteer.token, volunteer.work)
    retry = upload(http, volunteer.token, volunteer.work)
    different = upload(http, volunteer.token, volunteer.work, volunteer.work.body(loss=1.0))

    assert first_upload.status_code == 201
    assert retry.status_code == 200 and retry.json() == first_upload.json()
    assert (different.status_code, different.json()["error"]) == (409, "duplicate_contribution")
    accepted, blobs = traces(server, http, run_id)
    assert accepted == 1 and len(blobs) == 1
    me = http.get(f"{API}/contributors/me", headers=auth(volunteer.token)).json()
    board = {c["id"]: c for c in http.get(f"{API}/contributors").json()["contributors"]}
    assert board[me["id"]]["accepted"] == 1


def test_accepted_blob_is_exactly_the_uploaded_body(server, http, run_id, volunteer):
    body = volunteer.work.body()

    r = upload(http, volunteer.token, volunteer.work, body)

    assert r.status_code == 201
    (blob,) = (server.log_path.parent / "blobs" / keys.rounds(run_id) / "1").iterdir()
    assert blob.read_bytes() == body


def test_unknown_or_closed_round_is_409_naming_the_current_round(server, http, data_bytes):
    # a run that takes no late work (tests/test_late_contributions.py: one that does)
    run_id = new_run(http, data_bytes, quorum=1, target=1, max_staleness=0)
    token, late = register(http, "closer"), register(http, "late")
    work = train(http, token, run_id, steps=1)
    late_work = train(http, late, run_id, steps=1)
    assert upload(http, token, work).status_code == 201
    wait_for(
        lambda: http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"] == 1,
        timeout=60,
        what="round 1 to close at its target",
    )

    closed = upload(http, late, late_work)
    unknown = upload(http, late, Work({**late_work.lease, "round": 9}, late_work.meta, {}), b"x")

    assert (closed.status_code, closed.json()["error"]) == (409, "round_closed")
    assert closed.json()["current_round"] == 2 and "current round is 2" in closed.json()["detail"]
    assert (unknown.status_code, unknown.json()["current_round"]) == (409, 2)
    rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
    assert rounds[0]["accepted"] == 1 and rounds[0]["close_code"] == "target"
    beat = http.post(
        f"{API}/runs/{run_id}/rounds/1/heartbeat",
        json={"lease_id": late_work.lease["lease_id"]},
        headers=auth(late),
    )
    assert (beat.status_code, beat.json()["current_round"]) == (409, 2)
    # nothing of the late upload on disk: only the accepted one of round 1
    assert len(list((server.log_path.parent / "blobs" / keys.rounds(run_id) / "1").iterdir())) == 1
