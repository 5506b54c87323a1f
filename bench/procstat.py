"""What the benches read of a process from /proc (Linux): its CPU seconds, those of the
processes under it (a server's fold process, an S3 server's forks), its memory."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process, all its threads (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime: fields 14, 15


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, theirs...), as /proc lists them now."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            for child in (task / "children").read_text().split():
                found += [int(child), *descendants(int(child))]
    return found


def tree_cpu_s(pid: int) -> dict[int, float]:
    """``proc_cpu_s`` of ``pid`` and of each live process under it, by pid."""
    cpu: dict[int, float] = {}
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):
            cpu[p] = proc_cpu_s(p)
    return cpu


def total_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and every live process under it."""
    return sum(tree_cpu_s(pid).values())


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    """A memory figure of /proc/<pid>/status in MiB (VmRSS, VmHWM...); nan if absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system
