"""A ``diloco serve``'s own figures, read back by the benches: its Prometheus ``/metrics``
and waits on them (``bench/transport.py``, ``server_round.py``, ``direct_transfers.py``)."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from bench.loopback import http_request

if TYPE_CHECKING:
    from bench.transport import DilocoServer


def metrics(server: DilocoServer) -> str:
    return http_request(server.port, "GET", "/metrics").body.decode()


def metric_sums(text: str, name: str) -> dict[str, float]:
    """``<name>_sum{stage="x"} v`` lines (or the unlabelled sum as key "")."""
    out = {}
    for m in re.finditer(rf'^{name}_sum(?:\{{\w+="(\w+)"\}})? (\S+)$', text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def metric_count(text: str, name: str) -> float:
    m = re.search(rf"^{name}_count (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def poll(check, timeout: float, what: str, every: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(every)
    raise SystemExit(f"timed out waiting for {what}")


def evals_done(server: DilocoServer, count: int) -> None:
    """Wait until the server has evaluated ``count`` versions (version 0's eval runs after
    run creation, on a thread of the server's: a figure taken meanwhile shares the CPU)."""
    poll(lambda: metric_count(metrics(server), "diloco_version_eval_seconds") >= count, 900,
         f"the eval of {count} version(s)")  # fmt: skip
