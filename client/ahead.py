"""Training on while a round closes (``[inner] overlap``, issue 25): the volunteer's side.

Once its Δ is encoded and its AdamW state saved, the volunteer does not sit idle while its
upload travels, the round closes and the next version comes down: a thread goes on from the
end of its round, on its last lease's data (``LocalTrainer.train_ahead``), for at most the
run's cap of steps (``InnerSection.ahead_cap``). When its next lease's version is here,
:meth:`AheadSteps.take` stops the thread after the step in progress and hands the steps to
that lease's training, which folds them onto the version (``InnerTrainer.fold``) and takes
only the rest. The protocol is untouched: the lease names its base version, the upload is
Δ against it, and its tokens are only those of the lease's own data.

They are dropped (taken and forgotten) when they cannot apply: the upload they follow was
refused, the next lease is on another run or config, or the worker stops. The model is
never touched by two threads: every path takes them before it trains again.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from client.lease import Lease
from client.progress import Reporter
from client.training import LocalTrainer, stop_flag
from client.worker_options import WorkerSummary
from diloco.train import Ahead


class AheadSteps:
    """Steps trained after ``last``'s upload, in a thread, until taken."""

    def __init__(
        self,
        local: LocalTrainer,
        last: Lease,
        shard: torch.Tensor,
        steps: int,
        interrupted: threading.Event,
    ) -> None:
        self.last, self.local = last, local
        self._landed = threading.Event()
        stop = stop_flag(self._landed, interrupted)
        self._task: asyncio.Task[Ahead] = asyncio.create_task(
            asyncio.to_thread(local.train_ahead, last, shard, steps=steps, stop=stop)
        )

    def fits(self, lease: Lease) -> bool:
        """Whether they can begin ``lease``: the same run, the model built for its config."""
        return lease.run_id == self.last.run_id and self.local.holds(lease.config)

    async def take(self) -> Ahead:
        """Stop after the step in progress (at least one is taken); the steps trained."""
        self._landed.set()
        return await self._task


class Overlap:
    """The worker's steps ahead: at most one :class:`AheadSteps` running at a time."""

    def __init__(
        self,
        local: LocalTrainer,
        say: Reporter,
        summary: WorkerSummary,
        interrupted: threading.Event,
    ) -> None:
        self.local, self.say, self.summary, self.interrupted = local, say, summary, interrupted
        self.running: AheadSteps | None = None

    def start(self, last: Lease, shard: torch.Tensor) -> None:
        """Our Δ for ``last`` is encoded and the state saved: train on while it travels and
        the round closes, if its run trains ahead (``[inner] overlap`` > 0)."""
        cfg = self.local.cfg
        if cfg is not None and (cap := cfg.inner.ahead_cap(last.inner_steps)) >= 1:
            self.running = AheadSteps(self.local, last, shard, cap, self.interrupted)

    async def before(self, lease: Lease) -> None:
        """``lease`` is about to be prepared: drop the steps if they cannot begin it."""
        if self.running is not None and not self.running.fits(lease):
            await self.drop()

    async def take(self, lease: Lease) -> Ahead | None:
        """The steps trained ahead, stopped now that ``lease``'s version is here."""
        running, self.running = self.running, None
        if running is None:
            return None
        ahead = await running.take()
        self.summary.ahead_steps += ahead.result.steps
        self.say.info(
            f"round {lease.round}: {ahead.result.steps} of its {lease.inner_steps} steps "
            f"trained ahead while round {running.last.round} closed; folded onto version "
            f"{lease.base_version}"
        )
        return ahead

    async def drop(self) -> None:
        """Stop the steps ahead and forget them (they cannot begin our next lease)."""
        running, self.running = self.running, None
        if running is not None:
            await running.take()
