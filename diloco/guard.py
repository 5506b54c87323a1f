"""Commit or discard: an outer step is published only when ``judge_step`` says so.

``guarded_step`` aggregates the round's contributions, applies the outer step to a fresh
optimizer at the base version, evaluates the result, and asks the protocol's
``judge_step``. A step that is not finite or raises the eval loss too far is discarded,
and tried again without the contribution farthest from the round's aggregate (the largest
‖Δᵢ − v‖: one that a plain mean follows, like a scaled update, is still the farthest from
the others), as long as the others make quorum. When
nothing is wrong this costs nothing more than the eval the round needs anyway.

The server (``server.rounds.outer_step``) and the simulator call it alike; only where the
base version and the contributions come from differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from diloco.outer import OuterOptimizer
from diloco.protocol.rules import judge_step
from diloco.protocol.state import StepVerdict
from diloco.robust import Aggregate, Source

Params = Mapping[str, torch.Tensor]


@dataclass
class Stepped:
    outer: OuterOptimizer  # the optimizer after the last step tried (published if not rejected)
    aggregate: Aggregate
    update_norm: float
    eval_loss: float | None
    left_out: dict[str, str] = field(default_factory=dict)  # source id -> why the guard did
    rejected: StepVerdict | None = None  # set when no step could be published


def finite(outer: OuterOptimizer) -> bool:
    """Every parameter and momentum buffer is finite."""
    tensors = list(outer.params.values())
    for state in outer.sgd.state.values():
        if isinstance(buffer := state.get("momentum_buffer"), torch.Tensor):
            tensors.append(buffer)
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def guarded_step(
    sources: Sequence[Source],
    *,
    start: Callable[[], OuterOptimizer],
    aggregate: Callable[[Sequence[Source]], Aggregate],
    evaluate: Callable[[Params], float],
    base_loss: float | None,
    max_loss_ratio: float,
    quorum: int,
    lr: float | None = None,
    hit: Callable[[str], None] = lambda point: None,
) -> Stepped:
    """The round's outer step (at ``lr``, the round's), judged; ``start`` makes a fresh
    optimizer at the base version (each try starts from it), ``hit`` passes the fault points
    of a close."""
    left_out: dict[str, str] = {}
    while True:
        kept = [s for s in sources if s.id not in left_out]
        agg = aggregate(kept)
        hit("close.aggregate")
        outer = start()
        update_norm = outer.step(agg.delta, lr=lr)
        hit("close.step")
        ok = finite(outer)
        loss = evaluate(outer.params) if ok else None
        hit("close.eval")
        verdict = judge_step(base_loss, loss, finite=ok, max_loss_ratio=max_loss_ratio)
        if verdict.ok:
            return Stepped(outer, agg, update_norm, loss, left_out)
        if len(kept) - 1 < quorum:
            return Stepped(outer, agg, update_norm, loss, left_out, rejected=verdict)
        culprit = max(kept, key=lambda s: agg.shares[s.id].distance)
        left_out[culprit.id] = f"the step with it was discarded ({verdict.reason})"
