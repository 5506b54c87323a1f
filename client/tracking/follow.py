"""Following a run: each pass reads the run and its rounds and hands the sinks what is new
(``Tracker``); ``follow`` repeats passes, backing off on errors, until the run has ended and
everything is written; ``track`` opens the sinks and handles SIGINT and SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from client.http import ApiError, RetryPolicy, ServerUnreachable
from client.lease import require
from client.session import ApiSession
from client.tracking.points import RoundPoint, closed_prefix, point_of
from client.tracking.sinks import Sink, TensorBoardSink, WandbSink

ENDED = ("completed", "cancelled")
# one pass's calls retry briefly; the follow loop backs off between passes instead
PASS_RETRY = RetryPolicy(attempts=3, base_delay_s=0.5, max_delay_s=2.0, total_s=15.0)
MAX_BACKOFF_S = 60.0


# ---------------------------------------------------------------------------- following


class RunSource(Protocol):
    async def run(self, run_id: str) -> dict[str, Any]: ...

    async def rounds(self, run_id: str) -> list[dict[str, Any]]: ...

    async def contributions(self, run_id: str, index: int) -> list[dict[str, Any]]: ...


class TrackAPI(ApiSession):
    """The public reads the tracker makes."""

    async def run(self, run_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/runs/{run_id}")

    async def rounds(self, run_id: str) -> list[dict[str, Any]]:
        data = await self._json("GET", f"/runs/{run_id}/rounds")
        return require(data, "rounds", list, "the round list")

    async def contributions(self, run_id: str, index: int) -> list[dict[str, Any]]:
        data = await self._json("GET", f"/runs/{run_id}/rounds/{index}/contributions")
        return require(data, "contributions", list, "the round's contributions")


@dataclass
class PassResult:
    status: str
    closed: int  # closed rounds
    written: list[RoundPoint]  # rounds written this pass (by at least one sink)
    evals: list[RoundPoint]  # eval losses written later than their round, this pass
    pending_evals: list[int]  # closed rounds whose eval loss a sink still waits for
    # a round being closed: a close under way when the run was cancelled still publishes
    closing: bool = False

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def settled(self) -> bool:
        """Nothing more can come for what was read: no eval pending, no close under way."""
        return not self.pending_evals and not self.closing


class Tracker:
    """One pass: read the run and its rounds, write what each sink lacks, flush, save."""

    def __init__(self, source: RunSource, run_id: str, sinks: Sequence[Sink]) -> None:
        self.source, self.run_id, self.sinks = source, run_id, list(sinks)

    async def pass_once(self) -> PassResult:
        run = await self.source.run(self.run_id)  # first: an ended run's rounds are all there
        rounds = await self.source.rounds(self.run_id)
        closed = closed_prefix(rounds)
        written: list[RoundPoint] = []
        evals: list[RoundPoint] = []
        pending: list[int] = []
        oldest = min(s.logged.rounds_through for s in self.sinks)
        for r, step in closed:
            index = int(r["index"])
            bytes_up = None
            if index > oldest:
                taken = await self.source.contributions(self.run_id, index)
                bytes_up = sum(
                    int(c.get("nbytes") or 0)
                    for c in taken
                    if int(c.get("merged_into_round", index)) == index
                )
            point = point_of(r, step, bytes_up)
            for sink in self.sinks:
                if index > sink.logged.rounds_through:
                    sink.write_round(point)
                    sink.logged.rounds_through = index
                    if point.eval_loss is not None:
                        sink.logged.evals.add(index)
                    if not written or written[-1] is not point:
                        written.append(point)
                elif index not in sink.logged.evals and point.eval_loss is not None:
                    sink.write_eval(point)
                    sink.logged.evals.add(index)
                    if not evals or evals[-1] is not point:
                        evals.append(point)
            if point.eval_loss is None:
                pending.append(index)
        for sink in self.sinks:
            sink.flush()
            sink.logged.save()
        closing = any(r.get("state") == "closing" for r in rounds)
        return PassResult(str(run.get("status")), len(closed), written, evals, pending, closing)


@dataclass
class FollowSummary:
    status: str
    rounds: int  # closed rounds, all written
    missing_evals: list[int]  # closed rounds whose eval loss never came (given up)
    stopped: bool = False  # asked to stop before the end
    signal: int | None = None  # the signal that asked


def describe(point: RoundPoint) -> str:
    def num(value: float | None, none: str) -> str:
        return none if value is None else f"{value:.4f}"

    return (
        f"round {point.index}: train {num(point.train_loss, '-')}, "
        f"eval {num(point.eval_loss, 'pending')}, "
        f"{point.tokens:,} tokens ({point.step:,} in all), {point.accepted} accepted"
        f"{f', {point.late} late' if point.late else ''}, {point.reason}"
    )


def _retryable(err: BaseException) -> bool:
    return isinstance(err, ServerUnreachable) or (isinstance(err, ApiError) and err.status >= 500)


async def follow(
    tracker: Tracker,
    *,
    poll_s: float,
    once: bool,
    eval_wait_s: float,
    give_up_s: float,
    echo: Callable[[str], None],
    stop: asyncio.Event | None = None,
) -> FollowSummary:
    """Pass after pass, ``poll_s`` apart, until the run has ended and everything is written
    (``once``: a single pass). A server that fails (unreachable, 5xx) is tried again after
    a delay doubling from ``poll_s`` up to ``MAX_BACKOFF_S``, for ``give_up_s`` at most;
    a refusal (4xx: no such run) ends the follow at once. ``stop`` set: return after the
    pass under way (its points flushed)."""
    stop = stop or asyncio.Event()
    failures, failing_since, ended_since = 0, 0.0, None
    result: PassResult | None = None
    while True:
        try:
            result = await tracker.pass_once()
        except Exception as err:
            if once or not _retryable(err):
                raise
            failures += 1
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > give_up_s:
                raise
            delay = min(MAX_BACKOFF_S, poll_s * 2.0**failures)
            echo(f"the server failed ({err}); trying again in {delay:.0f} s")
            if await _sleep(delay, stop):
                return FollowSummary(result.status if result else "?", 0, [], stopped=True)
            continue
        failures, failing_since = 0, 0.0
        for point in result.written:
            echo(describe(point))
        for point in result.evals:
            echo(f"round {point.index}: eval {point.eval_loss:.4f}")
        if once:
            return FollowSummary(result.status, result.closed, [])
        if result.ended:
            if result.settled:
                return FollowSummary(result.status, result.closed, [])
            ended_since = ended_since or time.monotonic()
            if time.monotonic() - ended_since > eval_wait_s:
                if result.closing:
                    echo(f"a round was still closing {eval_wait_s:.0f} s after the run ended")
                return FollowSummary(result.status, result.closed, result.pending_evals)
        if await _sleep(poll_s, stop):
            return FollowSummary(result.status, result.closed, [], stopped=True)


async def _sleep(seconds: float, stop: asyncio.Event) -> bool:
    """Wait ``seconds``; True when ``stop`` was set meanwhile (or before)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()


