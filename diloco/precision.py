"""Mixed precision for the inner loop: which dtype the forward pass runs in, and the
gradient scaler that fp16 needs.

- **bf16** autocast on a CUDA card that computes in bf16 natively (compute capability 8.0
  and later: Ampere, Ada, Hopper). Its range is fp32's, so no loss scaling.
- **fp16** autocast with a :class:`torch.amp.GradScaler` on older CUDA cards (Turing,
  Volta, Pascal), whose tensor cores do fp16 but not bf16: fp16's range is narrow, so the
  loss is multiplied by a scale before ``backward`` and the gradients divided by it again
  before clipping; a step whose gradients overflowed is skipped and the scale halved.
- **fp32** on the CPU (the default; ``--precision`` can ask for bf16 or fp16 there) and on
  Apple's MPS (the only choice there: mixed precision on MPS is refused with a sentence).

Parameters, AdamW's moments and the pseudo-gradient Δ stay fp32 in every case: autocast
only lowers the precision of the matrix products.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, cast

import torch

Precision = Literal["bf16", "fp16", "fp32"]
PRECISIONS: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32")
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(ValueError):
    """The precision asked for cannot run on this device."""


def cuda_has_bf16(device: torch.device) -> bool:
    """Native bf16 matrix products: compute capability 8.0 or later. (torch's
    ``is_bf16_supported`` also says yes where bf16 is only emulated, which is slower
    than fp16 on those cards.)"""
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8 and torch.cuda.is_bf16_supported(including_emulation=False)


def choose_precision(device: torch.device, asked: str = "auto") -> Precision:
    """``auto``: bf16 on CUDA cards that have it, fp16 on older CUDA cards, fp32 elsewhere.
    An explicit choice is checked against the device."""
    if asked not in PRECISIONS:
        raise PrecisionError(f"--precision must be one of {', '.join(PRECISIONS)}, not {asked!r}")
    if device.type == "cuda":
        bf16 = cuda_has_bf16(device)
        if asked == "auto":
            return "bf16" if bf16 else "fp16"
        if asked == "bf16" and not bf16:
            name = torch.cuda.get_device_name(device)
            raise PrecisionError(
                f"--precision bf16: {name} has no native bf16 (compute capability "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))} < 8.0); "
                "use --precision fp16 (with loss scaling) or auto"
            )
        return cast(Precision, asked)
    if device.type == "mps" and asked not in ("auto", "fp32"):
        raise PrecisionError(
            f"--precision {asked}: on Apple's MPS this client trains in fp32 (mixed precision "
            "there is not checked by our tests); use --precision auto or fp32"
        )
    return "fp32" if asked == "auto" else cast(Precision, asked)


@dataclass
class MixedPrecision:
    """Autocast and (for fp16) the gradient scaler for one trainer; the scaler's state
    lives as long as the trainer, as its scale adapts over steps."""

    precision: Precision
    device_type: str
    scaler: torch.amp.GradScaler | None = None

    @classmethod
    def for_device(cls, device: torch.device, precision: Precision) -> MixedPrecision:
        scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        return cls(precision, device.type, scaler)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.precision == "fp32":
            yield
            return
        with torch.autocast(self.device_type, dtype=DTYPES[self.precision]):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the gradients back to their true size (before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step; False when fp16 gradients overflowed and it was skipped."""
        if self.scaler is None:
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale  # the scale drops only after an overflow
