"""One ``diloco simulate`` run for a benchmark script: its config written beside its result,
run in a subprocess with one CPU thread, the result JSON cached under ``work_dir`` (a
second run of the script reuses it unless ``fresh``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# [model] lines: examples/demo.toml's model, and the toy a --quick smoke run trains instead
DEMO_MODEL = "n_layer = 2\nn_head = 4\nn_embd = 128\nblock_size = 128\n"
TOY_MODEL = "n_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\n"


def simulate_json(
    key: str, toml: str, flags: list[str], *, work_dir: Path, fresh: bool = False
) -> dict[str, Any]:
    """``diloco simulate WORK_DIR/KEY.toml FLAGS --threads 1 --quiet``'s result JSON."""
    out = work_dir / f"{key}.json"
    if out.exists() and not fresh:
        return dict(json.loads(out.read_text()))
    config = work_dir / f"{key}.toml"
    config.write_text(toml)
    partial = out.with_suffix(".tmp")
    cmd = [sys.executable, "-m", "client.cli", "simulate", str(config), *flags,
           "--threads", "1", "--quiet", "--out", str(partial)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    partial.rename(out)
    return dict(json.loads(out.read_text()))
