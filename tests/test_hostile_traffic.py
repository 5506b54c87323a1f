"""Hostile traffic against a real server with short limits: a stalled request head or upload
is dropped after its timeout (and the upload's temp blob removed), an oversized head gets
431, uploads in flight are capped per contributor and in all (429 + Retry-After, slots
given back), and run creation refuses a model the server cannot close and values no round
could meet. Raw sockets where a well-behaved client cannot misbehave; every wait bounded."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.storage import keys
from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import API, Work, auth, register, train, upload
from tests.support.live import ServerProcess, admin_headers, wait_for

HEADER_TIMEOUT_S = 1.0
BODY_IDLE_TIMEOUT_S = 1.5
MAX_HEADER_BYTES = 8192
SLACK_S = 3.0  # a loaded test machine: what a drop may take past its timeout


@pytest.fixture(scope="module")
def server(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        proc = ServerProcess(
            data_dir=tmp_path_factory.mktemp("hostile"),
            database_url=url,
            header_timeout_s=HEADER_TIMEOUT_S,
            body_idle_timeout_s=BODY_IDLE_TIMEOUT_S,
            max_header_bytes=MAX_HEADER_BYTES,
            max_uploads_per_contributor=2,
            max_uploads_in_flight=3,
            close_memory_budget_bytes=4 << 30,  # 2 GiB a close, with the 2 concurrent closes
        )
        try:
            yield proc.wait_ready()
        finally:
            proc.stop()


# ---------------------------------------------------------------- raw sockets


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(HEADER_TIMEOUT_S + BODY_IDLE_TIMEOUT_S + SLACK_S + 5)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the socket's
    timeout and by size)."""
    got = b""
    while len(got) < 1 << 20:
        piece = sock.recv(65536)
        if not piece:
            return got
        got += piece
    raise AssertionError("the server sent more than 1 MiB")


