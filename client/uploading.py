"""The upload half of a volunteer's round (``client.worker``): encode Δ, keep the AdamW
state on disk, send it (again, while a round it joins is closing), and one line for what
the server answered; a few refusals of our body in a row stop the worker."""

from __future__ import annotations

import asyncio
import time

import torch

from client.api import ApiError, ServerAPI, UploadReceipt
from client.fetch import Fetcher
from client.gpu import mfu
from client.lease import Lease
from client.progress import Reporter
from client.training import Contribution, DivergedError, LocalTrainer
from client.worker_options import (
    BUSY_CODES,
    MAX_INVALID_IN_A_ROW,
    REJECTED_CODES,
    WorkerOptions,
    WorkerSummary,
    still_welcome,
)
from diloco.faults import FaultInjector
from diloco.protocol.late import LATE_RETRY_S
from diloco.train import InnerResult
from diloco.wire import encode_contribution


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
        faults: FaultInjector,
        peak_flops: float | None,
    ) -> None:
        self.opts, self.api, self.say = opts, api, say
        self.local, self.fetcher, self.summary, self.faults = local, fetcher, summary, faults
        self.peak_flops = peak_flops  # None: no MFU on the round's line
        self.invalid_in_a_row = 0
        self.upload_s: float | None = None  # our last encode + upload took this long

    async def contribute(
        self, lease: Lease, params: dict[str, torch.Tensor], result: InnerResult, rate: float
    ) -> None:
        """Encode Δ, keep the AdamW state on disk, upload; a refusal is one line saying why."""
        sending = time.perf_counter()  # encoding and upload: what the next round keeps time for
        state = self.fetcher.state_path(lease.run_id)
        try:
            body = await asyncio.to_thread(self.local.contribution, lease, params, result)
        except DivergedError as err:
            self.local.reset()
            state.unlink(missing_ok=True)
            self.say.warn(f"round {lease.round}: {err}; starting over with a fresh optimizer")
            return
        await asyncio.to_thread(
            self.local.save_state, state, run_id=lease.run_id, round=lease.round
        )
        util = mfu(rate, self.local.flops_per_token, self.peak_flops)
        head = f"round {lease.round}  loss {result.mean_loss:.4f}  {rate:,.0f} tok/s"
        if util is not None:
            head += f"  MFU {util:.1%}"
        if result.steps < lease.inner_steps:
            head += f"  {result.steps}/{lease.inner_steps} steps (deadline)"
        try:
            if body.nbytes > lease.max_upload_bytes:
                raise ApiError(
                    413,
                    "upload_too_large",
                    f"our upload would be {body.nbytes:,} bytes but the round takes at most "
                    f"{lease.max_upload_bytes:,}; tell the run's operator",
                    {},
                )
            self.faults.hit("volunteer.upload")
            receipt = await self.send(lease, body)
        except ApiError as err:
            if err.status >= 500 or err.status in (401, 403):
                raise
            self.reject(head, body.nbytes, err)
            return
        self.upload_s = time.perf_counter() - sending
        self.invalid_in_a_row = 0
        self.summary.accepted += 1
        self.summary.tokens += result.tokens
        r, note = receipt.receipt, " (already held)" if receipt.repeated else ""
        if r.late:  # merged into a later round's step, discounted
            where = f"round {r.merged_into_round} (staleness {r.staleness}, weight {r.weight})"
            note = f" late into {where}{note}"
        self.say.info(f"{head}  upload {body.nbytes:,} B  accepted{note}")

    async def send(self, lease: Lease, body: Contribution) -> UploadReceipt:
        """Upload; while our round, or the round our late work joins, is closing (the
        server asks for it again shortly), send it again after LATE_RETRY_S, doubling, for
        at most ``max_wait_s`` in all."""
        tries = 0
        while True:
            try:
                return await self.api.upload(
                    lease.run_id,
                    lease.round,
                    lambda: encode_contribution(body.meta, body.tensors),
                    body.nbytes,
                    lease.upload,
                )
            except ApiError as err:
                waited = LATE_RETRY_S * (2**tries - 1)
                if not still_welcome(lease, err.code, err.body) or waited > self.opts.max_wait_s:
                    raise
                await asyncio.sleep(LATE_RETRY_S * 2**tries)
                tries += 1

    def reject(self, head: str, nbytes: int, err: ApiError) -> None:
        """One line for a refused contribution; the round moving on is normal, the server
        refusing our body is not, and a few of those in a row stop the worker."""
        self.summary.rejected += 1
        self.say.always(f"{head}  upload {nbytes:,} B  rejected: {err.code}: {err.detail}")
        if err.code in REJECTED_CODES or err.code in BUSY_CODES:
            return
        self.invalid_in_a_row += 1
        if self.invalid_in_a_row >= MAX_INVALID_IN_A_ROW:
            raise ApiError(
                err.status,
                err.code,
                f"the server refused {self.invalid_in_a_row} contributions in a row "
                f"(last: {err.detail}); this client may not match the server's version: "
                "re-run the installer or pip install -U diloco-hub",
                err.body,
            )
