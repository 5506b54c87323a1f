"""The inner AdamW state on disk: a restarted volunteer continues bit for bit as if it had
never stopped, and a state file for another run, config or model is refused. Plus the pure
judgements of ``diloco doctor`` and the hardware summary."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from client.doctor import (
    assess_device,
    assess_round_time,
    assess_transfer,
    assess_versions,
)
from client.dry_run import dry_run
from client.hardware import describe
from client.optimizer_state import OptimizerStateError, load_state
from client.training import LocalTrainer
from diloco.config import parse_config
from diloco.protocol.messages import Hardware
from tests.test_client_unit import TINY, _global_params, _tiny_lease, never

RUN = "run_0123456789ab"


def _shard() -> torch.Tensor:
    return torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1)).to(
        torch.uint8
    )


def _round(local: LocalTrainer, round_: int, start_step: int) -> dict[str, torch.Tensor]:
    lease = _tiny_lease(TINY, round=round_, start_step=start_step, seed=round_)
    local.train(lease, _global_params(), _shard(), on_step=lambda *a: None, stop=never)
    return {n: p.detach().clone() for n, p in local.trainer.model.named_parameters()}  # type: ignore[union-attr]


@pytest.mark.parametrize("reset", [True, False])  # [inner] reset_momentum
def test_a_restart_from_the_saved_state_continues_bit_for_bit(tmp_path, reset):
    path, config = tmp_path / "adamw.safetensors", copy.deepcopy(TINY)
    config["inner"] = {**config["inner"], "reset_momentum": reset}
    torch.manual_seed(0)
    steady = LocalTrainer(torch.device("cpu"))
    steady.prepare(config)
    _round(steady, 1, 0)
    steady.save_state(path, run_id=RUN, round=1)
    expected = _round(steady, 2, 2)

    torch.manual_seed(123)  # another process: other initial weights, fresh AdamW
    restarted = LocalTrainer(torch.device("cpu"))
    restarted.prepare(copy.deepcopy(config))
    saved = restarted.restore_state(path, run_id=RUN)
    got = _round(restarted, 2, 2)

    assert (saved.steps, saved.round) == (2, 1)
    assert restarted.steps_taken == steady.steps_taken == 4
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # the file: no exp_avg where every lease zeroes it (half the moments' bytes), else all
    names = set(load_file(str(path)))
    assert any(n.endswith(".exp_avg_sq") for n in names)
    assert any(n.endswith(".exp_avg") for n in names) is (not reset)
    assert _metadata(path)["first_moment"] == ("zero" if reset else "kept")


def test_without_the_saved_state_the_next_round_differs(tmp_path):
    """The check above can fail: a fresh AdamW does not reproduce the steady trainer."""
    steady = LocalTrainer(torch.device("cpu"))
    steady.prepare(TINY)
    _round(steady, 1, 0)
    expected = _round(steady, 2, 2)
    fresh = LocalTrainer(torch.device("cpu"))
    fresh.prepare(TINY)
    got = _round(fresh, 2, 2)
    assert any(not torch.equal(got[n], expected[n]) for n in expected)


@pytest.fixture
def saved(tmp_path):
    local = LocalTrainer(torch.device("cpu"))
    local.prepare(TINY)
    _round(local, 1, 0)
    return local.save_state(tmp_path / "adamw.safetensors", run_id=RUN, round=1)


def _fresh(config=TINY) -> LocalTrainer:
    local = LocalTrainer(torch.device("cpu"))
    local.prepare(config)
    return local


@pytest.mark.parametrize(
    ("run_id", "config", "match"),
    [
        ("run_ffffffffffff", TINY, "another run"),
        (RUN, TINY | {"inner": TINY["inner"] | {"lr": 1e-4}}, "another run or run config"),
    ],
)
def test_a_state_for_another_run_or_config_is_refused(saved, run_id, config, match):
    local = _fresh(config)
    with pytest.raises(OptimizerStateError, match=match):
        local.restore_state(saved, run_id=run_id)
    assert not local.trainer.optimizer.state  # type: ignore[union-attr]


def test_a_state_for_another_model_is_refused_even_with_a_matching_key(saved):
    wider = TINY | {"model": TINY["model"] | {"n_embd": 64}}
    local = _fresh(wider)
    trainer = local.trainer
    with pytest.raises(OptimizerStateError, match="other parameters"):
        load_state(saved, trainer.model, trainer.optimizer, run_id=RUN, config_key=_key(saved))  # type: ignore[union-attr]


def _metadata(path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata())


def _key(path) -> str:
    return _metadata(path)["config_key"]


def test_a_damaged_or_reshaped_state_file_is_refused_with_a_reason(saved):
    local = _fresh()
    saved.write_bytes(saved.read_bytes()[:100])
    with pytest.raises(OptimizerStateError, match="does not read"):
        local.restore_state(saved, run_id=RUN)


def test_a_state_tensor_of_the_wrong_shape_is_refused(saved):
    meta = _metadata(saved)
    tensors = load_file(str(saved))
    key = next(k for k in tensors if k.endswith("exp_avg_sq"))
    tensors[key] = torch.zeros(3)
    save_file(tensors, str(saved), metadata=meta)
    with pytest.raises(OptimizerStateError, match="wrong shape"):
        _fresh().restore_state(saved, run_id=RUN)


def test_the_state_file_is_safetensors_with_readable_metadata(saved):
    meta = _metadata(saved)
    assert meta["format"] == "diloco-adamw/1" and meta["run_id"] == RUN
    assert meta["steps"] == "2" and meta["round"] == "1"
    names = [n for n, _ in json.loads(meta["params"])]
    assert names and all(isinstance(n, str) for n in names)


# ---------------------------------------------------------------- doctor's judgements


@pytest.mark.parametrize(
    ("step_s", "steps", "timeout", "status"),
    [(0.1, 50, 600, "ok"), (0.1, 50, 9, "warn"), (0.1, 50, 4.9, "fail"), (1.0, 300, 600, "ok")],
)
def test_round_time_against_the_timeout(step_s, steps, timeout, status):
    verdict = assess_round_time(step_s, steps, timeout)
    assert verdict.status == status
    assert (verdict.advice is None) == (status == "ok")


def test_transfer_share_of_the_round():
    assert assess_transfer("download", 10e6, 10_000_000, 600).status == "ok"
    slow = assess_transfer("download", 1e5, 40_000_000, 600)
    assert slow.status == "warn" and "400 s" in (slow.advice or "")
    assert assess_transfer("upload", 1e4, 40_000_000, 600).status == "fail"


def test_device_and_version_advice():
    assert assess_device(torch.device("cuda"), True).status == "ok"
    cpu_build = assess_device(torch.device("cpu"), True)
    assert cpu_build.status == "warn" and "CPU build" in (cpu_build.advice or "")
    assert "no GPU" in (assess_device(torch.device("cpu"), False).advice or "")
    assert assess_versions("0.1.0", "0.1.0").status == "ok"
    assert "installer" in (assess_versions("0.1.0", "0.2.0").advice or "")


def test_dry_run_measures_a_real_step_at_the_run_size():
    cfg = parse_config(copy.deepcopy(TINY))
    res = dry_run(cfg, torch.device("cpu"), precision="fp32", steps=2)
    assert res.fit.micro_batch == cfg.inner.batch_size and res.fit.accumulation == 1
    assert res.mfu is None  # no peak figure for a CPU
    assert res.step_s > 0 and res.tokens_per_s == pytest.approx(
        cfg.inner.batch_size * cfg.model.block_size / res.step_s
    )
    assert res.peak_bytes is not None and res.peak_bytes > 0


def test_hardware_report_fits_the_server_bounds():
    hw = describe(torch.device("cpu"))
    report = hw.report()
    assert report["device"] == "cpu" and report["cpu_count"] >= 1
    assert Hardware.model_validate(report).report() == report  # what the server checks
    assert "cpu:" in hw.summary()


def test_a_hardware_report_with_overlong_names_is_cut_to_the_servers_bounds():
    long = describe(torch.device("cpu"))
    long = dataclasses.replace(
        long, device_name="G" * 300, os="L" * 200, client_version="1." * 40, memory_bytes=None
    )

    report = long.report()

    assert Hardware.model_validate(report).report() == report
    assert (len(report["device_name"]), len(report["os"]), len(report["client_version"])) == (
        128,
        128,
        32,
    )
    assert "memory_bytes" not in report  # unknown: left out, not sent as null


# ---------------------------------------------------------------- rejected contributions


def test_each_rejection_is_one_line_and_repeated_invalid_bodies_stop_the_worker(capsys):
    from client.api import ApiError, ServerAPI
    from client.progress import Reporter
    from client.uploading import Refused
    from client.worker import _Worker
    from client.worker_options import WorkerOptions
    from diloco.protocol.messages import ErrorCode
    from diloco.protocol.volunteer import MAX_INVALID_IN_A_ROW, Request

    worker = _Worker(
        WorkerOptions(server_url="http://127.0.0.1:9", device="cpu"),
        ServerAPI("http://127.0.0.1:9"),
        Reporter(quiet=True, bar=False),
    )
    late = ApiError(409, ErrorCode.ROUND_CLOSED, "round 3 is closed; the open round is 4", {})
    bad = ApiError(400, ErrorCode.WRONG_TENSORS, "tensor 'wte.weight' has shape (1, 2)", {})

    def answered(head: str, err: ApiError) -> None:  # as Uploader.send hands it on
        worker.uploads.reject(head, 100, Refused(err, worker.react.to(Request.UPLOAD, err)))

    for _ in range(5):  # the round moving on is normal: never fatal
        answered("round 3", late)
    for _ in range(MAX_INVALID_IN_A_ROW - 1):
        answered("round 4", bad)
    with pytest.raises(ApiError, match="refused 3 contributions in a row"):
        answered("round 5", bad)

    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5 + MAX_INVALID_IN_A_ROW  # one line each, even with --quiet
    assert lines[0] == (
        "round 3  upload 100 B  rejected: round_closed: round 3 is closed; the open round is 4"
    )
    assert lines[-1].endswith("rejected: wrong_tensors: tensor 'wte.weight' has shape (1, 2)")
    assert worker.summary.rejected == 5 + MAX_INVALID_IN_A_ROW


SPARSE = {**TINY, "compression": {"kind": "sparse", "chunk": 64, "topk": 4}}


def test_the_upload_codecs_residual_is_saved_with_the_state_and_restored(tmp_path):
    """A returning volunteer goes on from its error-feedback residual, restored exactly
    from the saved state; a new one starts from none (zeros)."""
    path = tmp_path / "adamw.safetensors"
    base = _global_params()
    torch.manual_seed(0)
    steady = LocalTrainer(torch.device("cpu"))
    steady.prepare(copy.deepcopy(SPARSE))
    lease = _tiny_lease(SPARSE, round=1, start_step=0, seed=1)
    result = steady.train(lease, base, _shard(), on_step=lambda *a: None, stop=never)
    steady.contribution(lease, base, result)
    assert steady.trainer is not None and steady.trainer.error_feedback is not None
    steady.save_state(path, run_id=RUN, round=1)
    residual = {n: t.clone() for n, t in steady.trainer.error_feedback.items()}

    restarted = LocalTrainer(torch.device("cpu"))
    restarted.prepare(copy.deepcopy(SPARSE))
    restarted.restore_state(path, run_id=RUN)
    fresh = LocalTrainer(torch.device("cpu"))
    fresh.prepare(copy.deepcopy(SPARSE))

    assert restarted.trainer is not None and restarted.trainer.error_feedback is not None
    assert residual.keys() == restarted.trainer.error_feedback.keys()
    assert all(torch.equal(residual[n], restarted.trainer.error_feedback[n]) for n in residual)
    assert fresh.trainer is not None and fresh.trainer.error_feedback is None
    assert any(bool(t.abs().sum() > 0) for t in residual.values())
