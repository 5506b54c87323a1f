"""Every error answer is ours, against a real server: the findings of an API fuzzer (values
Postgres would refuse, Unicode digits, overflowing timeouts) each get a 4xx in the one error
shape, and so do the framework's own errors (unknown route, wrong method, validation).
Every answer carries an X-Request-ID; /docs works offline."""

from __future__ import annotations

import hashlib
import json
import re
import socket
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
import msgpack
import pytest

from diloco.data.manifest import MANIFEST
from diloco.protocol.messages import ErrorBody
from diloco.wire.contribution import DIGEST_BYTES, PREFIX
from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import API, auth, create_run, register, train, upload
from tests.support.datasets import make_dataset
from tests.support.live import ServerProcess, admin_headers, wait_for
from tests.support.pg import fresh_database
from tests.support.tcpproxy import TcpProxy

INT32_MAX = (1 << 31) - 1
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def assert_error(r: httpx.Response, status: int, code: str, *mentions: str) -> dict:
    """The answer is ``status`` with our error body: ``error`` ``code`` and a ``detail``
    sentence naming each of ``mentions``; JSON, with a request id."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["error"] == code, body
    assert isinstance(body["detail"], str) and body["detail"], body
    for word in mentions:
        assert word in body["detail"], (word, body)
    assert REQUEST_ID.fullmatch(r.headers["x-request-id"])
    return dict(body)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(make_corpus(120_000))
    return path


@pytest.fixture(scope="module")
def run_id(server) -> str:  # type: ignore[no-untyped-def]
    with server.client() as http:
        return str(create_run(http, server_run_config(rounds={"quorum": 5}))["id"])


@pytest.fixture(scope="module")
def token(server) -> str:  # type: ignore[no-untyped-def]
    with server.client() as http:
        return register(http, "hostile")


@pytest.fixture(scope="module")
def lease_id(server, run_id: str, token: str) -> str:  # type: ignore[no-untyped-def]
    with server.client() as http:
        return str(http.post(f"{API}/runs/{run_id}/join", headers=auth(token)).json()["lease_id"])


# ---------------------------------------------------------------- declared sizes

FIFTY_GB = 50 << 30  # 53687091200


def declare_only(
    server: ServerProcess, method: str, path: str, headers: dict[str, str]
) -> tuple[int, dict]:
    """Send a request's head declaring a 50 GB body and none of the body; its answer."""
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {FIFTY_GB}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        status_line, _, rest = answer.partition(b"\r\n")
        headers_part, _, body = rest.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in headers_part.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            body += sock.recv(65536)
    return int(status_line.split()[1]), json.loads(body)


def test_a_declared_50_gb_body_is_413_before_a_byte_of_it_is_sent(
    server, http, run_id, token, lease_id, tmp_path
):
    # Prepare: a lease on round 1 (an upload's admission passes), a registered dataset
    folder = tmp_path / "ds"
    make_dataset(folder, documents=20, words=20)
    dataset = http.post(
        f"{API}/datasets", content=(folder / MANIFEST).read_bytes(), headers=admin_headers()
    ).json()["id"]
    routes = {
        "contribution": ("PUT", f"{API}/runs/{run_id}/rounds/1/contribution", auth(token)),
        "run": (
            "POST",
            f"{API}/runs",
            admin_headers() | {"Content-Type": "multipart/form-data; boundary=b"},
        ),
        "manifest": ("POST", f"{API}/datasets", admin_headers()),
        "dataset file": ("PUT", f"{API}/datasets/{dataset}/files/val.bin", admin_headers()),
        "speed test": ("POST", f"{API}/speedtest", {}),
        # and the JSON bodies FastAPI would read whole into memory
        "registration": ("POST", f"{API}/contributors", {"Content-Type": "application/json"}),
        "heartbeat": (
            "POST",
            f"{API}/runs/{run_id}/rounds/1/heartbeat",
            auth(token) | {"Content-Type": "application/json"},
        ),
    }

    # Execute: each declares 50 GB and sends nothing more
    answers = {what: declare_only(server, *route) for what, route in routes.items()}

    # Assert: 413 in our error shape, each saying the declared size, none read the body
    for what, (status, body) in answers.items():
        assert status == 413, (what, body)
        assert body["error"] in ("upload_too_large", "body_too_large"), (what, body)
        assert str(FIFTY_GB) in body["detail"], (what, body)
    assert answers["contribution"][1]["error"] == "upload_too_large"


# ---------------------------------------------------------------- what the fuzzer found


