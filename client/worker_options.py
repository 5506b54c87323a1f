"""What the volunteer loop (``client.worker``) is given and what it reports: its options,
its summary line, and its reactions to the server's answers (``diloco.protocol.volunteer``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.api import ApiError, RetryPolicy, Timeouts
from diloco.protocol.volunteer import Answer, Reaction, Request, VolunteerState, step


class Reactions:
    """The volunteer's reactions (``diloco.protocol.volunteer``) and what they remember;
    the worker and its uploader share one, and do what each answer's reaction says."""

    def __init__(self) -> None:
        self.state = VolunteerState()

    def to(
        self, to: Request, err: ApiError | None = None, body: Mapping[str, Any] | None = None
    ) -> Reaction:
        """React to the server's answer to ``to``: ``err``, or a success with ``body``."""
        if err is None:
            return self.answer(Answer(to, body=body or {}))
        return self.answer(Answer(to, code=err.code, status=err.status, body=err.body))

    def answer(self, answer: Answer) -> Reaction:
        self.state, reaction = step(self.state, answer)
        return reaction


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
    ahead_steps: int = 0  # steps trained while a round closed (overlap), folded into the next
    stopped_because: str = "stopped"
    signal: int | None = None  # the signal that stopped the worker, if one did
    time_up: bool = False  # --max-hours stopped it
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        short = f"{self.cut_short} cut short for the deadline, " if self.cut_short else ""
        skipped = f"{self.skipped} skipped (too little time), " if self.skipped else ""
        ahead = f"{self.ahead_steps} steps trained ahead, " if self.ahead_steps else ""
        return (
            f"{self.stopped_because}: {self.accepted} contributions accepted, "
            f"{self.rejected} rejected, {self.abandoned} abandoned, {short}{skipped}{ahead}"
            f"{self.tokens:,} tokens in {elapsed / 60:.1f} min"
        )
