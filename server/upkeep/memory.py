"""Long-lived objects out of the garbage collector's sight.

A server process holds ~300k objects for as long as it lives (torch, the web stack, the ORM
mappers, and once it has built an optimizer, torch's ``torch._dynamo`` and sympy: ~130k
more). While the collector tracks them, every full collection pauses the event loop for
~250 ms, and under load one came every few seconds (bench/load.py saw them as its p99).
``gc.freeze`` moves what is alive into a generation the collector never scans, so its
collections take milliseconds.

``settle`` runs at start-up; ``settle_after_dynamo`` runs after each close and each eval and
settles again, once, when ``torch._dynamo`` has come in (torch imports it when an optimizer
or a model is built: a close's outer step, a version's eval, version 0's). Importing it at
start-up instead cost every server ~1 CPU-second, also those that never close a round (an
API-only process). Left unsettled after the first eval, its ~140k objects made a full
collection of ~140 ms land on whatever request was running, an upload as often as not."""

from __future__ import annotations

import gc
import sys

from sqlalchemy.orm import configure_mappers

_settled_with_dynamo = False


def settle() -> None:
    """Collect, then freeze everything alive now (after the ORM mappers are configured)."""
    global _settled_with_dynamo
    configure_mappers()
    gc.collect()
    gc.freeze()
    _settled_with_dynamo = "torch._dynamo" in sys.modules


def settle_after_dynamo() -> None:
    """``settle`` again if ``torch._dynamo`` was imported since the last settle; else nothing."""
    if not _settled_with_dynamo and "torch._dynamo" in sys.modules:
        settle()
