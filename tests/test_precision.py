"""The inner loop's precision and memory logic, on the CPU: gradient accumulation gives the
full batch's update, fp16 loss scaling skips overflowing steps and recovers, the choice of
precision per device, micro-batch sizing, MFU. (The CUDA path itself runs on a GPU
machine: docs/benchmarks.md, "The GPU path".)"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from client.gpu import Fit, flops_per_token, halvings, mfu, peak_flops
from client.training import LocalTrainer
from diloco.config import parse_config
from diloco.model.architectures import build_model
from diloco.precision import MixedPrecision, PrecisionError, choose_precision
from diloco.train import InnerTrainer, snapshot
from tests.test_client_unit import TINY, _global_params, _tiny_lease, never

CPU = torch.device("cpu")


def _trainer(micro_batch: int | None, precision: str = "fp32", *, batch: int = 6) -> InnerTrainer:
    cfg = parse_config(TINY | {"inner": TINY["inner"] | {"batch_size": batch}})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    return InnerTrainer(
        model, cfg.inner, total_steps=10, device=CPU, precision=precision, micro_batch=micro_batch
    )  # type: ignore[arg-type]


def _batches(batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        t = torch.randint(0, 256, (batch, 17), generator=gen)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _train(trainer: InnerTrainer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    it = iter(batches)
    return trainer.run(len(batches), start_step=0, next_batch=lambda: next(it)).losses


@pytest.mark.parametrize("micro", [1, 2, 4, 5])
def test_accumulated_micro_batches_give_the_full_batch_update(micro):
    batches = _batches(6, 3)
    whole, split = _trainer(None), _trainer(micro)
    whole_losses, split_losses = _train(whole, batches), _train(split, batches)

    assert split.accumulation(6) == math.ceil(6 / micro)
    assert split_losses == pytest.approx(whole_losses, rel=1e-5)
    a, b = snapshot(whole.model), snapshot(split.model)
    assert a.keys() == b.keys()
    for name in a:  # three AdamW steps later the parameters still agree
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4)
    moved = max(float((a[n] - p).abs().max()) for n, p in _start().items())
    assert moved > 1e-3  # the steps did move the model: the comparison means something


def _start() -> dict[str, torch.Tensor]:
    return snapshot(_trainer(None).model)


def test_fp16_with_loss_scaling_trains_like_fp32_and_skips_an_overflowing_step():
    batches = _batches(6, 4)
    ref, half = _trainer(None, "fp32"), _trainer(2, "fp16")
    assert half.amp.scaler is not None and ref.amp.scaler is None
    ref_losses, half_losses = _train(ref, batches), _train(half, batches)
    # fp16 matmuls: the same losses to fp16's precision, and no step skipped at this scale
    assert half_losses == pytest.approx(ref_losses, rel=2e-2)
    assert half.skipped_steps == 0

    # force an overflow: a scale so large the scaled fp16 gradients become inf
    half.amp.scaler.update(new_scale=2.0**24)  # type: ignore[union-attr]
    before = snapshot(half.model)
    _train(half, _batches(6, 1))
    after = snapshot(half.model)
    assert half.skipped_steps == 1
    assert all(torch.equal(before[n], after[n]) for n in before)  # the step was skipped
    assert half.amp.scaler.get_scale() == 2.0**23  # type: ignore[union-attr]  # halved
    # the scale keeps halving until the gradients fit fp16, then training goes on
    for extra in range(20):  # noqa: B007 (read after the loop)
        _train(half, _batches(6, 1))
        if any(not torch.equal(after[n], p) for n, p in snapshot(half.model).items()):
            break
    else:
        pytest.fail("fp16 training never recovered from the overflow")
    assert half.skipped_steps == 1 + extra and half.amp.scaler.get_scale() < 2.0**23  # type: ignore[union-attr]


def test_bf16_autocast_runs_the_matmuls_in_bf16_and_keeps_fp32_parameters():
    trainer = _trainer(3, "bf16")
    seen: list[torch.dtype] = []
    first = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    hook = first.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    losses = _train(trainer, _batches(6, 2))
    hook.remove()
    assert all(math.isfinite(x) for x in losses)
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert trainer.amp.scaler is None


def test_precision_is_chosen_per_device_and_checked():
    assert choose_precision(CPU) == "fp32"
    assert choose_precision(CPU, "fp16") == "fp16"
    with pytest.raises(PrecisionError, match="--precision must be one of"):
        choose_precision(CPU, "fp8")
    mps = torch.device("mps")
    assert choose_precision(mps) == "fp32" and choose_precision(mps, "fp32") == "fp32"
    with pytest.raises(PrecisionError, match="on Apple's MPS this client trains in fp32"):
        choose_precision(mps, "bf16")
    mp = MixedPrecision.for_device(CPU, "fp16")
    assert mp.scaler is not None and MixedPrecision.for_device(CPU, "bf16").scaler is None


def test_cuda_without_native_bf16_falls_back_to_fp16(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    assert choose_precision(cuda) == "fp16"  # emulated bf16 is not bf16
    with pytest.raises(PrecisionError, match="Tesla T4 has no native bf16"):
        choose_precision(cuda, "bf16")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert choose_precision(cuda) == "bf16"


def test_micro_batch_candidates_and_a_fixed_micro_batch():
    assert halvings(16) == [16, 8, 4, 2, 1]
    assert halvings(12) == [12, 6, 3, 2, 1]
    assert halvings(1) == [1]
    assert Fit.fixed(5, 16) == Fit(5, 4, None, None)
    assert Fit.fixed(64, 16) == Fit(16, 1, None, None)  # capped at the batch


def test_the_client_trains_a_lease_in_micro_batches_with_the_same_result():
    lease = _tiny_lease(TINY)
    shard = torch.randint(
        0, 256, (8, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    results = {}
    for micro in (None, 1):
        local = LocalTrainer(CPU, micro_batch=micro)
        local.prepare(copy.deepcopy(TINY))
        assert local.fit is not None
        res = local.train(lease, _global_params(), shard, on_step=lambda *a: None, stop=never)
        results[micro] = (res.losses, snapshot(local.trainer.model))  # type: ignore[union-attr]
        assert "cpu fp32" in local.describe()
    assert local.fit == Fit(1, 2, None, None) and "micro-batch 1 of 2 (2 passes" in local.describe()
    assert results[1][0] == pytest.approx(results[None][0], rel=1e-5)
    for name, p in results[None][1].items():
        torch.testing.assert_close(results[1][1][name], p, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="--micro-batch must be at least 1"):
        LocalTrainer(CPU, micro_batch=0)


def test_mfu_counts_six_flops_per_parameter_and_attention():
    cfg = parse_config(TINY).model
    per_token = flops_per_token(cfg, 1000)
    assert per_token == 6 * 1000 + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA GeForce RTX 4090") == 165e12
    assert peak_flops("cpu: AMD EPYC") is None
    assert mfu(1e6, 1e8, 1e15) == pytest.approx(0.1)
    assert mfu(1e6, 1e8, None) is None and mfu(1e6, 0.0, 1e15) is None
