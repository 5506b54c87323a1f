"""The compute of a close: robust aggregate → guarded outer step → eval → write the files.

It runs in a worker thread with no transaction, row lock or pooled connection held
(``server.rounds.closing`` claims before and publishes after). Given the same inputs it
writes the same bytes, so a close that a crash interrupts is simply done again.

- The contributions are read back from storage and combined as the run's
  ``[aggregation]`` says (``diloco.robust``: clipped to a multiple of the round's median
  norm by default), each weighted by the tokens it counts for.
- The step is judged before anything is written (``diloco.guard``): one that is not
  finite, or that raises the eval loss past ``max_loss_ratio`` times the base version's,
  is tried again without the least-aligned contribution; when no step passes with quorum,
  nothing is written and the close fails with ``StepRejected`` (recorded on the round,
  retried with backoff).
- A contribution whose stored blob cannot be read (missing, damaged: its trailer digest
  fails) is left out with the reason and the aggregate started over without it;
  ``decide_after_exclusions`` then says whether the others still make a step.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from diloco.codec import make_codec
from diloco.config import RunConfig
from diloco.faults import FaultInjector
from diloco.guard import guarded_step
from diloco.model import GPT
from diloco.outer import OuterOptimizer
from diloco.protocol.rules import decide_after_exclusions
from diloco.protocol.state import Action, Decision, StepVerdict
from diloco.robust import Aggregate, Share, Source, SourceUnreadable, robust_aggregate
from diloco.train import evaluate, load_parameters
from server.checkpoints import service as checkpoints_service
from server.runs import data as run_data
from server.storage import Storage

log = logging.getLogger("diloco.rounds")


@dataclass(frozen=True)
class Stored:
    """A contribution of the round as the close reads it."""

    id: str
    blob_key: str
    weight: float  # the tokens it counts for
    norm: float  # ‖Δ‖, measured when it was accepted


@dataclass(frozen=True)
class StepInputs:
    run_id: str
    version: int  # the version this close publishes (= the round's index)
    cfg: RunConfig
    base_state_key: str  # the base version's state file (parameters + outer momentum)
    base_eval_loss: float | None  # the base version's, when known (else measured here)
    contributions: list[Stored]  # in the order they were accepted
    history: list[float]  # norms of the run's latest aggregated contributions
    quorum: int


class StepRejected(Exception):
    """The guard discarded every step it could make with quorum: nothing is published."""

    def __init__(self, verdict: StepVerdict, left_out: Mapping[str, str]) -> None:
        tried = f"; left out {sorted(left_out)} first" if left_out else ""
        super().__init__(f"{verdict.reason}{tried}")
        self.verdict, self.left_out = verdict, dict(left_out)


@dataclass(frozen=True)
class OuterResult:
    excluded: dict[str, str]  # contribution id -> why it was left out (unreadable, guard)
    exclusion_codes: dict[str, str]  # contribution id -> blob_unreadable | guard
    # decide_after_exclusions' verdict when a blob was unreadable (None: none was)
    decision: Decision | None
    files: checkpoints_service.VersionFiles | None  # None: no step (below quorum)
    update_norm: float | None
    eval_loss: float | None
    base_eval_loss: float | None  # measured here when the inputs did not know it
    shares: dict[str, Share]  # what each aggregated contribution put in
    seconds: dict[str, float]  # by stage: load, aggregate, step, eval, write (tries added up)


def apply_outer_step(
    storage: Storage, inputs: StepInputs, *, eval_windows: int, faults: FaultInjector
) -> OuterResult:
    """Read the base state, aggregate, step under the guard, write ``inputs.version``."""
    clock = _StageClock()
    cfg = inputs.cfg
    base = checkpoints_service.load_checkpoint(storage.path(inputs.base_state_key))

    def start() -> OuterOptimizer:  # every step tried starts from the base version
        outer = OuterOptimizer(
            base.params, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov
        )
        if base.outer_state is not None:
            outer.load_state_dict(base.outer_state)
        return outer

    model, val = GPT(cfg.model.gpt_config()), run_data.load_val(storage, inputs.run_id)

    def evaluate_params(params: Mapping[str, torch.Tensor]) -> float:
        load_parameters(model, params)
        return evaluate(model, val, block_size=cfg.model.block_size, max_windows=eval_windows)

    base_loss = inputs.base_eval_loss
    measured_base = evaluate_params(base.params) if base_loss is None else None
    base_loss = base_loss if measured_base is None else measured_base
    clock.lap("load")

    shapes = {n: tuple(p.shape) for n, p in base.params.items()}
    codec = make_codec(cfg.compression.kind, cfg.compression.block_size).describe()
    sources = [
        Source(c.id, c.weight, c.norm, functools.partial(storage.read_chunks, c.blob_key))
        for c in inputs.contributions
    ]

    def aggregate(kept: Sequence[Source]) -> Aggregate:
        return robust_aggregate(
            kept, shapes=shapes, codec=codec, policy=cfg.aggregation, history=inputs.history
        )

    def passed(point: str) -> None:  # a stage of the close is done: time it, then faults
        clock.lap(point.removeprefix("close."))
        faults.hit(point)

    unreadable: dict[str, str] = {}
    decision = None
    while True:
        readable = [s for s in sources if s.id not in unreadable]
        if unreadable:
            decision = decide_after_exclusions(
                inputs.version, kept=len(readable), excluded=unreadable, quorum=inputs.quorum
            )
            if decision.action is not Action.CLOSE:
                codes = dict.fromkeys(unreadable, "blob_unreadable")
                return OuterResult(
                    unreadable, codes, decision, None, None, None, measured_base, {},
                    clock.seconds,
                )  # fmt: skip
        try:
            stepped = guarded_step(
                readable,
                start=start,
                aggregate=aggregate,
                evaluate=evaluate_params,
                base_loss=base_loss,
                max_loss_ratio=cfg.aggregation.max_loss_ratio,
                quorum=inputs.quorum,
                hit=passed,
            )
        except SourceUnreadable as err:
            unreadable[err.source_id] = err.reason
            log.warning("run %s round %d: %s", inputs.run_id, inputs.version, err)
            continue
        break
    if stepped.rejected is not None:
        raise StepRejected(stepped.rejected, stepped.left_out)
    files = checkpoints_service.write_version(
        storage,
        run_id=inputs.run_id,
        version=inputs.version,
        params=stepped.outer.params,
        outer_state=stepped.outer.state_dict(),
    )
    clock.lap("write")
    faults.hit("close.write")
    excluded = unreadable | stepped.left_out
    codes = dict.fromkeys(unreadable, "blob_unreadable") | dict.fromkeys(stepped.left_out, "guard")
    return OuterResult(
        excluded,
        codes,
        decision,
        files,
        stepped.update_norm,
        stepped.eval_loss,
        measured_base,
        stepped.aggregate.shares,
        clock.seconds,
    )


class _StageClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now
