"""The volunteer loop: join a round, train H steps, upload Δ, again (``docs/api.md``).

What the volunteer does on each answer of the server (wait, train on, abandon the lease,
send again, stop) is ``diloco.protocol.volunteer``, the same table the simulator's
volunteers follow; this module does it with HTTP, a training thread and the event loop.

Without ``--run`` it joins the newest active run, and while there is none it waits for
one (asking again with a bounded backoff). Per round, as one simulated worker does in
``diloco.simulate.diloco_mode.run_diloco``:
join (with our last round's tokens/s, so the server sizes H to finish before the deadline)
→ download θ(t−1) and the shard (cached by sha256) → H AdamW steps in a thread while
the event loop sends heartbeats (client.heartbeating) → Δ = θ(t−1) − θi → int8 → stream the upload.
Against the deadline (``client.pacing``): a lease that even ``min_steps`` would not finish
in time is given back untrained, and training stops early, keeping what it did, when
another step would leave too little time to upload.
A round that closes without us, or a lease the server no longer knows (a heartbeat or the
upload answers 409 ``round_closed`` or ``no_lease``), is dropped and we join again,
unless the round closed and the run merges late work (``[rounds] max_staleness``): then
we finish the H steps and upload to our round as usual, and the server merges the work
into the round open then, discounted (``diloco.protocol.late``); past the bound we drop it.
With ``[inner] overlap`` it trains on from its upload until the next version arrives
(``client.ahead``); those steps begin its next lease. A paused run is waited out; a
completed or cancelled run ends the loop.
SIGINT/SIGTERM stop the current step, close the session and print a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time

import torch

from client import identity
from client.ahead import Overlap
from client.api import ApiError, ServerAPI, ServerUnreachable
from client.fetch import Fetcher
from client.gpu import device_peak_flops
from client.heartbeating import Heartbeats
from client.lease import Lease
from client.measured_speed import first_speed
from client.pacing import RoundPace, reserve_s
from client.progress import Reporter, RoundBar
from client.training import (
    LocalTrainer,
    StopTraining,
    resolve_device,
    stop_flag,
)
from client.uploading import Uploader
from client.worker_options import Reactions, WorkerOptions, WorkerSummary
from diloco.faults import FaultInjector
from diloco.protocol.messages import ErrorCode
from diloco.protocol.volunteer import (
    DOWNLOAD_URL_REFUSED,
    MAX_WAIT_S,
    NO_ACTIVE_RUN,
    Answer,
    Do,
    Request,
    staleness_bound,
)
from diloco.train import Ahead, InnerResult

default_name = identity.default_name  # re-exported: the CLI's --name default


class _Worker:
    def __init__(self, opts: WorkerOptions, api: ServerAPI, reporter: Reporter) -> None:
        self.opts, self.api, self.say = opts, api, reporter
        self.summary = WorkerSummary()
        self.interrupted = threading.Event()  # a signal arrived: stop at the next step
        self.local = LocalTrainer(
            resolve_device(opts.device),
            precision=opts.precision,
            micro_batch=opts.micro_batch,
            gpu_memory_gib=opts.gpu_memory_gib,
        )
        self.peak_flops = device_peak_flops(self.local.device)  # None: no MFU to show
        self.fetcher = Fetcher(api, reporter, opts.cache_dir)
        self.holding: Lease | None = None  # a lease we train for and have not uploaded to
        self.faults = FaultInjector.parse(opts.faults)
        self.react = Reactions()  # diloco.protocol.volunteer, shared with the uploader
        self.rate: float | None = None  # tokens/s of our last round, sent with each join
        # training on while a round closes (issue 25: [inner] overlap)
        self.overlap = Overlap(self.local, reporter, self.summary, self.interrupted)
        self.uploads = Uploader(
            opts,
            api,
            reporter,
            local=self.local,
            fetcher=self.fetcher,
            summary=self.summary,
            react=self.react,
            faults=self.faults,
            peak_flops=self.peak_flops,
        )

    async def run(self) -> None:
        o = self.opts
        await identity.sign_in(
            self.api, token=o.token, name=o.name, config_dir=o.config_dir, say=self.say
        )
        await identity.report_hardware(self.api, self.local.device, say=self.say)
        run_id = self.opts.run_id or await self.pick_run()
        if o.invite:
            await self.api.become_member(run_id, o.invite)
        self.say.info(f"joining run {run_id} on {self.api.server_url} ({self.local.device})")
        self.rate = first_speed(run_id, o.cache_dir, self.local.device.type,
                                self.local.precision, self.say)  # fmt: skip
        try:
            while self.opts.max_rounds is None or self.summary.accepted < self.opts.max_rounds:
                lease = await self.join(run_id)
                if lease is None:
                    return
                await self.round(lease)
            self.summary.stopped_because = f"done after {self.summary.accepted} accepted rounds"
        finally:
            await self.overlap.drop()

    # ---------------------------------------------------------------- who we are, which run

    async def release(self) -> None:
        """Give back the lease we hold (we are stopping); it would expire on its own."""
        lease, self.holding = self.holding, None
        if lease is None:
            return
        try:
            await self.api.release(lease.run_id, lease.round)
        except ApiError as err:  # the round closed meanwhile (nothing held), or worse
            if self.react.to(Request.RELEASE, err).do is Do.WARN:
                self.say.warn(f"lease on round {lease.round} not released: {err}")
            else:
                self.say.info(f"lease on round {lease.round} not released: {err.code}")
            return
        except ServerUnreachable as err:
            self.say.warn(
                f"could not give back our lease on round {lease.round} ({err}); "
                f"it expires by itself at {lease.lease_expires_at:%H:%M:%S} UTC"
            )
            return
        self.say.always(f"gave back our lease on round {lease.round}: the round need not wait")

    async def pick_run(self) -> str:
        """The newest active run, waiting (a bounded backoff) while there is none."""
        said = False
        while True:
            active = [r for r in await self.api.list_runs() if r.get("status") == "active"]
            reaction = self.react.answer(Answer(Request.RUNS, None if active else NO_ACTIVE_RUN))
            if reaction.do is Do.JOIN:
                return str(active[0]["id"])  # the list is newest first
            if not said:
                said = True
                self.say.always(
                    f"{self.api.server_url} has no active run yet; waiting for one to be "
                    "created or resumed (Ctrl+C stops)"
                )
            await asyncio.sleep(reaction.wait_s)

    async def join(self, run_id: str) -> Lease | None:
        """A lease for the open round, waiting while the run is paused or we already
        contributed; None when the run has ended."""
        said: set[str] = set()  # say each kind of wait once per join, not every poll
        while True:
            try:
                lease = await self.api.join(run_id, tokens_per_s=self.rate)
            except ApiError as err:
                reaction = self.react.to(Request.JOIN, err)
                if reaction.do is Do.STOP:
                    self.summary.stopped_because = f"run {run_id} is {err.body.get('status')}"
                    return None
                if reaction.do is not Do.WAIT:
                    raise
                if err.code not in said:
                    said.add(err.code)
                    self.say.info(f"run {run_id}: {reaction.why}")
                await asyncio.sleep(reaction.wait_s)
                continue
            bound = staleness_bound(lease.config)
            self.react.to(Request.JOIN, body={"round": lease.round, "max_staleness": bound})
            return lease

    # ---------------------------------------------------------------- one round

    async def round(self, lease: Lease) -> None:
        lost = threading.Event()  # set by a heartbeat answer: the round went on without us
        pace = RoundPace(lease, reserve=reserve_s(self.uploads.upload_s))
        bar = self.say.round_bar(lease.round, lease.inner_steps)
        heartbeats = Heartbeats(self.api, self.react, self.say)
        beats = asyncio.create_task(heartbeats.run(lease, bar.latest, lost))
        self.holding = lease
        try:
            await self.overlap.before(lease)  # another run or config: the model is rebuilt
            cfg, rebuilt = await asyncio.to_thread(self.local.prepare, lease.config)
            if rebuilt:
                self.say.info(f"training on {self.local.describe()}")
                await self.restore_optimizer(lease, cfg.name)
            bar.count_flops(self.local.flops_per_token, self.peak_flops)
            try:
                params, shard = await self.fetcher.inputs(lease, cfg.model.block_size)
            except ApiError as err:
                if err.code not in (DOWNLOAD_URL_REFUSED, ErrorCode.CHECKPOINT_PENDING):
                    raise
                self.say.warn(f"{err.detail}")  # the next join brings fresh URLs
                # a version whose full file is being written: when the server said
                await asyncio.sleep(err.retry_after_s or 0)
                return
            ahead = await self.overlap.take(lease)  # its version is here: stop training ahead
            if (why := pace.refusal(cfg, self.rate)) is not None:
                await self.skip(lease, why, pace)
                return
            if lease.inner_steps != cfg.inner.steps:
                self.say.info(pace.sized_note(cfg, self.rate))
            trained = (
                None
                if lost.is_set()
                else await self.train(lease, params, shard, bar, lost, pace, ahead)
            )
            if heartbeats.fatal is not None:
                raise heartbeats.fatal
            if trained is None:
                if self.interrupted.is_set():
                    return  # stopping: run_worker gives the lease back
                self.summary.abandoned += 1
                self.holding = None
                self.say.info(f"round {lease.round}: {heartbeats.lost_why}; joining again")
                return
            if pace.reason is not None:
                self.summary.cut_short += 1
                self.say.always(f"round {lease.round}: {pace.reason}; uploading them")
            accepted = await self.uploads.contribute(
                lease, params, *trained, on_saved=lambda: self.overlap.start(lease, shard)
            )
            self.holding = None
            if not accepted:
                await self.overlap.drop()  # they would go on from work the run did not take
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
            if self.holding is not None:  # the round ended without our upload
                await self.overlap.drop()

    async def skip(self, lease: Lease, why: str, pace: RoundPace) -> None:
        """Not even min_steps would make the deadline: give the lease back untrained (the
        round need not wait for us) and wait for the deadline, when the round closes or is
        extended, before joining again."""
        self.summary.skipped += 1
        self.say.always(f"round {lease.round}: not training: {why}; waiting for the next round")
        await self.release()
        await asyncio.sleep(min(max(pace.left_s(), 0.0) + 1.0, MAX_WAIT_S))

    async def restore_optimizer(self, lease: Lease, name: str) -> None:
        """After (re)building the model: resume the AdamW state a previous session of this
        client saved for the run, or say why we start fresh (``LocalTrainer.resume``)."""
        path = self.fetcher.state_path(lease.run_id)
        resumed, line = await asyncio.to_thread(self.local.resume, path, run_id=lease.run_id)
        (self.say.info if resumed else self.say.warn)(f"model built: {name}; {line}")

    async def train(
        self,
        lease: Lease,
        params: dict[str, torch.Tensor],
        shard: torch.Tensor,
        bar: RoundBar,
        lost: threading.Event,
        pace: RoundPace,
        ahead: Ahead | None = None,
    ) -> tuple[InnerResult, float] | None:
        """H steps in a thread (the rest of them after ``ahead``); the result and tokens/s,
        or None if stopped early. The deadline may stop it early too (``pace``): then the
        result holds the steps done."""
        stop = stop_flag(lost, self.interrupted)

        def on_step(done: int, loss: float, tokens: int) -> None:
            bar.step(done, loss, tokens)
            self.faults.hit("volunteer.step")  # tests: a volunteer that slows down

        if ahead is None:  # the lease begins from a state a file holds: an audit's start
            path = self.fetcher.state_path(lease.run_id)
            await asyncio.to_thread(self.local.keep_saved, path, run_id=lease.run_id)
        started = time.perf_counter()
        pace.start()
        with bar:
            try:
                result = await asyncio.to_thread(
                    self.local.train, lease, params, shard,
                    on_step=on_step, stop=stop, until=pace.after_step, ahead=ahead,
                )  # fmt: skip
            except StopTraining:
                return None
        self.rate = result.tokens / max(time.perf_counter() - started, 1e-9)
        return result, self.rate


async def run_worker(opts: WorkerOptions) -> WorkerSummary:
    """The volunteer loop until ``max_rounds`` accepted contributions, ``max_hours``, the
    run's end, or a signal (SIGINT/SIGTERM: ``summary.signal`` says which). Stopping early
    gives the lease back, so the round need not wait for us. Other failures raise, after the
    summary line: ApiError (4xx), ServerUnreachable, ProtocolError, DeviceError, ..."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    reporter = Reporter(quiet=opts.quiet, bar=opts.progress_bar)
    api = ServerAPI(opts.server_url, retry=opts.retry, timeouts=opts.timeouts)
    worker = _Worker(opts, api, reporter)
    loop, task = asyncio.get_running_loop(), asyncio.current_task()

    def stop() -> None:
        worker.interrupted.set()  # the training thread stops at its next step
        if task is not None:
            task.cancel()

    def on_signal(signum: int) -> None:
        if worker.summary.signal is not None:  # a second Ctrl+C: stop waiting politely
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        worker.summary.signal = signum
        stop()

    def on_time_up() -> None:
        worker.summary.time_up = True
        stop()

    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows, non-main thread
            loop.add_signal_handler(sig, on_signal, sig)
            handled.append(sig)
    timer = loop.call_later(opts.max_hours * 3600, on_time_up) if opts.max_hours else None
    try:
        await worker.run()
    except asyncio.CancelledError:
        if worker.summary.signal is None and not worker.summary.time_up:
            raise
        if task is not None:
            task.uncancel()
        if worker.summary.signal is not None:
            worker.summary.stopped_because = (
                f"stopped by {signal.Signals(worker.summary.signal).name}"
            )
        else:
            worker.summary.stopped_because = f"stopped after --max-hours {opts.max_hours:g}"
        await worker.release()
    except ApiError as err:
        if err.code == ErrorCode.BANNED:  # every request would be refused: stop for good
            worker.summary.stopped_because = "stopped: the hub's admin banned this contributor"
        elif err.code == ErrorCode.BANNED_FROM_RUN:
            worker.summary.stopped_because = "stopped: the run's owner banned us from this run"
        else:
            worker.summary.stopped_because = f"stopped by an error ({type(err).__name__})"
        raise
    except BaseException as err:
        worker.summary.stopped_because = f"stopped by an error ({type(err).__name__})"
        raise
    finally:
        if timer is not None:
            timer.cancel()
        for sig in handled:
            loop.remove_signal_handler(sig)
        await api.close()
        reporter.always(worker.summary.line())
    return worker.summary
