"""Webhooks through a real server and real receivers on 127.0.0.1: a run's owner sets one,
the hub signs and sends a round's repeated close failures and the run's completion, retries
a receiver that answers 500, and a receiver that hangs delays no close. Without the
operator's allowance, loopback, private, link-local and metadata addresses are refused when
set and again when sent."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from server.db import make_engine, make_sessionmaker
from server.rounds import version_eval
from server.webhooks import addresses
from server.webhooks.delivery import send, signature
from tests.conftest import server_run_config
from tests.support.contribute import (
    API,
    auth,
    close_rounds,
    create_run,
    register,
    train,
    upload,
)
from tests.support.live import ServerProcess, admin_headers, wait_for


class Receiver:
    """An HTTP receiver on 127.0.0.1 that records each POST; the first ``fail`` answer 500,
    and with ``hang`` every request waits (until ``stop``) before its answer."""

    def __init__(self, *, fail: int = 0, hang: bool = False) -> None:
        self.got: list[dict[str, Any]] = []
        self.fail, self.hang = fail, hang
        self.released = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                owner.got.append({"headers": dict(self.headers), "body": body})
                if owner.hang:
                    owner.released.wait(60)
                status = 500 if len(owner.got) <= owner.fail else 204
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/hook"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def events(self) -> list[str]:
        return [r["headers"]["X-DiLoCo-Event"] for r in self.got]

    def stop(self) -> None:
        self.released.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.stop()


@pytest.fixture
def hooked_server(database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    """A server that allows webhooks to 127.0.0.1 (the test's receivers), retries fast, and
    fails every round's first three close attempts."""
    proc = ServerProcess(
        data_dir=tmp_path / "srv",
        database_url=database_url,
        webhook_allow_networks="127.0.0.0/8",
        webhook_retry_base_s=0.2,
        webhook_poll_s=0.2,
        webhook_timeout_s=30,
        close_retry_base_s=0.1,
        close_retry_max_s=0.5,
        faults="close.claim=fail*3",
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def verify(secret: str, received: dict[str, Any]) -> dict[str, Any]:
    """The body, once its signature checks out as a receiver would check it."""
    parts = dict(p.split("=", 1) for p in received["headers"]["X-DiLoCo-Signature"].split(","))
    expected = hmac.new(
        secret.encode(), parts["t"].encode() + b"." + received["body"], hashlib.sha256
    ).hexdigest()
    assert hmac.compare_digest(parts["sha256"], expected)
    return dict(json.loads(received["body"]))


def test_close_failures_and_completion_are_signed_retried_and_never_wait_on_a_hung_receiver(
    hooked_server, receivers
):
    # Prepare: a run of one round; a receiver that fails twice, one that hangs
    flaky, hung = Receiver(fail=2), Receiver(hang=True)
    receivers += [flaky, hung]
    http = httpx.Client(base_url=hooked_server.url, timeout=30)
    run_id = create_run(http, server_run_config(rounds={"quorum": 1, "max_rounds": 1}))["id"]
    made = {}
    for receiver, fmt in ((flaky, "json"), (hung, "slack")):
        r = http.post(
            f"{API}/runs/{run_id}/webhooks",
            json={"url": receiver.url, "format": fmt},
            headers=admin_headers(),
        )
        assert r.status_code == 201, r.text
        made[fmt] = r.json()
    volunteer = register(http, "hooked-volunteer")

    # Execute: one upload; the round's close fails three times, then publishes
    assert upload(http, volunteer, train(http, volunteer, run_id, steps=1)).status_code == 201
    wait_for(
        lambda: http.get(f"{API}/runs/{run_id}").json()["status"] == "completed",
        timeout=120,
        what="the run to complete",
    )
    hung_at_completion = len(hung.got)
    wait_for(lambda: len(flaky.got) >= 4, timeout=60, what="both events, after two 500s")

    # Assert: the close did not wait for the receiver that hangs: its first request (the
    # close failures) came before the run completed and is still unanswered; the flaky one
    # got each event once signed, after its two 500s
    assert hung_at_completion >= 1 and hung.events()[0] == "round.close_failing"
    assert not hung.released.is_set()
    # two 500s (whichever deliveries they were), then each event answered once
    assert len(flaky.got) == 4 and sorted(flaky.events()[2:]) == [
        "round.close_failing",
        "run.completed",
    ], flaky.events()
    delivered = {r["headers"]["X-DiLoCo-Event"]: r for r in flaky.got[2:]}
    failing = verify(made["json"]["secret"], delivered["round.close_failing"])
    completed = verify(made["json"]["secret"], delivered["run.completed"])
    assert failing["event"] == "round.close_failing" and failing["run_id"] == run_id
    assert failing["data"]["round"] == 1 and failing["data"]["attempts"] == 3
    assert "injected" in failing["data"]["error"].lower()
    assert completed["data"] == {"round": 1, "version": 1}
    assert completed["summary"].startswith("DiLoCo Hub: run api-test")
    assert len({r["headers"]["X-DiLoCo-Delivery"] for r in flaky.got}) == 2  # two deliveries
    listed = http.get(f"{API}/runs/{run_id}/webhooks", headers=admin_headers()).json()
    last = next(w["last"] for w in listed["webhooks"] if w["format"] == "json")
    tries = flaky.events().count("run.completed")  # 1, or 2 when it drew a 500
    assert (last["event"], last["attempts"], last["status"]) == ("run.completed", tries, 204)
    assert all(w["secret"] is None for w in listed["webhooks"])
    # the slack-shaped one: a text, signed the same way (it hangs: nothing was answered)
    assert set(verify(made["slack"]["secret"], hung.got[0])) == {"text"}


@pytest.fixture(scope="module")
def plain_run(server) -> str:
    """A run on the module's server (no webhook allowance), and a token without a role."""
    with server.client() as http:
        return str(create_run(http, server_run_config())["id"])


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/hook",  # loopback
        "http://localhost:9/hook",  # a name that resolves to loopback
        "http://10.1.2.3/hook",  # private
        "http://192.168.0.10/hook",
        "http://169.254.169.254/latest/meta-data",  # the cloud metadata address
        "http://[::1]/hook",
        "http://[::ffff:127.0.0.1]/hook",  # IPv4 inside IPv6
        "http://100.64.0.1/hook",  # carrier-grade NAT
        "http://0.0.0.0/hook",
        "ftp://example.org/hook",
        "http://user:secret@example.org/hook",  # credentials
        "http:///hook",
        "http://example.org/hook#x",
        "http://no-such-host.invalid/hook",
    ],
)
def test_without_the_operators_allowance_internal_and_bad_urls_are_refused(http, plain_run, url):
    owner_token = register(http, "hook-owner")
    run_id = plain_run

    r = http.post(f"{API}/runs/{run_id}/webhooks", json={"url": url}, headers=admin_headers())

    assert r.status_code == 422 and r.json()["error"] == "invalid_request", r.text
    assert r.json()["detail"].startswith("url: ")
    listed = http.get(f"{API}/runs/{run_id}/webhooks", headers=admin_headers()).json()
    assert listed["webhooks"] == []
    # and a contributor without the owner role cannot set one at all
    r = http.post(f"{API}/runs/{run_id}/webhooks", json={"url": url}, headers=auth(owner_token))
    assert r.status_code == 403


