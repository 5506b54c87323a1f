"""The compute of a close: aggregate → outer step → eval → write the version's files.

It runs in a worker thread with no transaction, row lock or pooled connection held
(``server.rounds.closing`` claims before and publishes after). Given the same inputs it
writes the same bytes, so a close that a crash interrupts is simply done again.

A contribution whose stored blob cannot be read (missing, damaged: its trailer checksum
fails, it no longer decodes) is left out with the reason, and the sum is started over
without it; ``decide_after_exclusions`` then says whether the others still make a step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from diloco.codec import make_codec
from diloco.config import RunConfig
from diloco.exchange import aggregate_upload
from diloco.faults import FaultInjector
from diloco.model import GPT
from diloco.outer import AggregationError, Aggregator, OuterOptimizer
from diloco.protocol.rules import decide_after_exclusions
from diloco.protocol.state import Action, Decision
from diloco.train import evaluate, load_parameters
from diloco.wire import WireFormatError
from server.checkpoints import service as checkpoints_service
from server.runs import data as run_data
from server.storage import Storage

log = logging.getLogger("diloco.rounds")


@dataclass(frozen=True)
class StepInputs:
    run_id: str
    version: int  # the version this close publishes (= the round's index)
    cfg: RunConfig
    base_state_key: str  # the base version's state file (parameters + outer momentum)
    blobs: list[tuple[str, str]]  # (contribution id, blob key), in the order accepted
    quorum: int


@dataclass(frozen=True)
class OuterResult:
    excluded: dict[str, str]  # contribution id -> why it was left out
    # decide_after_exclusions' verdict when something was left out (None: nothing was)
    decision: Decision | None
    files: checkpoints_service.VersionFiles | None  # None: no step (below quorum)
    update_norm: float | None
    eval_loss: float | None
    seconds: dict[str, float]  # by stage: load, aggregate, step, eval, write


def apply_outer_step(
    storage: Storage, inputs: StepInputs, *, eval_windows: int, faults: FaultInjector
) -> OuterResult:
    """Read the base state, add the contributions one at a time (memory O(model)), step,
    evaluate on the validation split and write version ``inputs.version``."""
    clock = _StageClock()
    cfg = inputs.cfg
    base = checkpoints_service.load_checkpoint(storage.path(inputs.base_state_key))
    outer = OuterOptimizer(
        base.params, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov
    )
    if base.outer_state is not None:
        outer.load_state_dict(base.outer_state)
    clock.lap("load")
    aggregator, excluded = _aggregate(
        storage, inputs, {n: tuple(p.shape) for n, p in outer.params.items()}
    )
    decision = None
    if excluded:
        kept = len(inputs.blobs) - len(excluded)
        decision = decide_after_exclusions(
            inputs.version, kept=kept, excluded=excluded, quorum=inputs.quorum
        )
        if decision.action is not Action.CLOSE:
            return OuterResult(excluded, decision, None, None, None, clock.seconds)
    clock.lap("aggregate")
    faults.hit("close.aggregate")
    update_norm = outer.step(aggregator.result())
    clock.lap("step")
    faults.hit("close.step")
    model = GPT(cfg.model.gpt_config())
    load_parameters(model, outer.params)
    val = run_data.load_val(storage, inputs.run_id)
    eval_loss = evaluate(model, val, block_size=cfg.model.block_size, max_windows=eval_windows)
    clock.lap("eval")
    faults.hit("close.eval")
    files = checkpoints_service.write_version(
        storage,
        run_id=inputs.run_id,
        version=inputs.version,
        params=outer.params,
        outer_state=outer.state_dict(),
    )
    clock.lap("write")
    faults.hit("close.write")
    return OuterResult(excluded, decision, files, update_norm, eval_loss, clock.seconds)


def _aggregate(
    storage: Storage, inputs: StepInputs, shapes: dict[str, tuple[int, ...]]
) -> tuple[Aggregator, dict[str, str]]:
    """The token-weighted sum of every readable contribution, and why the others were left
    out. A failure midway leaves a partial sum, so the sum starts over without that one
    (the common case, nothing unreadable, reads each blob once)."""
    codec = make_codec(inputs.cfg.compression.kind, inputs.cfg.compression.block_size).describe()
    excluded: dict[str, str] = {}
    while True:
        aggregator = Aggregator(shapes)
        for contribution_id, key in inputs.blobs:
            if contribution_id in excluded:
                continue
            try:
                aggregate_upload(storage.read_chunks(key), aggregator, expected=shapes, codec=codec)
            except OSError as err:
                excluded[contribution_id] = f"its stored upload cannot be read: {err.strerror}"
            except (WireFormatError, AggregationError) as err:
                excluded[contribution_id] = f"its stored upload is damaged: {err}"
            else:
                continue
            log.warning(
                "run %s round %d: contribution %s left out: %s (blob %s)",
                inputs.run_id,
                inputs.version,
                contribution_id,
                excluded[contribution_id],
                key,
            )
            break
        else:
            return aggregator, excluded


class _StageClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self._last
        self._last = now