def parse_answer(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


def stalled_upload(server: ServerProcess, token: str, lease: dict, length: int) -> socket.socket:
    """An upload that sends its headers and 100 bytes of its body, then nothing."""
    sock = connect(server)
    path = f"{API}/runs/{lease['run_id']}/rounds/{lease['round']}/contribution"
    head = (
        f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + b"\0" * 100)
    return sock


def blob_files(server: ServerProcess, run_id: str) -> list[Path]:
    rounds = server.data_dir / "blobs" / keys.rounds(run_id)
    return [p for p in rounds.rglob("*") if p.is_file()] if rounds.exists() else []


# ---------------------------------------------------------------- a run and its volunteers


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture
def run_id(http: httpx.Client) -> str:
    r = http.post(
        f"{API}/runs",
        data={"config": json.dumps(server_run_config(rounds={"quorum": 5}))},
        files={"data": ("corpus.txt", make_corpus(120_000).encode(), "text/plain")},
        headers=admin_headers(),
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def joined(http: httpx.Client, run_id: str, name: str) -> tuple[str, dict]:
    token = register(http, name)
    r = http.post(f"{API}/runs/{run_id}/join", headers=auth(token))
    assert r.status_code == 200, r.text
    return token, r.json()


def wait_for_blobs(server: ServerProcess, run_id: str, n: int) -> None:
    """Until ``n`` uploads are streaming into their temp blobs (each holds its slot)."""
    wait_for(
        lambda: len(blob_files(server, run_id)) >= n, timeout=10, what=f"{n} uploads streaming"
    )


# ---------------------------------------------------------------- request heads


def test_a_stalled_request_head_is_answered_408_and_closed_after_the_header_timeout(server):
    sock = connect(server)
    started = time.monotonic()

    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0")  # and then nothing
    raw = read_to_close(sock)

    elapsed = time.monotonic() - started
    status, headers, body = parse_answer(raw)
    assert (status, body["error"]) == (408, "request_timeout")
    assert headers["connection"] == "close"
    assert HEADER_TIMEOUT_S * 0.9 <= elapsed <= HEADER_TIMEOUT_S + SLACK_S


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(server):
    sock = connect(server)
    started = time.monotonic()

    raw = read_to_close(sock)

    assert raw == b""  # nothing was asked: nothing is answered
    assert time.monotonic() - started <= HEADER_TIMEOUT_S + SLACK_S


def test_a_head_dripped_a_byte_at_a_time_is_cut_at_the_header_timeout(server):
    sock = connect(server)
    started = time.monotonic()
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
    for i in range(len(head)):  # bounded: 1000 bytes, 0.05 s apart, cut after about 1 s
        try:
            sock.sendall(head[i : i + 1])
        except OSError:
            break
        time.sleep(0.05)
        if time.monotonic() - started > HEADER_TIMEOUT_S + SLACK_S:
            break

    assert time.monotonic() - started <= HEADER_TIMEOUT_S + SLACK_S
    with pytest.raises(OSError):  # closed: a write fails, at the latest the second one
        for _ in range(2):
            sock.sendall(b"a" * 65536)
            time.sleep(0.2)


def test_a_download_outlasting_the_body_timeout_is_not_cut(server):
    sock = connect(server)
    sock.sendall(f"GET {API}/speedtest?bytes={64 << 20} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    started, got = time.monotonic(), 0
    while got < (64 << 20) + 100 and time.monotonic() - started < 30:  # read slowly
        piece = sock.recv(1 << 20)
        if not piece:
            break
        got += len(piece)
        if time.monotonic() - started < BODY_IDLE_TIMEOUT_S + 1:
            time.sleep(0.05)

    assert time.monotonic() - started > BODY_IDLE_TIMEOUT_S  # it did outlast the timeout
    assert got > 64 << 20  # the whole body (and its head) arrived


def test_a_head_over_the_cap_gets_431_and_the_server_still_answers(server, http):
    sock = connect(server)
    big = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (100 << 10) + b"\r\n\r\n"

    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(big)  # the server may close before all 100 KiB are sent
    raw = read_to_close(sock)

    status, headers, body = parse_answer(raw)
    assert (status, body["error"]) == (431, "header_too_large")
    assert str(MAX_HEADER_BYTES) in body["detail"]
    assert headers["connection"] == "close"
    assert http.get("/healthz").status_code == 200


def test_a_head_just_under_the_cap_is_served(server, http):
    pad = MAX_HEADER_BYTES - 200
    r = http.get("/healthz", headers={"X-Pad": "a" * pad})

    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- uploads


def test_a_stalled_upload_is_dropped_with_408_and_its_temp_blob_removed(server, http, run_id):
    token, lease = joined(http, run_id, "staller")
    sock = stalled_upload(server, token, lease, length=50_000)
    wait_for_blobs(server, run_id, 1)
    started = time.monotonic()

    raw = read_to_close(sock)

    status, headers, body = parse_answer(raw)
    assert (status, body["error"]) == (408, "request_timeout")
    assert headers["connection"] == "close"
    assert time.monotonic() - started <= BODY_IDLE_TIMEOUT_S + SLACK_S
    wait_for(lambda: not blob_files(server, run_id), timeout=5, what="the temp blob removed")
    seen = http.get(f"{API}/runs/{run_id}/rounds/1/contributions").json()
    assert [r["error"] for r in seen["rejections"]] == ["request_timeout"]


def test_a_stalled_run_data_upload_is_dropped_with_408(server):
    sock = connect(server)
    head = (
        f"POST {API}/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: {admin_headers()['Authorization']}\r\n"
        "Content-Type: multipart/form-data; boundary=xyz\r\nContent-Length: 5000000\r\n\r\n"
    )
    part = '--xyz\r\nContent-Disposition: form-data; name="data"; filename="c.txt"\r\n\r\n'
    sock.sendall(head.encode() + part.encode() + b"a" * 2_000_000)  # then nothing
    started = time.monotonic()

    status, _, body = parse_answer(read_to_close(sock))

    assert (status, body["error"]) == (408, "request_timeout")
    assert time.monotonic() - started <= BODY_IDLE_TIMEOUT_S + SLACK_S
    leftovers = server.data_dir / "tmp"
    assert not leftovers.exists() or not list(leftovers.iterdir())


def test_the_unread_rest_of_a_refused_upload_cannot_hold_the_connection(server, run_id):
    sock = stalled_upload(server, "ctr_not_a_token", {"run_id": run_id, "round": 1}, 50_000)
    sock.settimeout(0.2)
    answer = b""
    started = time.monotonic()
    closed = False
    while time.monotonic() - started < HEADER_TIMEOUT_S + SLACK_S:  # drip the rest
        try:
            sock.sendall(b"\0")
            piece = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            closed = True
            break
        if not piece:
            closed = True
            break
        answer += piece

    assert answer.startswith(b"HTTP/1.1 401 ")  # refused before its body was read
    assert closed, "the server kept reading the refused upload's body"


def test_a_contributors_third_upload_in_flight_gets_429_and_the_drops_free_its_slots(
    server, http, run_id
):
    token = register(http, "eager")
    work = train(http, token, run_id, steps=1)
    length = len(work.body())
    stalls = [stalled_upload(server, token, work.lease, length) for _ in range(2)]
    wait_for_blobs(server, run_id, 2)

    refused = upload(http, token, work)

    assert (refused.status_code, refused.json()["error"]) == (429, "too_many_uploads")
    assert refused.headers["retry-after"] == "5"
    assert refused.json()["retry_after_s"] == 5.0
    for sock in stalls:  # dropped after the body timeout: their slots are given back
        assert parse_answer(read_to_close(sock))[0] == 408
    assert upload(http, token, work).status_code == 201


def test_uploads_past_the_servers_cap_get_429_until_a_slot_is_free(server, http, run_id):
    first, first_lease = joined(http, run_id, "first")
    second, second_lease = joined(http, run_id, "second")
    token = register(http, "third")
    work: Work = train(http, token, run_id, steps=1)
    stalls = [stalled_upload(server, first, first_lease, 50_000) for _ in range(2)]
    stalls.append(stalled_upload(server, second, second_lease, 50_000))
    wait_for_blobs(server, run_id, 3)

    refused = upload(http, token, work)

    assert (refused.status_code, refused.json()["error"]) == (429, "too_many_uploads")
    assert "the most it takes at once" in refused.json()["detail"]
    assert refused.headers["retry-after"] == "5"
    stalls.pop().close()  # a client that goes away gives its slot back at once
    wait_for(
        lambda: len(blob_files(server, run_id)) == 2, timeout=5, what="the closed upload dropped"
    )
    assert upload(http, token, work).status_code == 201
    for sock in stalls:
        sock.close()


# ---------------------------------------------------------------- run creation


def create(http: httpx.Client, **sections: dict) -> httpx.Response:
    return http.post(
        f"{API}/runs",
        data={"config": json.dumps(server_run_config(**sections))},
        files={"data": ("corpus.txt", make_corpus(20_000).encode(), "text/plain")},
        headers=admin_headers(),
    )


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_a_model_the_server_cannot_close_is_refused_before_it_is_built(server, http):
    before = peak_rss_bytes(server.pid)

    r = create(http, model={"n_layer": 24, "n_head": 16, "n_embd": 2048, "block_size": 128})

    assert (r.status_code, r.json()["error"]) == (422, "model_too_large"), r.text
    assert "GiB" in r.json()["detail"] and "1,2" in r.json()["detail"]  # 1.2B parameters
    assert r.json()["needed_bytes"] > r.json()["budget_bytes"] == 2 << 30
    assert peak_rss_bytes(server.pid) - before < 100 << 20  # 4.8 GB a copy: never allocated
    assert peak_rss_bytes(server.pid) < 1 << 30


@pytest.mark.parametrize(
    ("rounds", "key"),
    [
        ({"quorum": 10**18}, "rounds.quorum"),
        ({"quorum": 10_001}, "rounds.quorum"),
        ({"timeout_s": 0.5}, "rounds.timeout_s"),
        ({"timeout_s": 1e9}, "rounds.timeout_s"),
    ],
)
def test_values_no_round_could_meet_are_refused_with_the_key(server, http, rounds, key):
    r = create(http, rounds=rounds)

    assert (r.status_code, r.json()["error"]) == (422, "invalid_config"), r.text
    assert r.json()["detail"].startswith(key)