def test_the_address_is_checked_again_at_delivery():
    # a webhook set while its name resolved elsewhere, delivered once it resolves to loopback
    outcome = asyncio.run(send("http://localhost:9/hook", b"{}", {}, allowed=(), timeout_s=2))

    assert outcome.status is None and outcome.error is not None
    assert (
        outcome.error.startswith("refused: localhost resolves to") and "loopback" in outcome.error
    )


def test_forbidden_ranges_and_the_signature():
    public = ["93.184.216.34", "2606:4700::1111", "8.8.8.8"]
    internal = ["127.0.0.5", "10.0.0.1", "172.16.3.4", "192.168.1.1", "169.254.169.254",
                "100.100.0.1", "fe80::1", "fd00::1", "::ffff:10.0.0.1", "224.0.0.1",
                "::"]  # fmt: skip

    assert [addresses.forbidden(ipaddress.ip_address(a)) for a in public] == [None] * 3
    assert all(addresses.forbidden(ipaddress.ip_address(a)) for a in internal)
    assert addresses.networks("127.0.0.0/8, 10.0.0.0/8") == (
        ipaddress.ip_network("127.0.0.0/8"),
        ipaddress.ip_network("10.0.0.0/8"),
    )
    sig = signature("k", 1700000000, b'{"a":1}')
    assert (
        sig
        == "t=1700000000,sha256="
        + hmac.new(b"k", b'1700000000.{"a":1}', hashlib.sha256).hexdigest()
    )


