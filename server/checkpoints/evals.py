"""A version's eval loss: its parameters on the run's validation windows.

``server.rounds.version_eval`` measures each published version with it, off the round's
critical path, and fills the loss in on the checkpoint and the round that published it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diloco.config import RunConfig
from diloco.model.streamed import StreamedVersion
from diloco.train import evaluate
from server.runs import data as run_data
from server.storage.base import Storage


@torch.no_grad()
def evaluate_file(
    storage: Storage,
    *,
    run_id: str,
    cfg: RunConfig,
    params_path: Path,
    windows: int,
    delta_path: Path | None = None,
) -> float:
    """The eval loss of the parameters in ``params_path`` (stepped by the delta in
    ``delta_path``, when given) on the first ``windows`` eval windows of the run's validation
    data, a module's parameters in memory at a time (``diloco.model.streamed``: not a copy
    of the model). A version's full eval, here; the close's judge
    (``server.rounds.outer_step``) on ``[aggregation] judge_windows``, of a step whose
    parameters are not written yet."""
    val = run_data.load_val(storage, run_id, cfg, tokens=windows * cfg.model.block_size + 1)
    with StreamedVersion(cfg.model, params_path, delta_path) as version:
        return evaluate(
            version.model, val, block_size=cfg.model.block_size, max_windows=windows,
            device=torch.device("cpu"),
        )  # fmt: skip