def test_a_round_index_past_int32_is_422_not_503(http, run_id, token, lease_id):
    index = INT32_MAX + 1
    beat = {"lease_id": lease_id}

    heartbeat = http.post(f"{API}/runs/{run_id}/rounds/{index}/heartbeat", json=beat,
                          headers=auth(token))  # fmt: skip
    upload = http.put(f"{API}/runs/{run_id}/rounds/{index}/contribution", content=b"x",
                      headers=auth(token))  # fmt: skip
    release = http.delete(f"{API}/runs/{run_id}/rounds/{index}/lease", headers=auth(token))
    listing = http.get(f"{API}/runs/{run_id}/rounds/{index}/contributions")

    for r in (heartbeat, upload, release, listing):
        assert_error(r, 422, "invalid_request", "index", str(INT32_MAX))
    ok = http.post(f"{API}/runs/{run_id}/rounds/1/heartbeat", json=beat, headers=auth(token))
    assert ok.status_code == 200  # the lease is untouched


def test_a_checkpoint_version_past_int32_is_422_not_503(http, run_id):
    r = http.get(f"{API}/runs/{run_id}/checkpoints/{INT32_MAX + 1}")

    assert_error(r, 422, "invalid_request", "version", str(INT32_MAX))
    too_long = http.get(f"{API}/runs/{run_id}/checkpoints/{10**12}")
    assert_error(too_long, 422, "invalid_request", "version")
    assert http.get(f"{API}/runs/{run_id}/checkpoints/{INT32_MAX}").status_code == 404


@pytest.mark.parametrize("digit", ["%C2%B9", "%D9%A3", "%EF%BC%91", "+1", "-1", "1.0", "0x1"])
def test_a_checkpoint_version_is_ascii_digits_or_latest(http, run_id, digit):
    """ "¹".isdigit() is True in Python, and int("¹") raises: it was a plain-text 500."""
    r = http.get(f"{API}/runs/{run_id}/checkpoints/{digit}")

    assert_error(r, 422, "invalid_request", "version", "latest")
    assert http.get(f"{API}/runs/{run_id}/checkpoints/0").status_code == 200
    assert http.get(f"{API}/runs/{run_id}/checkpoints/latest").status_code == 200


def test_a_shard_index_past_int32_is_422(http, run_id):
    r = http.get(f"{API}/runs/{run_id}/shards/{INT32_MAX + 1}")

    assert_error(r, 422, "invalid_request", "index")
    assert_error(http.get(f"{API}/runs/{run_id}/shards/-1"), 422, "invalid_request", "index")


@pytest.mark.parametrize("bad", ["%00", "run_%00x", "a%0Ab", "%1B%5B31m", "%7F"])
def test_a_control_character_in_a_run_id_is_422_on_every_route(http, token, bad):
    answers = [
        http.get(f"{API}/runs/{bad}"),
        http.get(f"{API}/runs/{bad}/rounds"),
        http.get(f"{API}/runs/{bad}/checkpoints/latest"),
        http.get(f"{API}/runs/{bad}/shards/0"),
        http.post(f"{API}/runs/{bad}/pause", headers=admin_headers()),
        http.post(f"{API}/runs/{bad}/join", headers=auth(token)),
        http.post(f"{API}/runs/{bad}/rounds/1/heartbeat", json={"lease_id": "x"},
                  headers=auth(token)),
        http.put(f"{API}/runs/{bad}/rounds/1/contribution", content=b"x", headers=auth(token)),
        http.get(f"{API}/contributors", params={"run": unquote(bad)}),
    ]  # fmt: skip

    for r in answers:
        assert_error(r, 422, "invalid_request", "control characters")


def test_a_run_id_longer_than_any_run_is_422_and_an_unknown_one_404(http):
    long = "run_" + "0" * 29  # 33 characters: runs.id holds 32

    assert_error(http.get(f"{API}/runs/{long}"), 422, "invalid_request", "run_id", "32")
    assert_error(http.get(f"{API}/runs/run_000000000000"), 404, "run_not_found")
    assert_error(http.get(f"{API}/runs/run_nope/rounds"), 404, "run_not_found")
    board = http.get(f"{API}/contributors", params={"run": "run_nope"})
    assert_error(board, 404, "run_not_found")


