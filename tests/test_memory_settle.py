"""server/upkeep/memory.py: what a server holds for good is frozen out of the collector's
sight at start-up, and once more whenever modules were imported since (the first close
brings torch._dynamo in, a run's creation its model's modules)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from server.upkeep import memory

from .support.cli import REPO


def test_start_up_freezes_without_importing_torch_dynamo() -> None:
    code = (
        "import gc, sys\n"
        "from server.app import create_app\n"
        "from server.upkeep import memory\n"
        "memory.settle()\n"
        "print(gc.get_freeze_count() > 10_000, 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


def test_an_import_since_the_last_settle_settles_again_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo
    monkeypatch.setattr(memory, "_settled_modules", len(sys.modules) - 1)  # as if settled before
    before = gc.get_freeze_count()
    garbage = [object() for _ in range(1000)]
    assert memory.settle_if_imported()
    assert gc.get_freeze_count() >= before + len(garbage)
    after = gc.get_freeze_count()
    garbage += [object() for _ in range(1000)]
    assert not memory.settle_if_imported()  # nothing imported since: nothing more frozen
    assert gc.get_freeze_count() == after


def test_keep_settled_settles_after_a_lazy_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    monkeypatch.setattr(memory, "_settled_modules", len(sys.modules) - 1)
    settled: list[bool] = []
    monkeypatch.setattr(memory, "settle", lambda: settled.append(True))

    async def two_looks() -> None:
        task = asyncio.create_task(memory.keep_settled(every_s=0.01))
        while not settled:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(two_looks(), timeout=30))
    assert settled  # it looked, found the import and settled
