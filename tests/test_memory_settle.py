"""server/upkeep/memory.py: what a server holds for good is frozen out of the collector's
sight at start-up, and once more after the first close or eval brings torch._dynamo in."""

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


def test_the_first_optimizer_settles_again_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo
    monkeypatch.setattr(memory, "_settled_with_dynamo", False)  # as if settled before it
    before = gc.get_freeze_count()
    garbage = [object() for _ in range(1000)]
    memory.settle_after_dynamo()
    assert gc.get_freeze_count() >= before + len(garbage)
    after = gc.get_freeze_count()
    garbage += [object() for _ in range(1000)]
    memory.settle_after_dynamo()  # already settled with it: nothing more frozen
    assert gc.get_freeze_count() == after