def test_heartbeat_values_the_database_would_refuse_are_422(http, run_id, token, lease_id):
    url = f"{API}/runs/{run_id}/rounds/1/heartbeat"

    step = http.post(url, json={"lease_id": lease_id, "step": INT32_MAX + 1}, headers=auth(token))
    nul = http.post(url, json={"lease_id": "lease_\u0000"}, headers=auth(token))
    surrogate = http.post(url, content=b'{"lease_id": "\\ud800"}',
                          headers={**auth(token), "content-type": "application/json"})  # fmt: skip

    assert_error(step, 422, "invalid_request", "step")
    assert_error(nul, 422, "invalid_request", "lease_id", "control characters")
    assert_error(surrogate, 422, "invalid_request", "lease_id")
    fine = http.post(url, json={"lease_id": lease_id, "step": INT32_MAX}, headers=auth(token))
    assert fine.status_code == 200


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("rounds", {"timeout_s": 1e300}, "rounds.timeout_s"),  # was a timedelta overflow: 500
        ("rounds", {"max_rounds": INT32_MAX + 1}, "rounds.max_rounds"),
        ("rounds", {"quorum": 10**9}, "rounds.quorum"),
        ("data", {"chunk_size": INT32_MAX + 1}, "data.chunk_size"),
        ("inner", {"warmup_steps": 10**12}, "inner.warmup_steps"),
        ("inner", {"grad_clip": 1e300}, "inner.grad_clip"),
        ("data", {"path": "in\u0000put.txt"}, "data.path"),
    ],
)
def test_run_config_values_that_would_overflow_are_422_naming_the_key(
    http, data_file, section, values, key
):
    r = http.post(
        f"{API}/runs",
        data={"config": json.dumps(server_run_config(**{section: values}))},
        files={"data": ("corpus.txt", data_file.read_bytes(), "text/plain")},
        headers=admin_headers(),
    )

    assert_error(r, 422, "invalid_config", key)


@pytest.mark.parametrize(
    ("config", "mentions"),
    [
        ('{"name": "a\\u0000b", "data": {"path": "x"}}', "name"),  # JSONB refuses \u0000
        ('{"name": "x", "data": {"path": "x"}, "seed": ' + "9" * 5000 + "}", "JSON"),
        ("[" * 100_000, "JSON"),  # deeper than Python's JSON decoder recurses
        ('{"\\ud800": 1, "name": "x", "data": {"path": "x"}}', "unicode"),
        ('{"name": "x", "data": {"path": "x"}, "inner": {"lr": NaN}}', "inner.lr"),
    ],
    ids=["nul", "huge-int", "deep-nesting", "lone-surrogate", "nan"],
)
def test_hostile_config_json_is_422(http, data_file, config, mentions):
    r = http.post(
        f"{API}/runs",
        data={"config": config},
        files={"data": ("corpus.txt", data_file.read_bytes(), "text/plain")},
        headers=admin_headers(),
    )

    assert_error(r, 422, "invalid_config", mentions)


@pytest.mark.parametrize(
    "filename", [b"in\x00put.txt", b"in\nput.txt", b"x" * 300 + b".txt"], ids=["nul", "lf", "long"]
)
def test_a_data_file_name_the_database_would_refuse_is_422(http, data_file, filename):
    config = json.dumps(server_run_config()).encode()
    body = (
        b'--XX\r\nContent-Disposition: form-data; name="config"\r\n\r\n' + config + b"\r\n"
        b'--XX\r\nContent-Disposition: form-data; name="data"; filename="' + filename + b'"\r\n'
        b"Content-Type: text/plain\r\n\r\n" + data_file.read_bytes() + b"\r\n--XX--\r\n"
    )
    before = len(http.get(f"{API}/runs").json()["runs"])

    multipart = {**admin_headers(), "content-type": "multipart/form-data; boundary=XX"}
    r = http.post(f"{API}/runs", content=body, headers=multipart)

    assert_error(r, 422, "invalid_request", "file name")
    assert len(http.get(f"{API}/runs").json()["runs"]) == before


def reheader(body: bytes, **changes: object) -> bytes:
    """``body`` with its msgpack header changed (the encoder refuses to write such values)
    and its sha256 trailer made right again, so only the header is wrong."""
    magic, n = PREFIX.unpack(body[: PREFIX.size])
    header = msgpack.unpackb(body[PREFIX.size : PREFIX.size + n])
    new = msgpack.packb({**header, **changes})
    out = PREFIX.pack(magic, len(new)) + new + body[PREFIX.size + n : -DIGEST_BYTES]
    return out + hashlib.sha256(out).digest()


