"""``diloco doctor`` and ``diloco me`` as a volunteer runs them: real processes against a
real server, and against an address where nothing listens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from client.cli.volunteer import flops, render_profile
from client.measured_speed import load_speed
from diloco.protocol.reputation import counted_weight, standing
from tests.conftest import server_run_config
from tests.support.contribute import API, create_run
from tests.support.live import free_port


@pytest.fixture(scope="module")
def run_id(server) -> str:  # type: ignore[no-untyped-def]
    config = server_run_config(
        inner={"steps": 4}, rounds={"quorum": 1, "target": 1, "max_rounds": 2, "timeout_s": 300}
    )
    with httpx.Client(base_url=server.url, timeout=60) as http:
        return str(create_run(http, config)["id"])


def diloco(home: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {"DILOCO_CONFIG_DIR": str(home / "config"), "DILOCO_CACHE_DIR": str(home / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "client.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **env},
    )


def by_name(checks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in checks}


def test_doctor_measures_device_server_step_and_transfers(server, run_id, tmp_path):
    out = diloco(tmp_path, "doctor", server.url, "--run", run_id, "--probe-mb", "2", "--json")

    assert out.returncode == 0, out.stdout + out.stderr
    checks = by_name(json.loads(out.stdout))
    assert list(checks) == ["device", "server", "run", "dry run", "download", "upload"]
    assert all(c["status"] in ("ok", "warn") for c in checks.values()), checks
    assert checks["device"]["result"].startswith("cpu:")
    assert run_id in checks["run"]["result"]
    assert checks["dry run"]["figures"]["tokens_per_s"] > 0
    # the first `diloco join` will report the speed the dry run measured
    saved = load_speed(run_id, tmp_path / "cache")
    assert saved is not None and saved.applies_to("cpu", "fp32")
    assert saved.tokens_per_s == pytest.approx(checks["dry run"]["figures"]["tokens_per_s"])
    assert (saved.micro_batch, saved.batch_size) == (checks["dry run"]["figures"]["micro_batch"], 4)
    assert checks["download"]["figures"]["bytes_per_s"] > 0
    assert checks["upload"]["figures"]["bytes_per_s"] > 0


def test_doctor_text_output_names_each_check(server, run_id, tmp_path):
    out = diloco(tmp_path, "doctor", server.url, "--run", run_id, "--probe-mb", "1")

    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("device", "server", "run", "dry run", "download", "upload"):
        assert f" {name}: " in out.stdout, out.stdout
    assert "ready to join" in out.stdout


def test_doctor_against_no_server_fails_with_advice_and_still_checks_the_device(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    out = diloco(tmp_path, "doctor", url, "--json")

    assert out.returncode == 1, out.stdout + out.stderr
    checks = by_name(json.loads(out.stdout))
    assert checks["device"]["status"] in ("ok", "warn")
    assert checks["server"]["status"] == "fail"
    assert "firewall" in checks["server"]["advice"]
    assert {checks[n]["status"] for n in ("run", "dry run", "download", "upload")} == {"skip"}


def test_doctor_with_an_unknown_run_fails_that_check(server, tmp_path):
    out = diloco(tmp_path, "doctor", server.url, "--run", "run_000000000000", "--json")

    assert out.returncode == 1
    checks = by_name(json.loads(out.stdout))
    assert checks["run"]["status"] == "fail" and "run_not_found" in checks["run"]["result"]
    assert checks["dry run"]["status"] == "skip"


def test_me_shows_contributions_and_credit_after_a_round(server, run_id, tmp_path):
    joined = diloco(
        tmp_path, "join", server.url, "--run", run_id, "--name", "carol", "--max-rounds", "1",
        "--threads", "1", "--quiet",
    )  # fmt: skip
    assert joined.returncode == 0, joined.stderr[-2000:]

    out = diloco(tmp_path, "me", server.url, "--json")
    text = diloco(tmp_path, "me", server.url)

    assert out.returncode == 0, out.stderr
    me = json.loads(out.stdout)
    run = httpx.get(f"{server.url}{API}/runs/{run_id}").json()
    assert me["name"] == "carol" and me["hardware"]["device"] == "cpu"
    assert me["totals"]["accepted"] == me["totals"]["aggregated"] == 1
    # a new account's first contribution: its tokens at a new account's standing
    counted = counted_weight(me["totals"]["tokens"], 0, standing(0, 0))
    # credited by its step, and waiting for an audit of carol's work to confirm it (the run
    # audits: credit escrow, server.rounds.escrow); no verifier runs here
    assert me["totals"]["credit"] == 0
    assert me["totals"]["pending_credit"] == counted * 6 * run["n_params"] > 0
    assert me["recent"][0]["credit_status"] == "pending"
    assert text.returncode == 0 and "carol" in text.stdout and "credit" in text.stdout
    assert (
        f"credit 0 FLOP + {flops(me['totals']['pending_credit'])} pending an audit" in text.stdout
    )


def test_me_without_registration_says_how_to_register(server, tmp_path):
    out = diloco(tmp_path, "me", server.url)
    assert out.returncode == 2 and "diloco register" in out.stderr


def test_flops_and_profile_rendering():
    assert flops(6.1e15) == "6.10 PFLOP" and flops(2.5e9) == "2.50 GFLOP" and flops(12) == "12 FLOP"
    lines = render_profile({"name": "x[y]", "id": "ctr_1", "totals": {}, "hardware": None})
    assert "not reported yet" in lines[1] and "0 accepted" in lines[2]


def test_me_says_which_contributions_a_close_left_out_and_why():
    from rich.console import Console

    recent = [
        {"run_id": "run_1", "round": 3, "tokens": 10, "loss": 2.0, "aggregated": False,
         "credit": 0, "excluded": "copy: a near-copy of con_9 (|cosine| 1.0000 ≥ 0.99)"},
        {"run_id": "run_1", "round": 2, "tokens": 10, "loss": 2.0, "aggregated": True,
         "credit": 6e9, "excluded": None},
        {"run_id": "run_1", "round": 4, "tokens": 10, "loss": 2.0, "aggregated": False,
         "credit": 0, "excluded": None},
    ]  # fmt: skip
    lines = render_profile({"name": "v", "id": "ctr_1", "totals": {}, "recent": recent})
    console = Console(width=200, record=True)
    console.print(*lines)
    text = console.export_text()
    assert "left out: copy: a near-copy of con_9" in text
    assert "yes" in text and "not yet" in text
    quarantined = render_profile(
        {"name": "v", "id": "ctr_1", "totals": {}, "quarantined_at": "2026-11-28T02:00:00+00:00",
         "quarantine_reason": "3 of its last 5 judged contributions failed verification"}
    )  # fmt: skip
    assert sum("QUARANTINED since" in str(line) for line in quarantined) == 1