@dataclass(frozen=True)
class TrackOptions:
    server_url: str
    run_id: str
    tensorboard: Path | None = None
    wandb_project: str | None = None
    wandb_entity: str | None = None
    token: str | None = None
    once: bool = False
    poll_s: float = 10.0
    eval_wait_s: float = 600.0
    give_up_s: float = 3600.0


def open_sinks(opts: TrackOptions, run: Mapping[str, Any]) -> list[Sink]:
    sinks: list[Sink] = []
    try:
        if opts.tensorboard is not None:
            sinks.append(TensorBoardSink(opts.tensorboard, run))
        if opts.wandb_project is not None:
            sinks.append(
                WandbSink(
                    opts.wandb_project, run, entity=opts.wandb_entity, server_url=opts.server_url
                )
            )
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


async def track(opts: TrackOptions, echo: Callable[[str], None]) -> FollowSummary:
    """Open the sinks for the run and follow it; SIGINT and SIGTERM end the follow after
    the pass under way (the summary names the signal), the sinks closed."""
    stop, caught = asyncio.Event(), list[int]()

    def asked_to_stop(sig: int) -> None:
        caught.append(sig)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, asked_to_stop, sig)
    try:
        async with TrackAPI(opts.server_url, token=opts.token, retry=PASS_RETRY) as api:
            run = await api.run(opts.run_id)
            sinks = open_sinks(opts, run)
            echo(f"following run {opts.run_id} ({run.get('name')}) into " +
                 ", ".join(s.label for s in sinks))  # fmt: skip
            try:
                summary = await follow(
                    Tracker(api, opts.run_id, sinks),
                    poll_s=opts.poll_s,
                    once=opts.once,
                    eval_wait_s=opts.eval_wait_s,
                    give_up_s=opts.give_up_s,
                    echo=echo,
                    stop=stop,
                )
            finally:
                for sink in sinks:
                    sink.close()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if caught:
        summary.stopped, summary.signal = True, caught[0]
    return summary
