"""What this machine is: the device torch will train on, its memory, the CPU and RAM.

The worker reports it on the contributor's profile (``PATCH /contributors/me``) and
``diloco doctor`` prints it. Every field is best effort: an unknown value is None, never a
guess, and nothing here raises on an unusual platform.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as pkg_version
from typing import Any

import torch

from diloco.protocol import messages


@dataclass(frozen=True)
class Hardware:
    device: str  # cuda | mps | cpu
    device_name: str
    memory_bytes: int | None  # the accelerator's memory (None on the CPU)
    ram_bytes: int | None
    cpu_count: int | None
    os: str
    python: str
    torch: str
    client_version: str

    def report(self) -> dict[str, Any]:
        """The profile fields, with unknown ones left out and each string cut to the bound
        the server checks (``diloco.protocol.messages.Hardware``)."""
        return messages.Hardware.clipped(asdict(self)).report()

    def summary(self) -> str:
        memory = f", {self.memory_bytes / 2**30:.1f} GiB" if self.memory_bytes else ""
        ram = f"{self.ram_bytes / 2**30:.1f} GiB RAM" if self.ram_bytes else "RAM unknown"
        return (
            f"{self.device}: {self.device_name}{memory}; {self.cpu_count or '?'} CPUs, {ram}; "
            f"{self.os}, Python {self.python}, torch {self.torch}"
        )


def client_version() -> str:
    try:
        return pkg_version("diloco-hub")
    except PackageNotFoundError:
        return "unknown"


def ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX (Windows), or not reported
        return None


def _cpu_name() -> str:
    fallback = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:  # not Linux: platform's answer is all there is
        return fallback
    return names[0] if names else fallback


def describe(device: torch.device) -> Hardware:
    name, memory = _cpu_name(), None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory = props.name, int(props.total_memory)
    elif device.type == "mps":
        name = f"Apple GPU (MPS) on {platform.machine()}"
    return Hardware(
        device=device.type,
        device_name=name,
        memory_bytes=memory,
        ram_bytes=ram_bytes(),
        cpu_count=os.cpu_count(),
        os=platform.platform(terse=True),
        python=platform.python_version(),
        torch=torch.__version__,
        client_version=client_version(),
    )