@pytest.mark.parametrize(
    "changes",
    [{"tokens": 1 << 63}, {"tokens": (1 << 64) - 1}, {"inner_steps": 1 << 31}],
    ids=["tokens-past-bigint", "tokens-uint64", "inner-steps-past-int32"],
)
def test_upload_header_counts_past_their_columns_are_400_and_leave_no_trace(http, run_id, changes):
    """A contributor with a lease could make the insert of its row fail (a 500)."""
    token = register(http, "counter")
    work = train(http, token, run_id, steps=1)

    def accepted() -> int:
        return int(http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"][0]["accepted"])

    before = accepted()
    r = upload(http, token, work, body=reheader(work.body(), **changes))

    (key,) = changes
    assert_error(r, 400, "malformed_upload", key)
    assert accepted() == before
    assert upload(http, token, work).status_code == 201  # the honest body still counts
    assert accepted() == before + 1


def test_503_means_the_database_is_unreachable_and_ends_when_it_is_back(pg_admin_url, tmp_path):
    """The server reaches Postgres through a forwarder that the test cuts: then, and only
    then, database routes answer 503 unavailable (and /healthz says so once the pulse's
    next probe failed); a route that needs no database still answers; once the database is
    reachable again, so is the API, and /healthz says ok again."""
    parts = urlsplit(pg_admin_url)
    if not parts.hostname or parts.hostname.startswith("/"):
        pytest.skip("needs Postgres on TCP (DILOCO_TEST_DATABASE_URL), not a Unix socket")
    target = (parts.hostname, parts.port or 5432)
    with fresh_database(pg_admin_url) as url:
        proxy = TcpProxy(target)
        proxied = urlunsplit(urlsplit(url)._replace(netloc=f"postgres@127.0.0.1:{proxy.port}"))
        proc = ServerProcess(data_dir=tmp_path / "srv", database_url=proxied, pulse_interval_s=0.2)
        try:
            proc.wait_ready()
            with proc.client() as http:
                assert http.get(f"{API}/runs").status_code == 200
                assert http.get("/healthz").status_code == 200

                proxy.cut()
                down = [http.get(f"{API}/runs"), http.get(f"{API}/runs/run_nope"),
                        http.post(f"{API}/contributors", json={"name": "late"})]  # fmt: skip
                (health,) = wait_for(
                    lambda: [r for r in [http.get("/healthz")] if r.status_code != 200],
                    timeout=30, what="/healthz to notice",
                )  # fmt: skip
                hub = http.get(f"{API}/hub")

                for r in down:
                    assert_error(r, 503, "unavailable", "unreachable", "retry")
                assert_error(health, 503, "unavailable", "database unreachable")
                assert hub.status_code == 200
                TcpProxy(target, port=proxy.port)  # the database is back
                wait_for(lambda: http.get(f"{API}/runs").status_code == 200, timeout=30,
                         what="the API to reach the database again")  # fmt: skip
                wait_for(lambda: http.get("/healthz").status_code == 200, timeout=30,
                         what="/healthz to say so")  # fmt: skip
            # an outage is not a bug: logged as unreachable, never as a failed request
            log = proc.output()
            assert "database unreachable" in log and not re.search(r"request \S+: .* failed", log)
        finally:
            proc.stop()


# ---------------------------------------------------------------- the framework's errors


def test_an_unknown_route_is_404_in_our_shape(http):
    r = http.get("/api/v1/nothing-here")

    assert_error(r, 404, "not_found", "/api/v1/nothing-here", "/docs")


def test_a_wrong_method_is_405_naming_every_allowed_method(http):
    r = http.delete(f"{API}/runs")

    assert_error(r, 405, "method_not_allowed", "GET", "POST")
    assert r.headers["allow"] == "GET, POST"


def test_validation_errors_are_422_with_only_error_and_detail(http):
    r = http.get(f"{API}/contributors", params={"limit": 0, "sort": "shoe size"})

    body = assert_error(r, 422, "invalid_request", "limit", "sort")
    assert set(body) == {"error", "detail"}


def test_a_json_body_that_does_not_parse_is_refused_in_our_shape(http):
    broken = http.post(f"{API}/contributors", content=b'{"name": ',
                       headers={"content-type": "application/json"})  # fmt: skip
    not_utf8 = http.post(f"{API}/contributors", content=b'{"name": "\xff\xfe"}',
                         headers={"content-type": "application/json"})  # fmt: skip

    assert_error(broken, 422, "invalid_request", "JSON")
    assert not_utf8.status_code in (400, 422)
    assert not_utf8.json()["error"] in ("bad_request", "invalid_request")


def test_a_sane_request_id_is_echoed_and_any_other_replaced(http):
    mine = http.get("/healthz", headers={"X-Request-ID": "lb-7f3a:42"})
    hostile = http.get("/healthz", headers={"X-Request-ID": "x" * 65})
    missing = http.get(f"{API}/runs/run_nope")

    assert mine.headers["x-request-id"] == "lb-7f3a:42"
    assert hostile.headers["x-request-id"].startswith("req_")
    assert missing.headers["x-request-id"].startswith("req_")
    assert missing.headers["x-request-id"] != hostile.headers["x-request-id"]


def test_a_streamed_download_carries_a_request_id_and_its_bytes(http):
    r = http.get(f"{API}/speedtest", params={"bytes": 3 * (1 << 20) + 5})

    assert r.status_code == 200 and len(r.content) == 3 * (1 << 20) + 5
    assert r.headers["x-request-id"].startswith("req_")


# ---------------------------------------------------------------- /docs and /openapi.json


def test_docs_load_only_our_own_files_under_a_strict_csp(http):
    page = http.get("/docs")

    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self';" in csp
    urls = re.findall(r'(?:src|href)="([^"]*)"', page.text)
    assert len(urls) == 4, urls  # favicon, css, bundle, initializer
    assert all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    assert "http" not in page.text and "<script>" not in page.text  # no inline script
    for url in urls:
        assert http.get(url).status_code == 200, url
    init = http.get("/docs/init.js")
    assert init.headers["content-type"].startswith("text/javascript")
    assert '"/openapi.json"' in init.text and "validatorUrl: null" in init.text
    assert_error(http.get("/redoc"), 404, "not_found")
    assert_error(http.get("/docs/static/index.html"), 404, "not_found")


def test_openapi_documents_our_error_body_on_every_error_status(http):
    spec = http.get("/openapi.json").json()

    assert spec["openapi"].startswith("3.1")
    assert "HTTPValidationError" not in json.dumps(spec)
    error_body = spec["components"]["schemas"]["ErrorBody"]
    assert error_body["required"] == ["error", "detail"]
    assert error_body["additionalProperties"] is True
    assert error_body == ErrorBody.model_json_schema()  # the model the clients import
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            assert "500" in op["responses"], (method, path)
            for status, response in op["responses"].items():
                if int(status) < 400:
                    continue
                schema = response["content"]["application/json"]["schema"]
                assert schema["allOf"][0] == {"$ref": "#/components/schemas/ErrorBody"}
                assert schema["allOf"][1]["properties"]["error"]["enum"], (method, path, status)
    heartbeat = spec["paths"][f"{API}/runs/{{run_id}}/rounds/{{index}}/heartbeat"]["post"]
    assert heartbeat["responses"]["422"]["content"]["application/json"]["schema"]["allOf"][1] == {
        "properties": {"error": {"enum": ["invalid_request"]}}
    }
    assert heartbeat["security"] == [{"contributorToken": []}]
    # the admin's token or a run owner's; the admin's alone for what only the admin does
    either = [{"adminToken": []}, {"contributorToken": []}]
    assert spec["paths"][f"{API}/runs"]["post"]["security"] == either
    assert spec["paths"][f"{API}/runs/{{run_id}}/pause"]["post"]["security"] == either
    assert spec["paths"][f"{API}/accounts"]["get"]["security"] == [{"adminToken": []}]


def _media(spec: dict, method: str, path: str, status: str) -> set[str]:
    return set(spec["paths"][path][method]["responses"][status].get("content", {}))


def test_openapi_gives_the_real_content_types_and_request_bodies(http):
    spec = http.get("/openapi.json").json()
    upload = spec["paths"][f"{API}/runs/{{run_id}}/rounds/{{index}}/contribution"]["put"]

    for path in (f"{API}/runs/{{run_id}}/checkpoints/{{version}}",
                 f"{API}/runs/{{run_id}}/shards/{{index}}"):  # fmt: skip
        assert _media(spec, "get", path, "200") == {"application/octet-stream"}
        assert _media(spec, "get", path, "206") == {"application/octet-stream"}
        assert _media(spec, "get", path, "304") == set()
    assert _media(spec, "get", "/install.sh", "200") == {"text/x-shellscript"}
    assert _media(spec, "get", "/metrics", "200") == {"text/plain"}
    assert _media(spec, "get", "/", "200") == {"text/html"}
    assert _media(spec, "get", f"{API}/speedtest", "200") == {"application/octet-stream"}
    assert set(spec["paths"][f"{API}/speedtest"]["post"]["requestBody"]["content"]) == {
        "application/octet-stream"
    }
    assert upload["requestBody"]["required"] is True
    assert set(upload["requestBody"]["content"]) == {"application/octet-stream"}
    assert _media(spec, "put", f"{API}/runs/{{run_id}}/rounds/{{index}}/contribution", "200") == {
        "application/json"
    }
