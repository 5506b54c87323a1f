"""How many inner steps (H) one lease gets: sized to its volunteer's measured speed so that
the work is done before the round's deadline. A pure function of (now, deadline, speed,
bounds), as the rules in ``diloco.protocol.rules``; the server's join
(``server.rounds.leases``) and the simulator's hub (``diloco.simulate.hub``) both call it.

    usable_s = (deadline − now − TRANSFER_MARGIN_S) × SPEED_SAFETY
    H        = clamp(floor(tokens_per_s × usable_s / tokens_per_step), min_steps, max_steps)

- ``TRANSFER_MARGIN_S`` is kept for what is not training: downloading the checkpoint and
  the shard, encoding Δ, uploading it.
- ``SPEED_SAFETY`` plans on 80% of the time left at the measured speed, so a volunteer
  somewhat slower than its last measure still finishes (the client's own deadline stop,
  ``client.pacing``, covers a larger drop by uploading what it has).
- The speed is the volunteer's report if it sent one (``JoinIn.tokens_per_s``), else
  what the server measured from its accepted contributions in the run (``observed_rate``),
  else unknown: then the lease gets the nominal ``steps``, as every lease did before.

A speed is a claim the server cannot check, so it only ever sizes the claimant's own
lease, within [min_steps, max_steps]: the lease's H caps the tokens its contribution may
weigh (``RunConfig.lease_tokens_for``, ``rules.upload_weight``), and a lie cannot weigh
more than ``max_steps`` of honest work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from diloco.config import InnerSection
from diloco.protocol.messages import MAX_TOKENS_PER_S
from diloco.protocol.state import require_aware

TRANSFER_MARGIN_S = 10.0  # seconds kept for download, encoding and upload
SPEED_SAFETY = 0.8  # the fraction of the remaining time a lease is planned to fill
OBSERVED_WINDOW = 3  # the server's measure: the last this many accepted contributions

Source = Literal["reported", "observed", "unknown"]


@dataclass(frozen=True)
class StepBounds:
    """A run's H: the nominal one (unknown speed) and the bounds a sized lease stays in."""

    nominal: int
    min: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.nominal <= self.max:
            raise ValueError(
                f"steps: need 1 <= min ({self.min}) <= nominal ({self.nominal}) <= max ({self.max})"
            )

    @classmethod
    def of(cls, inner: InnerSection, *, max_steps: int | None = None) -> StepBounds:
        """The bounds a run config gives; ``max_steps`` lowers the upper one (a dataset run's
        lease holds at most ``steps`` batches of its data unit)."""
        top = inner.lease_max_steps if max_steps is None else min(max_steps, inner.lease_max_steps)
        return cls(nominal=inner.steps, min=inner.lease_min_steps, max=max(top, inner.steps))


@dataclass(frozen=True)
class Sizing:
    steps: int  # the lease's H
    source: Source  # where the speed came from
    reason: str  # a sentence for logs


def size_lease(
    now: datetime,
    deadline: datetime,
    bounds: StepBounds,
    *,
    tokens_per_step: int,
    reported: float | None = None,
    observed: float | None = None,
    margin_s: float = TRANSFER_MARGIN_S,
    safety: float = SPEED_SAFETY,
) -> Sizing:
    """A lease's H for a volunteer training ``reported`` (else ``observed``) tokens/s,
    leased at ``now`` on a round due at ``deadline``; see the module's formula."""
    require_aware("now", now)
    require_aware("deadline", deadline)
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step: must be at least 1, got {tokens_per_step}")
    source: Source
    if reported is not None and _usable_rate(reported):
        rate, source = reported, "reported"
    elif observed is not None and _usable_rate(observed):
        rate, source = observed, "observed"
    else:
        return Sizing(bounds.nominal, "unknown", f"speed unknown: the nominal H={bounds.nominal}")
    usable_s = max(0.0, ((deadline - now).total_seconds() - margin_s) * safety)
    fits = math.floor(rate * usable_s / tokens_per_step)
    steps = min(max(fits, bounds.min), bounds.max)
    bound = ""
    if fits < bounds.min or fits > bounds.max:
        bound = " (the lower bound)" if fits < bounds.min else " (the upper bound)"
    return Sizing(
        steps,
        source,
        f"{source} {rate:,.0f} tokens/s x {usable_s:.0f} usable s fits {fits} steps of "
        f"{tokens_per_step} tokens: H={steps}{bound}",
    )


def _usable_rate(rate: float) -> bool:
    return math.isfinite(rate) and 0.0 < rate <= MAX_TOKENS_PER_S


def observed_rate(samples: Sequence[tuple[int, float]]) -> float | None:
    """What the server measured of a volunteer: the tokens its accepted contributions weigh
    over the seconds from their lease's issue to their upload (download and upload
    included, so it errs slow), as (tokens, seconds) pairs; None when there is none."""
    tokens = sum(t for t, s in samples if t > 0 and s > 0)
    seconds = sum(s for t, s in samples if t > 0 and s > 0)
    if tokens <= 0 or seconds <= 0:
        return None
    return tokens / seconds
