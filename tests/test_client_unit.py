"""The volunteer client's pure parts: backoff, retries, credentials, lease parsing, devices,
exit codes and the local training step. No server: the integration tests start one."""

from __future__ import annotations

import asyncio
import copy
import json
import stat
import time
from typing import Any

import pytest
import torch

from client import credentials
from client.api import (
    ApiError,
    RetryPolicy,
    ServerAPI,
    ServerUnreachable,
    backoff_delay,
)
from client.cli.support import ExitStatus, exit_status_for
from client.credentials import Credentials, CredentialsError, ServerURLError
from client.http import retry_after
from client.lease import Lease, ProtocolError, parse_lease
from client.training import DeviceError, LocalTrainer, resolve_device
from diloco.config import ConfigError, parse_config
from diloco.data.text import DataError
from diloco.model.gpt import GPT
from diloco.train import parameters_of, snapshot
from diloco.wire.codec import codec_from_description
from diloco.wire.contribution import decode_contribution, encode_contribution

SHA = "ab" * 32

# the example lease of docs/api.md, with concrete values
LEASE_JSON: dict[str, Any] = {
    "lease_id": "lease_0123456789abcdef",
    "run_id": "run_0123456789ab",
    "round": 4,
    "base_version": 3,
    "checkpoint": {
        "version": 3,
        "url": "/api/v1/runs/run_0123456789ab/checkpoints/3",
        "sha256": SHA,
        "nbytes": 3400000,
    },
    "shard": {
        "index": 2,
        "url": "/api/v1/runs/run_0123456789ab/shards/2",
        "sha256": SHA,
        "nbytes": 131072,
        "chunk_len": 8192,
    },
    "config": {"name": "tiny", "data": {"path": "input.txt"}},
    "inner_steps": 50,
    "start_step": 150,
    "seed": 1234,
    "deadline": "2025-01-01T12:00:00+00:00",
    "lease_expires_at": "2025-01-01T11:00:30Z",
    "heartbeat_interval_s": 10,
    "max_upload_bytes": 1200000,
}


# ---------------------------------------------------------------- backoff and retries


def test_backoff_doubles_from_the_base_and_stops_at_the_cap():
    policy = RetryPolicy(base_delay_s=0.5, max_delay_s=4.0, jitter=0.0)

    delays = [backoff_delay(attempt, policy, rand=0.3) for attempt in range(1, 7)]

    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_jitter_shortens_a_delay_by_at_most_its_fraction():
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=60.0, jitter=0.5)

    assert backoff_delay(3, policy, rand=0.0) == 4.0
    assert backoff_delay(3, policy, rand=0.5) == 3.0  # 4 · (1 − 0.5 · 0.5)
    assert 2.0 < backoff_delay(3, policy, rand=0.999) < 2.01


def test_backoff_refuses_attempt_zero_and_rand_outside_the_unit_interval():
    with pytest.raises(ValueError, match="attempt counts from 1"):
        backoff_delay(0, RetryPolicy(), rand=0.0)
    with pytest.raises(ValueError, match="rand"):
        backoff_delay(1, RetryPolicy(), rand=1.0)
    with pytest.raises(ValueError, match="at least 1"):
        RetryPolicy(attempts=0)


def _count_tries(api: ServerAPI, error: Exception, *, idempotent: bool = True) -> tuple[int, str]:
    tries = 0

    async def attempt() -> None:
        nonlocal tries
        tries += 1
        raise error

    async def go() -> str:
        try:
            await api._with_retries("test call", attempt, idempotent=idempotent)
        except Exception as err:
            return type(err).__name__
        finally:
            await api.close()
        return "no error"

    outcome = asyncio.run(go())
    return tries, outcome


FAST = RetryPolicy(attempts=3, base_delay_s=0.001, max_delay_s=0.002, total_s=5.0)


def test_a_4xx_is_raised_at_once_and_a_5xx_is_retried_up_to_the_attempts():
    api = ServerAPI("http://localhost:1", retry=FAST)

    assert _count_tries(api, ApiError(404, "not_found", "no such run", {})) == (1, "ApiError")
    assert _count_tries(api, ApiError(409, "round_closed", "closed", {})) == (1, "ApiError")
    assert _count_tries(api, ApiError(500, "http_error", "boom", {})) == (3, "ApiError")
    assert _count_tries(api, TimeoutError()) == (3, "ServerUnreachable")


