"""``diloco doctor``'s dry run: the micro-batch that fits the device, then real AdamW
steps at the run's model and batch size on random tokens, timed (tokens/s, MFU, peak
memory). No server, no data."""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from client.gpu import (
    Fit,
    device_peak_flops,
    flops_per_token,
    mfu,
    random_batches,
    size_micro_batch,
)
from diloco.config import RunConfig
from diloco.model.architectures import build_model
from diloco.precision import Precision
from diloco.train import InnerTrainer


@dataclass(frozen=True)
class DryRun:
    step_s: float
    tokens_per_s: float
    peak_bytes: int | None
    precision: Precision
    fit: Fit  # the micro-batch the steps ran at
    mfu: float | None  # None: no peak figure for this device (CPU, MPS, an unknown card)


def dry_run(
    cfg: RunConfig,
    device: torch.device,
    *,
    precision: Precision,
    micro_batch: int | None = None,
    memory_limit: int | None = None,
    steps: int = 3,
) -> DryRun:
    """Size the micro-batch to the device (``client.gpu.fit_micro_batch``, unless given),
    then one warm-up and ``steps`` timed AdamW steps at the run's model and batch size, on
    random tokens (no data needed). DoesNotFit when one sequence does not fit."""
    batch = cfg.inner.batch_size
    fit = size_micro_batch(
        cfg, device, precision, micro_batch=micro_batch, memory_limit=memory_limit
    )
    model = build_model(cfg.model)
    per_token = flops_per_token(cfg.model, model.num_parameters())
    trainer = InnerTrainer(
        model,
        cfg.inner,
        total_steps=max(steps + 1, 2),
        device=device,
        precision=precision,
        micro_batch=fit.micro_batch,
    )
    next_batch = random_batches(cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.run(1, start_step=0, next_batch=next_batch)  # warm-up: allocation, kernels
    times: list[float] = []

    def timed(i: int, loss: float) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter())

    started = time.perf_counter()
    trainer.run(steps, start_step=1, next_batch=next_batch, on_step=timed)
    laps = [b - a for a, b in zip([started, *times[:-1]], times, strict=True)]
    step_s = statistics.median(laps)
    if device.type == "cuda":
        peak: int | None = int(torch.cuda.max_memory_allocated(device))
    else:  # the process's peak RSS (Linux reports KiB, macOS bytes)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = rss if sys.platform == "darwin" else rss * 1024
    rate = batch * cfg.model.block_size / step_s
    return DryRun(
        step_s, rate, peak, precision, fit, mfu(rate, per_token, device_peak_flops(device))
    )
