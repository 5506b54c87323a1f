"""Schemathesis fuzzes a live server against the server's own /openapi.json: every answer
must be documented there (status, content type, body schema, the error codes of each
status) and none may be a 5xx. A fixed seed and a few examples per operation keep it
reproducible and within a couple of minutes here.

Half the generated run ids are swapped for a real run's, so that the fuzzer reaches past
``404 run_not_found``: checkpoints, shards, rounds, uploads and the admin actions. The
admin actions (pause, resume, cancel) get a run of their own, so that the run the uploads
go to stays active and they reach the upload decoder. POST
/api/v1/runs is fuzzed too: its ``config`` part is a JSON string that the fuzzer fills with
arbitrary text, never a valid run config (which must name a model and data), so it cannot
ask the server for a huge model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib.metadata import version as pkg_version
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.config import SchemathesisConfig

from tests.conftest import server_run_config
from tests.support.contribute import API, auth, create_run, register
from tests.support.live import ADMIN_TOKEN, ServerProcess

RUN_ID = re.compile(r"[^\x00-\x1f\x7f]{1,32}")  # as the schema says
EXAMPLES = 25  # per operation and generation mode: ~30 operations, positive and negative
SEED = 20260101
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",  # what the schema forbids is refused with a 4xx
    "missing_required_header",
    "unsupported_method",  # a method a path does not have is 405 with its Allow header
    "ignored_auth",  # an operation that declares a token refuses a request without one
)


@pytest.fixture(scope="module")
def fuzzed(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server of its own (the fuzzer pauses and cancels runs) with a real run and a
    registered contributor holding a lease on its first round. Its client wheel is a
    stand-in file, so that /install.sh and /downloads/ answer at once instead of building a
    wheel while the fuzzer waits."""
    from tests.support.pg import fresh_database

    root = tmp_path_factory.mktemp("fuzzed")
    wheel = root / f"diloco_hub-{pkg_version('diloco-hub')}-py3-none-any.whl"
    wheel.write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip: served, never installed
    with fresh_database(pg_admin_url) as url:
        proc = ServerProcess(data_dir=root / "srv", database_url=url, client_wheel=wheel)
        try:
            proc.wait_ready()
            with proc.client() as http:
                run = create_run(http, server_run_config(rounds={"quorum": 50}))
                acted_on = create_run(http, server_run_config(rounds={"quorum": 50}))
                token = register(http, "fuzzer")
                lease = http.post(f"{API}/runs/{run['id']}/join", headers=auth(token))
                assert lease.status_code == 200, lease.text  # uploads get past 409 no_lease
            yield {
                "url": proc.url,
                "run_id": run["id"],
                "admin_run_id": acted_on["id"],
                "token": token,
                "proc": proc,
            }
        finally:
            proc.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed: dict[str, Any]) -> Any:
    config = SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "generation": {"mode": "all", "max-examples": EXAMPLES},
            "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
            "auth": {
                "openapi": {
                    "adminToken": {"bearer": ADMIN_TOKEN},
                    "contributorToken": {"bearer": fuzzed["token"]},
                }
            },
        }
    )
    return schemathesis.openapi.from_url(f"{fuzzed['url']}/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.timeout(300)
@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_every_answer_is_the_one_the_openapi_documents(case: Any, fuzzed: dict[str, Any]) -> None:
    params = case.path_parameters or {}
    run_id = unquote(str(params.get("run_id", "")))  # path values come percent-encoded
    if RUN_ID.fullmatch(run_id) and len(run_id) % 2 == 0:
        # a valid id for a valid one: negative stays negative
        acting = case.path.endswith(("/pause", "/resume", "/cancel"))
        params["run_id"] = fuzzed["admin_run_id" if acting else "run_id"]

    case.call_and_validate(timeout=60)


def test_the_fuzzing_reached_past_404_and_logged_no_error(fuzzed: dict[str, Any]) -> None:
    """Runs after the fuzzing (file order). The run-id swap took requests to real files and
    into the upload decoder, and no request raised (a 500 logs a traceback)."""
    with httpx.Client(base_url=fuzzed["url"], timeout=30) as http:
        metrics = http.get("/metrics").text
    answered = {
        (s.labels["route"], s.labels["status"])
        for family in text_string_to_metric_families(metrics)
        if family.name == "diloco_http_requests"
        for s in family.samples
        if s.value > 0
    }

    assert ("/api/v1/runs/{run_id}/checkpoints/{version}", "200") in answered
    assert ("/api/v1/runs/{run_id}/shards/{index}", "200") in answered
    assert ("/api/v1/runs/{run_id}/rounds/{index}/contribution", "400") in answered
    assert not {status for _, status in answered if status.startswith("5")}
    assert "Traceback" not in fuzzed["proc"].output(), fuzzed["proc"].output()[-3000:]