def test_a_429_is_waited_out_when_its_retry_after_fits_in_the_policy():
    api = ServerAPI("http://localhost:1", retry=FAST)

    def limited(wait: float | None) -> ApiError:
        return ApiError(429, "rate_limited", "too many", {}, retry_after_s=wait)

    # nothing was done: retried even when the call is not idempotent, up to the attempts
    assert _count_tries(api, limited(0.001), idempotent=False) == (3, "ApiError")
    # longer than the policy's total time: raised at once; no Retry-After: a plain 4xx
    assert _count_tries(api, limited(60.0)) == (1, "ApiError")
    assert _count_tries(api, limited(None)) == (1, "ApiError")


def test_retry_after_is_read_as_whole_seconds_only():
    assert retry_after("7") == 7.0 and retry_after(" 1 ") == 1.0
    for other in (None, "", "1.5", "-1", "¹", "Wed, 21 Oct 2015 07:28:00 GMT"):
        assert retry_after(other) is None, other


def test_a_call_that_may_have_acted_is_retried_only_on_503():
    api = ServerAPI("http://localhost:1", retry=FAST)

    assert _count_tries(api, ApiError(500, "x", "y", {}), idempotent=False) == (1, "ApiError")
    assert _count_tries(api, ApiError(503, "unavailable", "starting", {}), idempotent=False) == (
        3,
        "ApiError",
    )
    assert _count_tries(api, TimeoutError(), idempotent=False) == (1, "ServerUnreachable")


def test_a_stalled_or_refused_for_now_request_is_retried_even_if_it_may_have_acted():
    api = ServerAPI("http://localhost:1", retry=FAST)
    busy = ApiError(429, "too_many_uploads", "busy", {"retry_after_s": 0.001})

    assert _count_tries(api, busy, idempotent=False) == (3, "ApiError")
    assert _count_tries(api, ApiError(408, "request_timeout", "stalled", {})) == (3, "ApiError")


def test_a_429_waits_what_the_server_asks_and_never_an_hour():
    policy = RetryPolicy(attempts=3, base_delay_s=0.001, max_delay_s=0.01, total_s=5.0)
    api = ServerAPI("http://localhost:1", retry=policy)
    started = time.monotonic()

    tries = _count_tries(api, ApiError(429, "too_many_uploads", "busy", {"retry_after_s": 0.2}))

    assert tries == (3, "ApiError")
    assert time.monotonic() - started >= 0.4  # two waits of what it asked, past max_delay_s
    # asking for more than the policy's total time: raised at once, not waited for
    hour = ApiError(429, "too_many_uploads", "busy", {"retry_after_s": 3600})
    assert _count_tries(api, hour) == (1, "ApiError")


def test_lease_urls_resolve_against_the_server_root_and_its_path_prefix():
    api = ServerAPI("https://hub.example.org/diloco/")

    assert api.url("/runs") == "https://hub.example.org/diloco/api/v1/runs"
    assert api.url(LEASE_JSON["checkpoint"]["url"]) == (
        "https://hub.example.org/diloco/api/v1/runs/run_0123456789ab/checkpoints/3"
    )


# ---------------------------------------------------------------- credentials and cache


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        ("HTTP://LocalHost:8000/", "http://localhost:8000"),
        ("localhost:8000", "http://localhost:8000"),
        ("http://hub.example.org:80", "http://hub.example.org"),
        ("https://hub.example.org:443/api/v1/", "https://hub.example.org"),
        ("https://hub.example.org/diloco/", "https://hub.example.org/diloco"),
        (" http://[::1]:8000 ", "http://[::1]:8000"),
    ],
)
def test_server_urls_are_normalised_to_one_key_per_server(given, normal):
    assert credentials.normalize_server_url(given) == normal


