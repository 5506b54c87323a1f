"""Long-lived objects out of the garbage collector's sight.

A server process holds ~300k objects for as long as it lives (torch, the web stack, the ORM
mappers, and once it has built an optimizer, torch's ``torch._dynamo`` and sympy: ~130k
more). While the collector tracks them, every full collection pauses the event loop for
~250 ms, and under load one came every few seconds (bench/load.py saw them as its p99).
``gc.freeze`` moves what is alive into a generation the collector never scans, so its
collections take milliseconds.

``settle`` runs at start-up. Modules imported later are as long-lived: the close's outer
optimizer brings ``torch._dynamo`` in (torch imports it when an optimizer is built), and
creating a run builds its model, which imported ~150k objects more (parts of
``torch.distributed`` among them); left to the collector, they made each full collection
pause the event loop ~100 ms, every 10-30 s at 5,000 volunteers' heartbeats
(bench/load.py). So ``settle_if_imported`` settles again whenever more modules are loaded
than at the last settle: after each close, and every few seconds (``keep_settled``).
Importing all of it at start-up instead cost every server ~1 CPU-second, also those that
never close a round (an API-only process)."""

from __future__ import annotations

import asyncio
import gc
import sys

from sqlalchemy.orm import configure_mappers

KEEP_SETTLED_S = 5.0  # how often keep_settled looks for modules imported since
_settled_modules = 0  # len(sys.modules) at the last settle


def settle() -> None:
    """Collect, then freeze everything alive now (after the ORM mappers are configured)."""
    global _settled_modules
    configure_mappers()
    gc.collect()
    gc.freeze()
    _settled_modules = len(sys.modules)


def settle_if_imported() -> bool:
    """``settle`` again if modules were imported since the last settle; whether it did."""
    if len(sys.modules) > _settled_modules:
        settle()
        return True
    return False


async def keep_settled(every_s: float = KEEP_SETTLED_S) -> None:
    """``settle_if_imported`` every ``every_s`` seconds, for ever (one full collection for
    each batch of imports, then none)."""
    while True:
        await asyncio.sleep(every_s)
        settle_if_imported()
