"""A volunteer's round against its deadline: whether to start at all, and when to stop
early and upload what it has rather than miss the deadline with nothing.

The decisions are pure functions of (steps, measured step time, time left, reserve) that
return a sentence or None, so tests pin them with fixed numbers; :class:`RoundPace` is
the clock the worker keeps for one lease (its training thread asks it after each step).

- Time left is counted on this machine's monotonic clock from the lease's
  ``deadline_in_s`` (the server's clock), so a volunteer whose wall clock is off still
  stops in time; a lease from an older server falls back to the wall clock.
- A step's time is the slower of the last step and the mean of the recent ones, so a
  volunteer that slows down (another program took the GPU) notices within a step.
- The reserve is what is kept for encoding Δ and uploading it: ``RESERVE_S`` until an
  upload was measured, then twice the last encode-and-upload time, never less.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime

from client.lease import Lease
from diloco.config import RunConfig

RESERVE_S = 5.0  # seconds kept for encoding Δ and the upload, before one was measured
UPLOAD_SAFETY = 2.0  # a measured encode + upload counts this many times over
RECENT_STEPS = 5  # steps whose mean estimates the next step's time


def reserve_s(last_upload_s: float | None) -> float:
    """Seconds to keep for encoding and uploading, given the last measured time (if any)."""
    if last_upload_s is None or not math.isfinite(last_upload_s):
        return RESERVE_S
    return max(RESERVE_S, UPLOAD_SAFETY * last_upload_s)


def start_refusal(
    *, min_steps: int, step_s: float | None, left_s: float, reserve: float
) -> str | None:
    """Why not to start training a lease at all (None: start). Not even ``min_steps``
    steps would be done and uploaded before the deadline: the compute would be wasted."""
    if left_s <= reserve:
        return (
            f"the deadline is in {max(left_s, 0):.0f} s, within the {reserve:.0f} s kept for "
            "the upload"
        )
    if step_s is not None and min_steps * step_s + reserve > left_s:
        return (
            f"the deadline is in {left_s:.0f} s: {min_steps} steps at {step_s:.2f} s each and "
            f"the upload ({reserve:.0f} s) would not make it"
        )
    return None


def deadline_stop(
    *, done: int, steps: int, step_s: float, left_s: float, reserve: float
) -> str | None:
    """After ``done`` of ``steps`` steps: why to stop now and upload the ``done`` steps
    (None: go on). Stop when one more step would leave less than ``reserve`` before the
    deadline; never before the first step (there would be nothing to upload), nor after
    the last."""
    if done < 1 or done >= steps:
        return None
    if left_s - step_s >= reserve:
        return None
    return (
        f"stopped after {done} of {steps} steps for the deadline: it is in "
        f"{max(left_s, 0):.0f} s, a step takes {step_s:.2f} s and {reserve:.0f} s are kept "
        "for the upload"
    )


def seconds_left_at_join(lease: Lease, now: datetime | None = None) -> float:
    """The lease's time to its deadline: ``deadline_in_s`` (the server's count), else the
    wall clock's."""
    if lease.deadline_in_s is not None:
        return lease.deadline_in_s
    return (lease.deadline - (now or datetime.now(UTC))).total_seconds()


class RoundPace:
    """One lease's clock: time left, step times as they come, the decision after each
    step. ``after_step`` runs in the training thread; ``reason`` is read afterwards."""

    def __init__(
        self,
        lease: Lease,
        *,
        reserve: float,
        clock: Callable[[], float] = time.monotonic,
        left_s: float | None = None,
    ) -> None:
        self.clock, self.reserve, self.steps = clock, reserve, lease.inner_steps
        self.deadline = clock() + (seconds_left_at_join(lease) if left_s is None else left_s)
        self.reason: str | None = None  # why training stopped early for the deadline
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._last: float | None = None
        self._lock = threading.Lock()

    def refusal(self, cfg: RunConfig, rate: float | None) -> str | None:
        """Why not to train this lease at all (``start_refusal``), at ``rate`` tokens/s
        (our last round's; None: unknown) and the least steps it could be cut to."""
        step_s = None if rate is None else cfg.tokens_per_step / rate
        least = min(self.steps, cfg.inner.lease_min_steps)
        return start_refusal(
            min_steps=least, step_s=step_s, left_s=self.left_s(), reserve=self.reserve
        )

    def sized_note(self, cfg: RunConfig, rate: float | None) -> str:
        """The log line for a lease whose H is not the run's."""
        speed = "" if rate is None else f" to our {rate:,.0f} tokens/s"
        return (
            f"H={self.steps} steps (the server sized it{speed} for the deadline in "
            f"{max(self.left_s(), 0):.0f} s; the run's H is {cfg.inner.steps})"
        )

    def left_s(self) -> float:
        return self.deadline - self.clock()

    def start(self) -> None:
        """Training begins now: the first step is timed from here."""
        self._last = self.clock()

    def step_s(self) -> float | None:
        """The time one more step is expected to take (None before one was timed)."""
        if not self._recent:
            return None
        return max(self._recent[-1], sum(self._recent) / len(self._recent))

    def after_step(self, done: int) -> str | None:
        """``done`` steps are finished: the sentence to stop on, or None to go on."""
        now = self.clock()
        with self._lock:
            if self._last is not None:
                self._recent.append(now - self._last)
            self._last = now
            step_s = self.step_s()
            if step_s is None:
                return None
            why = deadline_stop(
                done=done,
                steps=self.steps,
                step_s=step_s,
                left_s=self.deadline - now,
                reserve=self.reserve,
            )
            if why is not None:
                self.reason = why
            return why