@pytest.mark.parametrize("bad", ["", "ftp://host", "http://", "http://h/?x=1"])
def test_unusable_server_urls_are_refused_with_a_reason(bad):
    with pytest.raises(ServerURLError, match="server URL"):
        credentials.normalize_server_url(bad)


def test_credentials_are_written_0600_and_read_back_under_any_spelling_of_the_url(tmp_path):
    creds = Credentials(contributor_id="ctr_0123456789ab", name="ada", token="secret-token")
    other = Credentials(contributor_id="ctr_ba9876543210", name="bob", token="other")

    credentials.save_credentials("https://hub.example.org", other, tmp_path)
    path = credentials.save_credentials("HTTP://LocalHost:8000/", creds, tmp_path)

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert credentials.load_credentials("http://localhost:8000", tmp_path) == creds
    assert credentials.load_credentials("https://hub.example.org/", tmp_path) == other
    assert credentials.load_credentials("http://elsewhere", tmp_path) is None
    assert sorted(json.loads(path.read_text())) == [
        "http://localhost:8000",
        "https://hub.example.org",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["credentials.json"]  # no temp file left


def test_a_corrupt_credentials_file_is_reported_with_its_path(tmp_path):
    (tmp_path / "credentials.json").write_text("{not json")

    with pytest.raises(CredentialsError, match=r"credentials\.json.*delete it"):
        credentials.load_credentials("http://localhost:8000", tmp_path)


def test_config_and_cache_dirs_follow_the_overrides_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("DILOCO_CONFIG_DIR", raising=False)
    monkeypatch.delenv("DILOCO_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    assert credentials.config_dir() == tmp_path / "xdg-config" / "diloco"
    assert credentials.cache_dir() == tmp_path / "xdg-cache" / "diloco"

    monkeypatch.setenv("DILOCO_CONFIG_DIR", str(tmp_path / "mine"))
    assert credentials.config_dir() == tmp_path / "mine"


def test_cache_paths_are_content_addressed_and_refuse_unsafe_names(tmp_path):
    path = credentials.checkpoint_path("run_0123456789ab", 3, SHA, tmp_path)
    assert path == tmp_path / "runs" / "run_0123456789ab" / "checkpoints" / f"v3-{SHA}.safetensors"

    with pytest.raises(ProtocolError, match="safe file name"):
        credentials.shard_path("../../etc", 0, SHA, tmp_path)
    with pytest.raises(ProtocolError, match="sha256"):
        credentials.shard_path("run_0123456789ab", 0, "../x", tmp_path)


# ---------------------------------------------------------------- lease


def test_the_lease_of_the_api_docs_parses_into_typed_fields():
    lease = parse_lease(LEASE_JSON)

    assert (lease.round, lease.base_version, lease.start_step, lease.seed) == (4, 3, 150, 1234)
    assert lease.checkpoint.url.endswith("/checkpoints/3") and lease.shard.chunk_len == 8192
    assert lease.heartbeat_interval_s == 10.0 and isinstance(lease.heartbeat_interval_s, float)
    assert lease.deadline.tzinfo is not None and lease.lease_expires_at.tzinfo is not None


def test_a_lease_missing_a_field_names_it():
    data = copy.deepcopy(LEASE_JSON)
    del data["seed"]

    with pytest.raises(ProtocolError, match=r"lacks the field 'seed'.*upgrade the client"):
        parse_lease(data)
    data["seed"] = 1
    del data["shard"]["chunk_len"]
    with pytest.raises(ProtocolError, match="shard lacks the field 'chunk_len'"):
        parse_lease(data)


def test_a_lease_field_of_the_wrong_type_names_it():
    data = copy.deepcopy(LEASE_JSON)
    data["round"] = "four"

    with pytest.raises(ProtocolError, match=r"field 'round': .*integer.*\(got str 'four'\)"):
        parse_lease(data)


# ---------------------------------------------------------------- devices and exit codes


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks a CPU-only machine")
def test_auto_device_is_the_cpu_here_and_cuda_is_refused_with_a_hint():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.backends.mps.is_available():
        assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(DeviceError, match="must be one of"):
        resolve_device("tpu")


def test_errors_map_to_the_documented_exit_codes():
    assert exit_status_for(ApiError(404, "not_found", "x", {})) == ExitStatus.REFUSED == 4
    assert exit_status_for(ApiError(503, "unavailable", "x", {})) == ExitStatus.UNREACHABLE == 5
    assert exit_status_for(ServerUnreachable("x")) == 5
    assert exit_status_for(ConfigError("inner.lr: x")) == ExitStatus.USAGE == 2
    assert exit_status_for(DeviceError("x")) == 2
    assert exit_status_for(DataError("x")) == ExitStatus.DATA == 3
    assert exit_status_for(RuntimeError("a bug")) is None


# ---------------------------------------------------------------- the local training step


def _tiny_lease(corpus_cfg: dict[str, Any], **changes: Any) -> Lease:
    data = copy.deepcopy(LEASE_JSON) | {"config": corpus_cfg, "inner_steps": 2, "start_step": 0}
    return parse_lease(data | changes)


TINY = {
    "name": "tiny",
    "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
    "data": {"path": "input.txt"},
    "inner": {"steps": 2, "batch_size": 2, "lr": 3e-3, "warmup_steps": 0},
    "compression": {"kind": "int8", "block_size": 256},
}


def never() -> bool:
    return False


def ignore(done: int, loss: float, tokens: int) -> None:
    pass


def _global_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return snapshot(GPT(parse_config(TINY).model.gpt_config()))


def test_a_contribution_is_old_minus_new_and_decodes_with_the_lease_header():
    local = LocalTrainer(torch.device("cpu"))
    local.prepare(TINY)
    lease = _tiny_lease(TINY)
    params = _global_params()
    shard = torch.randint(0, 256, (4, 64), dtype=torch.uint8)
    steps: list[int] = []

    result = local.train(
        lease, params, shard, on_step=lambda done, loss, tokens: steps.append(done), stop=never
    )
    body = local.contribution(lease, params, result)
    new = {n: p.detach() for n, p in parameters_of(local.trainer.model).items()}  # type: ignore[union-attr]
    chunks = list(encode_contribution(body.meta, body.tensors, chunk_size=4096))
    meta, decoded = decode_contribution(chunks, codec=body.meta.codec)

    assert steps == [1, 2] and sum(map(len, chunks)) == body.nbytes
    assert (meta.run_id, meta.round, meta.base_version) == ("run_0123456789ab", 4, 3)
    assert meta.tokens == 2 * 2 * 16 and meta.inner_steps == 2
    codec = codec_from_description(meta.codec)
    for name, enc in decoded.items():
        delta = codec.decode(enc).view(params[name].shape)
        torch.testing.assert_close(delta, params[name] - new[name], atol=2e-3, rtol=0.0)


def test_the_optimizer_survives_rounds_of_one_config_and_is_rebuilt_when_it_changes():
    local = LocalTrainer(torch.device("cpu"))
    _, built = local.prepare(TINY)
    trainer = local.trainer
    shard = torch.zeros(4, 64, dtype=torch.uint8)
    local.train(_tiny_lease(TINY), _global_params(), shard, on_step=ignore, stop=never)

    _, again = local.prepare(copy.deepcopy(TINY))
    assert built and not again and local.trainer is trainer
    assert local.trainer.optimizer.state  # AdamW moments carried into the next round
    _, rebuilt = local.prepare(TINY | {"inner": TINY["inner"] | {"lr": 1e-3}})
    assert rebuilt and local.trainer is not trainer


def test_an_invalid_config_from_the_server_is_a_protocol_error_naming_the_key():
    with pytest.raises(ProtocolError, match=r"inner\.lr"):
        LocalTrainer(torch.device("cpu")).prepare(TINY | {"inner": {"lr": 5.0}})


def test_pruning_keeps_the_newest_checkpoint_and_the_one_before(tmp_path):
    for version in range(4):
        path = credentials.checkpoint_path("run_0123456789ab", version, SHA, tmp_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")

    removed = credentials.prune_checkpoints("run_0123456789ab", 3, tmp_path)

    assert sorted(p.name[:2] for p in removed) == ["v0", "v1"]
    assert sorted(p.name[:2] for p in path.parent.iterdir()) == ["v2", "v3"]
