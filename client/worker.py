"""The volunteer loop: join a round, train H steps, upload Δ, again (``docs/api.md``).

Per round, as one simulated worker does in ``diloco.simulate._run_diloco``:
join → download θ(t−1) and the shard (cached by sha256) → H AdamW steps in a thread while
the event loop sends heartbeats → Δ = θ(t−1) − θi → int8 → stream the upload.
A round that closes without us (a heartbeat or the upload answers 409) is dropped and we
join the next one; a paused run is waited out; a completed or cancelled run ends the loop.
SIGINT/SIGTERM stop the current step, close the session and print a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from client import credentials
from client.api import ApiError, RetryPolicy, ServerAPI, ServerUnreachable, Timeouts
from client.credentials import Credentials
from client.lease import Lease
from client.progress import Reporter, RoundBar
from client.training import (
    DivergedError,
    LocalTrainer,
    StopTraining,
    load_checkpoint_params,
    load_shard,
    resolve_device,
    stop_flag,
)
from diloco.train import InnerResult
from diloco.wire import encode_contribution

# the round moved on without us: drop this round's work and join again
REJECTED_CODES = frozenset(
    {
        "round_closed",
        "base_version_mismatch",
        "no_lease",
        "duplicate_contribution",
        "run_not_active",
    }
)
# a heartbeat answer that means the lease is no longer worth training for
LOST_LEASE_CODES = frozenset({"round_closed", "no_lease"})


@dataclass(frozen=True)
class WorkerOptions:
    server_url: str
    run_id: str | None = None  # None: the newest active run
    name: str | None = None  # register under this name (first use only)
    token: str | None = None  # use this contributor token instead of the stored one
    device: str = "auto"  # auto | cpu | cuda | mps
    max_rounds: int | None = None  # stop after this many accepted contributions
    threads: int | None = None  # torch CPU threads
    quiet: bool = False  # no progress bar, no per-round lines
    progress_bar: bool | None = None  # None: when stderr is a terminal and not quiet
    poll_s: float = 15.0  # how often to ask again while the run is paused
    max_wait_s: float = 120.0  # cap on the server's retry_after_s
    retry: RetryPolicy = field(
        default_factory=lambda: RetryPolicy(attempts=10, max_delay_s=60.0, total_s=900.0)
    )
    timeouts: Timeouts = field(default_factory=Timeouts)
    config_dir: Path | None = None  # None: credentials.config_dir()
    cache_dir: Path | None = None  # None: credentials.cache_dir()


@dataclass
class WorkerSummary:
    accepted: int = 0
    rejected: int = 0
    abandoned: int = 0  # rounds that closed while we were still training
    tokens: int = 0  # trained on in accepted contributions
    stopped_because: str = "stopped"
    signal: int | None = None  # the signal that stopped the worker, if one did
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        return (
            f"{self.stopped_because}: {self.accepted} contributions accepted, "
            f"{self.rejected} rejected, {self.abandoned} abandoned, "
            f"{self.tokens:,} tokens in {elapsed / 60:.1f} min"
        )


class NoActiveRun(Exception):
    """``--run`` was not given and the server has no active run to join."""


def default_name() -> str:
    return f"volunteer@{socket.gethostname()}"[:64]


class _Worker:
    def __init__(self, opts: WorkerOptions, api: ServerAPI, reporter: Reporter) -> None:
        self.opts, self.api, self.say = opts, api, reporter
        self.summary = WorkerSummary()
        self.interrupted = threading.Event()  # a signal arrived: stop at the next step
        self.local = LocalTrainer(resolve_device(opts.device))

    async def run(self) -> None:
        await self.authenticate()
        run_id = self.opts.run_id or await self.pick_run()
        self.say.info(f"joining run {run_id} on {self.api.server_url} ({self.local.device})")
        while self.opts.max_rounds is None or self.summary.accepted < self.opts.max_rounds:
            lease = await self.join(run_id)
            if lease is None:
                return
            await self.round(lease)
        self.summary.stopped_because = f"done after {self.summary.accepted} accepted rounds"

    # ---------------------------------------------------------------- who we are, which run

    async def authenticate(self) -> None:
        url, cfg_dir = self.opts.server_url, self.opts.config_dir
        if self.opts.token:
            self.api.token = self.opts.token
            await self.check_token("the token given with --token")
            return
        stored = credentials.load_credentials(url, cfg_dir)
        if stored is not None:
            self.api.token = stored.token
            await self.check_token(f"the token stored for {self.api.server_url}")
            return
        name = self.opts.name or default_name()
        contributor_id, token = await self.api.register(name)
        path = credentials.save_credentials(url, Credentials(contributor_id, name, token), cfg_dir)
        self.api.token = token
        self.say.always(f"registered as {name!r} ({contributor_id}); token stored in {path}")

    async def check_token(self, what: str) -> None:
        try:
            await self.api.me()
        except ApiError as err:
            if err.status != 401:
                raise
            raise ApiError(
                401,
                err.code,
                f"{what} was refused by the server; pass a valid --token, or delete its entry "
                f"in {(self.opts.config_dir or credentials.config_dir()) / 'credentials.json'} "
                "to register again",
                err.body,
            ) from None

    async def pick_run(self) -> str:
        active = [r for r in await self.api.list_runs() if r.get("status") == "active"]
        if not active:
            raise NoActiveRun(
                f"{self.api.server_url} has no active run; pass --run ID, or ask its operator "
                "to create or resume one"
            )
        return str(active[0]["id"])  # the list is newest first

    async def join(self, run_id: str) -> Lease | None:
        """A lease for the open round, waiting while the run is paused or we already
        contributed; None when the run has ended."""
        said: set[str] = set()  # say each kind of wait once per join, not every poll
        while True:
            try:
                return await self.api.join(run_id)
            except ApiError as err:
                if err.code == "run_not_active" and err.body.get("status") == "paused":
                    wait, why = self.opts.poll_s, f"run {run_id} is paused; waiting"
                elif err.code == "run_not_active":
                    self.summary.stopped_because = f"run {run_id} is {err.body.get('status')}"
                    return None
                elif err.code in ("already_contributed", "round_closing"):
                    after = err.body.get("retry_after_s")
                    wait = float(after) if isinstance(after, int | float) else self.opts.poll_s
                    wait = min(max(wait, 0.5), self.opts.max_wait_s)
                    why = "waiting for the next round to open"
                else:
                    raise
                if err.code not in said:
                    said.add(err.code)
                    self.say.info(why)
                await asyncio.sleep(wait)

    # ---------------------------------------------------------------- one round

    async def round(self, lease: Lease) -> None:
        lost = threading.Event()  # set by a heartbeat answer: the round went on without us
        bar = self.say.round_bar(lease.round, lease.inner_steps)
        beats = asyncio.create_task(self.heartbeats(lease, bar, lost))
        try:
            cfg, rebuilt = await asyncio.to_thread(self.local.prepare, lease.config)
            if rebuilt:
                self.say.info(f"model built: {cfg.name}, fresh AdamW on {self.local.device}")
            params, shard = await self.fetch(lease, cfg.model.block_size)
            trained = None if lost.is_set() else await self.train(lease, params, shard, bar, lost)
            if trained is None:
                self.summary.abandoned += 1
                self.say.info(f"round {lease.round} closed before we finished; joining again")
                return
            await self.contribute(lease, params, *trained)
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats

    async def fetch(
        self, lease: Lease, block_size: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        root, ck, sh = self.opts.cache_dir, lease.checkpoint, lease.shard
        ck_path = credentials.checkpoint_path(lease.run_id, ck.version, ck.sha256, root)
        if not ck_path.exists():
            await self.api.download(ck.url, ck_path, ck.sha256)
            credentials.prune_checkpoints(lease.run_id, ck.version, root)
        sh_path = credentials.shard_path(lease.run_id, sh.index, sh.sha256, root)
        if not sh_path.exists():
            await self.api.download(sh.url, sh_path, sh.sha256)
        params = await asyncio.to_thread(load_checkpoint_params, ck_path)
        shard = await asyncio.to_thread(load_shard, sh_path, lease, block_size)
        return params, shard

    async def train(
        self,
        lease: Lease,
        params: dict[str, torch.Tensor],
        shard: torch.Tensor,
        bar: RoundBar,
        lost: threading.Event,
    ) -> tuple[InnerResult, float] | None:
        """H steps in a thread; the result and tokens/s, or None if stopped early."""
        stop = stop_flag(lost, self.interrupted)
        started = time.perf_counter()
        with bar:
            try:
                result = await asyncio.to_thread(
                    self.local.train, lease, params, shard, on_step=bar.step, stop=stop
                )
            except StopTraining:
                return None
        return result, result.tokens / max(time.perf_counter() - started, 1e-9)

    async def heartbeats(self, lease: Lease, bar: RoundBar, lost: threading.Event) -> None:
        interval = max(1.0, lease.heartbeat_interval_s)
        quick = RetryPolicy(attempts=3, base_delay_s=0.5, max_delay_s=2.0, total_s=interval)
        warned: set[str] = set()  # one warning per kind of failure per round
        while True:
            await asyncio.sleep(interval)
            step, loss = bar.latest()
            try:
                await self.api.heartbeat(
                    lease.run_id, lease.round, lease.lease_id, step, loss, retry=quick
                )
            except ApiError as err:
                if err.code in LOST_LEASE_CODES:
                    lost.set()
                    return
                if err.code not in warned:
                    warned.add(err.code)
                    self.say.warn(f"heartbeat for round {lease.round}: {err}")
            except ServerUnreachable as err:
                if "unreachable" not in warned:
                    warned.add("unreachable")
                    self.say.warn(f"heartbeat for round {lease.round}: {err}; still training")

    async def contribute(
        self, lease: Lease, params: dict[str, torch.Tensor], result: InnerResult, rate: float
    ) -> None:
        """Encode Δ and upload it; a 409 that says the round moved on counts as rejected."""
        try:
            body = await asyncio.to_thread(self.local.contribution, lease, params, result)
        except DivergedError as err:
            self.local.reset()
            self.say.warn(f"round {lease.round}: {err}; starting over with a fresh optimizer")
            return
        head = f"round {lease.round}  loss {result.mean_loss:.4f}  {rate:,.0f} tok/s"
        if body.nbytes > lease.max_upload_bytes:
            raise ApiError(
                413,
                "upload_too_large",
                f"our upload would be {body.nbytes:,} bytes but the round takes at most "
                f"{lease.max_upload_bytes:,}; tell the run's operator",
                {},
            )
        try:
            receipt = await self.api.upload(
                lease.run_id,
                lease.round,
                lambda: encode_contribution(body.meta, body.tensors),
                body.nbytes,
            )
        except ApiError as err:
            if err.code not in REJECTED_CODES:
                raise
            self.summary.rejected += 1
            self.say.info(f"{head}  upload {body.nbytes:,} B  rejected: {err.code} ({err.detail})")
            return
        self.summary.accepted += 1
        self.summary.tokens += result.tokens
        note = " (already held)" if receipt.repeated else ""
        self.say.info(f"{head}  upload {body.nbytes:,} B  accepted{note}")


async def run_worker(opts: WorkerOptions) -> WorkerSummary:
    """The volunteer loop until ``max_rounds`` accepted contributions, the run's end, or a
    signal (SIGINT/SIGTERM: ``summary.signal`` says which). Other failures raise, after the
    summary line: ApiError (4xx), ServerUnreachable, ProtocolError, DeviceError, ..."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    reporter = Reporter(quiet=opts.quiet, bar=opts.progress_bar)
    api = ServerAPI(opts.server_url, retry=opts.retry, timeouts=opts.timeouts)
    worker = _Worker(opts, api, reporter)
    loop, task = asyncio.get_running_loop(), asyncio.current_task()

    def on_signal(signum: int) -> None:
        if worker.summary.signal is not None:  # a second Ctrl+C: stop waiting politely
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        worker.summary.signal = signum
        worker.interrupted.set()  # the training thread stops at its next step
        if task is not None:
            task.cancel()

    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows, non-main thread
            loop.add_signal_handler(sig, on_signal, sig)
            handled.append(sig)
    try:
        await worker.run()
    except asyncio.CancelledError:
        if worker.summary.signal is None:
            raise
        if task is not None:
            task.uncancel()
        worker.summary.stopped_because = f"stopped by {signal.Signals(worker.summary.signal).name}"
    except BaseException as err:
        worker.summary.stopped_because = f"stopped by an error ({type(err).__name__})"
        raise
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await api.close()
        reporter.always(worker.summary.line())
    return worker.summary
