"""``diloco simulate`` runs for the benchmark scripts: each run is the CLI command itself
(``diloco simulate ARGS --threads 1 --quiet``) in a fresh process of its own, one CPU
thread each. The processes are forked from a server process that has already imported
torch and the CLI (``multiprocessing``'s forkserver), so a run pays for its own training
and not for ~3 CPU-seconds of imports: that is most of the cost of a ``--quick`` smoke run.
``simulate_json`` keeps the result JSON under ``work_dir`` (a second run of the script
reuses it unless ``fresh``)."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# [model] lines: examples/demo.toml's model, and the toy a --quick smoke run trains instead
DEMO_MODEL = "n_layer = 2\nn_head = 4\nn_embd = 128\nblock_size = 128\n"
TOY_MODEL = "n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\n"
# what every run imports; torch._dynamo comes with the first optimizer (~1 CPU-second)
PRELOAD = ["torch", "torch._dynamo", "client.cli.main", "diloco.simulate.run"]

_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ProcessPoolExecutor:
    """One pool per bench process; each task gets a new process (``max_tasks_per_child=1``),
    so no run sees another's state. Callers bound how many run at once (``--jobs``)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            os.environ["OMP_NUM_THREADS"] = "1"  # read when torch loads in the forkserver
            os.environ["MKL_NUM_THREADS"] = "1"
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _pool = ProcessPoolExecutor(
                max_workers=max(2, os.cpu_count() or 1), mp_context=context, max_tasks_per_child=1
            )
        return _pool


def _run_cli(args: list[str]) -> int:
    """In the child: ``diloco ARGS`` as the command line runs it, its output discarded."""
    from client.cli.main import app

    os.chdir(REPO)
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            status = app(args, prog_name="diloco", standalone_mode=False)
        except SystemExit as exit_:
            status = exit_.code
    return int(status or 0)


def run_simulate(config: Path, flags: list[str], out: Path) -> None:
    """``diloco simulate CONFIG FLAGS --threads 1 --quiet --out OUT``; raises if it fails."""
    args = ["simulate", str(config), *flags, "--threads", "1", "--quiet", "--out", str(out)]
    status = _executor().submit(_run_cli, args).result()
    if status != 0:
        raise RuntimeError(f"diloco {' '.join(args)} exited {status}")


def simulate_json(
    key: str, toml: str, flags: list[str], *, work_dir: Path, fresh: bool = False
) -> dict[str, Any]:
    """``diloco simulate WORK_DIR/KEY.toml FLAGS``'s result JSON (see ``run_simulate``)."""
    out = work_dir / f"{key}.json"
    if out.exists() and not fresh:
        return dict(json.loads(out.read_text()))
    config = work_dir / f"{key}.toml"
    config.write_text(toml)
    partial = out.with_suffix(".tmp")
    run_simulate(config, flags, partial)
    partial.rename(out)
    return dict(json.loads(out.read_text()))
