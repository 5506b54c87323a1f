"""The upload half of a volunteer's round (``client.worker``): encode Δ, keep the AdamW
state on disk, send it (again, while a round it joins is closing), and one line for what
the server answered; a few refusals of our body in a row stop the worker. What each answer
means is ``diloco.protocol.volunteer``'s table."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from client.api import ApiError, ServerAPI, UploadReceipt
from client.fetch import Fetcher
from client.gpu import mfu
from client.lease import Lease
from client.optimizer_state import START_FILE, keep_as_start
from client.progress import Reporter
from client.reveals import Revealer
from client.training import Contribution, DivergedError, LocalTrainer
from client.worker_options import Reactions, WorkerOptions, WorkerSummary
from diloco.faults import FaultInjector
from diloco.protocol.messages import ErrorCode
from diloco.protocol.volunteer import FATAL_CODES, Do, Reaction, Request
from diloco.train import InnerResult
from diloco.wire.contribution import encode_contribution
from diloco.wire.header import FRESH


class Uploader:
    """Sends a worker's contributions; shares the worker's trainer, cache and summary."""

    def __init__(
        self,
        opts: WorkerOptions,
        api: ServerAPI,
        say: Reporter,
        *,
        local: LocalTrainer,
        fetcher: Fetcher,
        summary: WorkerSummary,
        react: Reactions,
        faults: FaultInjector,
        peak_flops: float | None,
    ) -> None:
        self.opts, self.api, self.say = opts, api, say
        self.local, self.fetcher, self.summary, self.faults = local, fetcher, summary, faults
        self.react = react  # the worker's: what each answer means
        self.peak_flops = peak_flops  # None: no MFU on the round's line
        self.upload_s: float | None = None  # our last encode + upload took this long

    async def contribute(
        self,
        lease: Lease,
        params: dict[str, torch.Tensor],
        result: InnerResult,
        rate: float,
        *,
        on_saved: Callable[[], None] | None = None,
    ) -> bool:
        """Encode Δ, keep the AdamW state on disk, upload; a refusal is one line saying why.
        ``on_saved``: called once the state is saved, before the upload (the steps ahead
        begin there). Whether the server accepted it."""
        sending = time.perf_counter()  # encoding and upload: what the next round keeps time for
        state = self.fetcher.state_path(lease.run_id)
        try:
            body = await asyncio.to_thread(self.local.contribution, lease, params, result)
        except DivergedError as err:
            self.local.reset()
            state.unlink(missing_ok=True)
            self.say.warn(f"round {lease.round}: {err}; starting over with a fresh optimizer")
            return False
        if body.meta.replay is not None and body.meta.replay.start != FRESH:
            await asyncio.to_thread(keep_as_start, state)  # what an audit may ask for
        await asyncio.to_thread(
            self.local.save_state, state, run_id=lease.run_id, round=lease.round
        )
        if on_saved is not None:
            on_saved()
        util = mfu(rate, self.local.flops_per_token, self.peak_flops)
        head = f"round {lease.round}  loss {result.mean_loss:.4f}  {rate:,.0f} tok/s"
        if util is not None:
            head += f"  MFU {util:.1%}"
        if result.steps < lease.inner_steps:
            head += f"  {result.steps}/{lease.inner_steps} steps (deadline)"
        self.faults.hit("volunteer.upload")
        answer = await self.send(lease, body)
        if isinstance(answer, Refused):
            self.reject(head, body.nbytes, answer)
            return False
        receipt = answer
        self.react.to(Request.UPLOAD)
        self.upload_s = time.perf_counter() - sending
        self.summary.accepted += 1
        self.summary.tokens += result.tokens
        r, note = receipt.receipt, " (already held)" if receipt.repeated else ""
        if r.late:  # merged into a later round's step, discounted
            where = f"round {r.merged_into_round} (staleness {r.staleness}, weight {r.weight})"
            note = f" late into {where}{note}"
        self.say.info(f"{head}  upload {body.nbytes:,} B  accepted{note}")
        revealer = Revealer(self.api, self.say, lease.run_id, state)
        if r.audit is not None:
            await revealer.reveal(lease.round, r.audit, state.with_name(START_FILE))
        await revealer.earlier(lease.round, drawn=r.audit)
        return True

    async def send(self, lease: Lease, body: Contribution) -> UploadReceipt | Refused:
        """Upload; while our round, or the round our late work joins, is closing (the
        server asks for it again shortly), send it again as the reactions say
        (``LATE_RETRY_S``, doubling, for at most ``MAX_WAIT_S`` in all). Any other refusal
        is returned with its reaction."""
        while True:
            try:
                if body.nbytes > lease.max_upload_bytes:  # the server would refuse it: 413
                    raise ApiError(
                        413,
                        ErrorCode.UPLOAD_TOO_LARGE,
                        f"our upload would be {body.nbytes:,} bytes but the round takes at "
                        f"most {lease.max_upload_bytes:,}; tell the run's operator",
                        {},
                    )
                return await self.api.upload(
                    lease.run_id,
                    lease.round,
                    lambda: encode_contribution(body.meta, body.tensors),
                    body.nbytes,
                    lease.upload,
                )
            except ApiError as err:
                reaction = self.react.to(Request.UPLOAD, err)
                if reaction.do is not Do.SEND_AGAIN:
                    return Refused(err, reaction)
                await asyncio.sleep(reaction.wait_s)

    def reject(self, head: str, nbytes: int, refused: Refused) -> None:
        """One line for a refused contribution; the round moving on is normal, the server
        refusing our body is not, and a few of those in a row stop the worker (``FATAL``,
        as do a server error and a refusal of who we are: raised)."""
        err, reaction = refused.err, refused.reaction
        if reaction.do is Do.FATAL and (err.code in FATAL_CODES or err.status >= 500):
            raise err  # who we are, or the server failing: every upload would be refused
        self.summary.rejected += 1
        self.say.always(f"{head}  upload {nbytes:,} B  rejected: {err.code}: {err.detail}")
        if reaction.do is Do.FATAL:
            raise ApiError(err.status, err.code, f"{reaction.why} (last: {err.detail})", err.body)


@dataclass(frozen=True)
class Refused:
    """An upload refused for good, and what the volunteer does about it."""

    err: ApiError
    reaction: Reaction
