"""A version's eval loss: its parameters on the run's validation windows.

``server.rounds.version_eval`` measures each published version with it, off the round's
critical path, and fills the loss in on the checkpoint and the round that published it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diloco.architectures import build_model
from diloco.config import RunConfig
from diloco.tensorfile import TensorFileReader
from diloco.train import evaluate, parameters_of
from server.runs import data as run_data
from server.storage import Storage


@torch.no_grad()
def evaluate_file(
    storage: Storage, *, run_id: str, cfg: RunConfig, params_path: Path, windows: int
) -> float:
    """The eval loss of the parameters in ``params_path``, read straight into the model's
    own memory (one copy of the model)."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device="cpu")
    model.tie_weights()
    with TensorFileReader(params_path) as f:
        for name, p in parameters_of(model).items():
            f.read_into(name, 0, p.data.view(-1))
    val = run_data.load_val(storage, run_id, cfg, tokens=windows * cfg.model.block_size + 1)
    return evaluate(model, val, block_size=cfg.model.block_size, max_windows=windows)