def test_webhook_routes_are_the_owners_and_the_admins(http):
    run_id = create_run(http, server_run_config())["id"]
    plain = register(http, "not-an-owner")
    hub = http.post(
        f"{API}/webhooks",
        json={"url": "https://93.184.216.34/hook", "events": ["run.completed"]},
        headers=admin_headers(),
    )

    assert hub.status_code == 201 and hub.json()["run_id"] is None, hub.text
    assert len(hub.json()["secret"]) == 64
    assert http.get(f"{API}/webhooks", headers=auth(plain)).status_code == 403
    assert http.get(f"{API}/runs/{run_id}/webhooks", headers=auth(plain)).status_code == 403
    for bad in (
        {"url": "https://93.184.216.34/h", "events": ["run.exploded"]},
        {"url": "https://93.184.216.34/h", "events": []},
        {"url": "https://93.184.216.34/h", "format": "teams"},
        {"url": "https://93.184.216.34/h", "eval_rise": 1.0},
        {"url": "https://93.184.216.34/h", "secret": "mine"},
    ):
        r = http.post(f"{API}/runs/{run_id}/webhooks", json=bad, headers=admin_headers())
        assert r.status_code == 422, (bad, r.text)
    wid = hub.json()["id"]
    assert (
        http.delete(f"{API}/runs/{run_id}/webhooks/{wid}", headers=admin_headers()).status_code
        == 404
    )
    assert http.delete(f"{API}/webhooks/{wid}", headers=admin_headers()).status_code == 204
    assert http.get(f"{API}/webhooks", headers=admin_headers()).json()["webhooks"] == []


def test_a_round_stalled_below_quorum_is_told_once_per_extension(hooked_server, receivers):
    hook = Receiver()
    receivers.append(hook)
    http = httpx.Client(base_url=hooked_server.url, timeout=30)
    config = server_run_config(rounds={"quorum": 2, "timeout_s": 2, "max_extensions": 1})
    run_id = create_run(http, config)["id"]
    r = http.post(
        f"{API}/runs/{run_id}/webhooks",
        json={"url": hook.url, "events": ["round.stalled"]},
        headers=admin_headers(),
    )
    assert r.status_code == 201, r.text

    wait_for(lambda: len(hook.got) >= 1, timeout=60, what="the stall to be told")

    body = verify(r.json()["secret"], hook.got[0])
    assert body["event"] == "round.stalled" and body["data"]["round"] == 1
    assert body["data"]["extensions"] == 1 and "quorum" in body["data"]["reason"]
    assert http.get(f"{API}/runs/{run_id}").json()["current_round"]["index"] == 1


def test_a_version_whose_eval_rises_past_the_bound_is_told(hooked_server, receivers, database_url):
    # Prepare: a run whose round 1 closed (version 1); a webhook for eval.rising at 1.5x
    hook = Receiver()
    receivers.append(hook)
    http = httpx.Client(base_url=hooked_server.url, timeout=30)
    run_id = create_run(http, server_run_config(rounds={"quorum": 1}))["id"]
    r = http.post(
        f"{API}/runs/{run_id}/webhooks",
        json={"url": hook.url, "events": ["eval.rising"], "eval_rise": 1.5},
        headers=admin_headers(),
    )
    assert r.status_code == 201, r.text
    close_rounds(http, register(http, "riser"), run_id, 1)

    def version_zero_eval() -> float | None:
        return asyncio.run(_scalar(database_url, EVAL_OF_V0, run_id))

    wait_for(lambda: version_zero_eval() is not None, timeout=60, what="version 0's eval")
    best = version_zero_eval()
    assert best is not None

    # Execute: version 1's eval is recorded at 1.4x, then at 2x the best before it, as the
    # eval worker records a measured loss
    async def record(loss: float) -> None:
        engine = make_engine(database_url)
        try:
            await version_eval.record(
                make_sessionmaker(engine), run_id=run_id, version=1, loss=loss
            )
        finally:
            await engine.dispose()

    asyncio.run(record(1.4 * best))
    asyncio.run(record(2.0 * best))
    wait_for(lambda: len(hook.got) >= 1, timeout=60, what="the rise to be told")

    # Assert: told once, for the 2x, not for the 1.4x
    body = verify(r.json()["secret"], hook.got[0])
    assert body["event"] == "eval.rising" and len(hook.got) == 1
    assert body["data"]["version"] == 1 and body["data"]["best"] == pytest.approx(best)
    assert body["data"]["ratio"] == pytest.approx(2.0)


EVAL_OF_V0 = "SELECT eval_loss FROM checkpoints WHERE run_id = $1 AND version = 0"


async def _scalar(database_url: str, query: str, *args: Any) -> Any:
    conn = await asyncpg.connect(database_url.replace("+asyncpg", ""))
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()
