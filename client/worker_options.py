"""What the volunteer loop (``client.worker``) is given and what it reports: its options,
its summary line, and how it reads the server's refusal codes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.api import UPLOAD_TARGET_REFUSED, RetryPolicy, Timeouts
from client.lease import Lease
from diloco.protocol.late import welcome_late
from diloco.protocol.messages import ErrorCode

# the round moved on without us: drop this round's work and join again
REJECTED_CODES = frozenset(
    {
        ErrorCode.ROUND_CLOSED,
        ErrorCode.BASE_VERSION_MISMATCH,
        ErrorCode.NO_LEASE,
        ErrorCode.DUPLICATE_CONTRIBUTION,
        ErrorCode.RUN_NOT_ACTIVE,
        UPLOAD_TARGET_REFUSED,
    }
)
# a heartbeat answer that means the lease is no longer worth training for (a paused or
# ended run takes no upload: the join that follows waits or stops)
LOST_LEASE_CODES = frozenset({ErrorCode.ROUND_CLOSED, ErrorCode.NO_LEASE, ErrorCode.RUN_NOT_ACTIVE})


def still_welcome(lease: Lease, code: str, body: dict[str, Any]) -> bool:
    """A ``round_closed`` answer (heartbeat or upload) about ``lease``'s round whose work the
    run still merges late (``diloco.protocol.late``): finish it and upload, don't abandon.
    A server from before late work sends no ``max_staleness``: 0, no late work."""
    rounds = lease.config.get("rounds")
    bound = rounds.get("max_staleness", 0) if isinstance(rounds, dict) else 0
    return isinstance(bound, int) and welcome_late(
        lease.round, code, body.get("current_round"), bound
    )


# the upload was still refused after every retry (client.api waits the server's Retry-After):
# the server was too busy, or our connection too slow; not our body's fault
BUSY_CODES = frozenset({ErrorCode.TOO_MANY_UPLOADS, ErrorCode.REQUEST_TIMEOUT})
# the server refused our upload itself (not the round's timing): worth a few more rounds,
# in case it was one bad round, but not forever (a client the server cannot read)
MAX_INVALID_IN_A_ROW = 3


@dataclass(frozen=True)
class WorkerOptions:
    server_url: str
    run_id: str | None = None  # None: the newest active run
    invite: str | None = None  # a private run's invite code: become a member first
    name: str | None = None  # register under this name (first use only)
    token: str | None = None  # use this contributor token instead of the stored one
    device: str = "auto"  # auto | cpu | cuda | mps
    precision: str = "auto"  # auto | bf16 | fp16 | fp32 (diloco.precision)
    micro_batch: int | None = None  # None: sized to the device (client.gpu.fit_micro_batch)
    gpu_memory_gib: float | None = None  # cap on this process's share of the CUDA card
    max_rounds: int | None = None  # stop after this many accepted contributions
    max_hours: float | None = None  # stop (releasing the lease) after this long
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
    faults: str = ""  # tests only: points where this volunteer fails or dies (diloco.faults)


@dataclass
class WorkerSummary:
    accepted: int = 0
    rejected: int = 0
    abandoned: int = 0  # rounds that closed while we were still training
    skipped: int = 0  # leases not started: even min_steps would have missed the deadline
    cut_short: int = 0  # rounds stopped early for the deadline (what was done was uploaded)
    tokens: int = 0  # trained on in accepted contributions
    stopped_because: str = "stopped"
    signal: int | None = None  # the signal that stopped the worker, if one did
    time_up: bool = False  # --max-hours stopped it
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        short = f"{self.cut_short} cut short for the deadline, " if self.cut_short else ""
        skipped = f"{self.skipped} skipped (too little time), " if self.skipped else ""
        return (
            f"{self.stopped_because}: {self.accepted} contributions accepted, "
            f"{self.rejected} rejected, {self.abandoned} abandoned, {short}{skipped}"
            f"{self.tokens:,} tokens in {elapsed / 60:.1f} min"
        )


class NoActiveRun(Exception):
    """``--run`` was not given and the server has no active run to join."""
