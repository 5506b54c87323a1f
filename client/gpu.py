"""Sizing a run to the volunteer's device: the micro-batch that fits its memory, and how
much of its compute a step uses (MFU).

``fit_micro_batch`` takes real AdamW steps at the run's model size on random tokens, the
whole batch first, then half of it, and so on down to one sequence, and keeps the first
that fits in ``HEADROOM`` of the card's memory; the inner loop then accumulates gradients
over ``batch_size / micro_batch`` passes (``diloco.train.InnerTrainer``), so a run's update
is the same on a 8 GB card as on an 80 GB one. Only CUDA is probed: on the CPU and MPS the
whole batch runs at once (``--micro-batch N`` sets it by hand anywhere).

MFU is model FLOPs per second over the card's dense bf16/fp16 tensor peak: 6 FLOPs per
parameter per token (forward and backward) plus attention's 12 x layers x width x context
(PaLM, appendix B), as nanoGPT counts it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diloco.config import ModelSection, RunConfig
from diloco.model.architectures import build_model
from diloco.precision import Precision
from diloco.train import InnerTrainer

HEADROOM = 0.9  # of the card's memory: what other processes and fragmentation may need

# dense (no sparsity) bf16/fp16 tensor-core peaks with fp32 accumulation, FLOP/s, from the
# vendors' data sheets; matched as lower-case substrings of the device name, first match
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("gh200", 989e12),
    ("a100", 312e12),
    ("l40s", 362e12),
    ("l40", 181e12),
    ("l4", 121e12),
    ("a10g", 70e12),
    ("a10", 125e12),
    ("rtx 4090", 165e12),
    ("rtx 4080", 97e12),
    ("rtx 4070", 58e12),
    ("rtx 3090", 71e12),
    ("rtx 3080", 60e12),
    ("rtx 3070", 41e12),
    ("rtx 3060", 26e12),
    ("v100", 125e12),
    ("t4", 65e12),
)


class DoesNotFit(RuntimeError):
    """Not even one sequence per pass fits the device's memory."""


def flops_per_token(model: ModelSection, n_params: int) -> float:
    """Training FLOPs per token: forward and backward through the weights and attention."""
    return 6.0 * n_params + 12.0 * model.n_layer * model.n_embd * model.block_size


def peak_flops(device_name: str) -> float | None:
    """The card's dense bf16/fp16 peak, or None for a card (or CPU) we have no figure for."""
    name = device_name.lower()
    return next((peak for key, peak in PEAK_FLOPS if key in name), None)


def device_peak_flops(device: torch.device) -> float | None:
    """The peak of the CUDA card torch trains on; None elsewhere (no MFU on CPU or MPS)."""
    return peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def mfu(tokens_per_s: float, per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the device's peak."""
    return None if peak is None or not per_token else tokens_per_s * per_token / peak


@dataclass(frozen=True)
class Fit:
    micro_batch: int  # sequences per forward/backward pass
    accumulation: int  # passes per AdamW step
    peak_bytes: int | None  # the device memory the step took at that micro-batch
    total_bytes: int | None  # the device's memory

    @classmethod
    def fixed(cls, micro_batch: int, batch_size: int) -> Fit:
        """A micro-batch set by hand (capped at the batch), nothing measured."""
        micro = min(micro_batch, batch_size)
        return cls(micro, -(-batch_size // micro), None, None)


def halvings(batch_size: int) -> list[int]:
    """The micro-batches to try, largest first: batch, ⌈batch/2⌉, ..., 1."""
    out = [batch_size]
    while out[-1] > 1:
        out.append((out[-1] + 1) // 2)
    return out


def random_batches(
    cfg: RunConfig, seed: int = 0
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Batches of random tokens at the run's shape: sizing needs no data."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = cfg.inner.batch_size, cfg.model.block_size

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, cfg.model.vocab, (rows, width + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    return batch


class MemoryLimitError(ValueError):
    """``--gpu-memory`` cannot apply to this device."""


def limit_memory(device: torch.device, gib: float | None) -> int | None:
    """Cap this process's share of a CUDA card at ``gib`` GiB (torch's allocator refuses to
    go past it): a volunteer who games on the same card keeps the rest. The cap in bytes,
    or None when no cap was asked for."""
    if gib is None:
        return None
    if device.type != "cuda":
        raise MemoryLimitError(f"--gpu-memory applies to a CUDA device, not {device.type}")
    total = int(torch.cuda.get_device_properties(device).total_memory)
    cap = int(gib * 2**30)
    if not 0 < cap <= total:
        raise MemoryLimitError(
            f"--gpu-memory {gib:g}: this card has {total / 2**30:.1f} GiB; ask for less"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    return cap


def fit_micro_batch(
    cfg: RunConfig,
    device: torch.device,
    precision: Precision,
    *,
    memory_limit: int | None = None,
    headroom: float = HEADROOM,
) -> Fit:
    """The largest micro-batch whose AdamW step fits in ``headroom`` of the device's memory
    (or of ``memory_limit``, from :func:`limit_memory`). DoesNotFit when one sequence does
    not; off CUDA, the whole batch (nothing to probe)."""
    batch = cfg.inner.batch_size
    if device.type != "cuda":
        return Fit(batch, 1, None, None)
    total = memory_limit or int(torch.cuda.get_device_properties(device).total_memory)
    trainer = InnerTrainer(
        build_model(cfg.model), cfg.inner, total_steps=2, device=device, precision=precision
    )
    next_batch = random_batches(cfg)
    try:
        for micro in halvings(batch):
            trainer.micro_batch = micro
            torch.cuda.reset_peak_memory_stats(device)
            try:
                trainer.run(1, start_step=0, next_batch=next_batch)
                torch.cuda.synchronize(device)
            except torch.cuda.OutOfMemoryError:
                trainer.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            peak = int(torch.cuda.max_memory_allocated(device))
            if peak <= headroom * total:
                return Fit(micro, trainer.accumulation(batch), peak, total)
        raise DoesNotFit(
            f"the run's model ({cfg.name}) does not fit in {headroom:.0%} of "
            f"{total / 2**30:.1f} GiB even one sequence at a time"
        )
    finally:
        del trainer
        gc.collect()
        torch.cuda.empty_cache()


def size_micro_batch(
    cfg: RunConfig,
    device: torch.device,
    precision: Precision,
    *,
    micro_batch: int | None,
    memory_limit: int | None = None,
) -> Fit:
    """``micro_batch`` when set by hand (``--micro-batch``), else :func:`fit_micro_batch`."""
    if micro_batch is not None:
        return Fit.fixed(micro_batch, cfg.inner.batch_size)
    return fit_micro_batch(cfg, device, precision, memory_limit=memory_limit)
