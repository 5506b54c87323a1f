"""The volunteer's compute, with no HTTP in it: what one simulated worker does
(``diloco.simulate.run.train_upload``, which ``diloco.simulate.diloco_mode.run_diloco`` and the
protocol simulator call), for one lease at a time.

One :class:`LocalTrainer` lives as long as the worker stays in a run, so AdamW's moments
carry over from round to round (DiLoCo); each round starts by loading the global
parameters θ(t−1) into the model. These functions block: the worker calls them in a
thread so the event loop keeps sending heartbeats.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from client.gpu import Fit, flops_per_token, limit_memory, size_micro_batch
from client.lease import Lease, ProtocolError
from client.optimizer_state import (
    OptimizerStateError,
    SavedState,
    load_state,
    save_state,
)
from diloco.atomic import file_sha256
from diloco.config import ConfigError, RunConfig, parse_config
from diloco.data.text import AHEAD_SEED, lease_stream, range_windows
from diloco.model.architectures import build_model
from diloco.outer.optimizer import pseudo_gradient
from diloco.precision import Precision, choose_precision
from diloco.train import Ahead, InnerResult, InnerTrainer, parameters_of, train_ahead
from diloco.wire.codec import EncodedTensor
from diloco.wire.contribution import ContributionMeta, contribution_nbytes
from diloco.wire.exchange import encode_delta
from diloco.wire.header import FRESH, ReplayRecord

DEVICES = ("auto", "cpu", "cuda", "mps")


class DeviceError(ValueError):
    """The device asked for is not usable on this machine."""


class DivergedError(ValueError):
    """The inner loop produced a non-finite loss or Δ; nothing can be uploaded."""


class StopTraining(Exception):
    """Raised from the step callback to end the inner loop early (round closed, Ctrl+C):
    the work is dropped."""


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda if available, else mps, else cpu; ``cpu``, ``mps``, ``cuda`` or
    ``cuda:N`` must exist on this machine. The volunteer client and ``diloco simulate``
    both choose their device here."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if _mps_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if (
        device is None
        or device.type not in ("cpu", "cuda", "mps")
        or (device.index is not None and device.type != "cuda")
    ):
        raise DeviceError(f"--device must be one of {', '.join(DEVICES)} or cuda:N, not {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            f"--device {name}: torch sees no CUDA GPU (torch.cuda.is_available() is False); "
            "install a CUDA build of torch or use --device cpu"
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise DeviceError(
            f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if device.type == "mps" and not _mps_available():
        raise DeviceError("--device mps: this machine or torch build has no MPS; use --device cpu")
    return device


@dataclass(frozen=True)
class Contribution:
    meta: ContributionMeta
    tensors: dict[str, EncodedTensor]
    nbytes: int  # the body's exact size: the upload's Content-Length


class LocalTrainer:
    """The model and AdamW for one run config; rebuilt only when the config changes.

    ``precision`` is resolved against the device once (``choose_precision``: bf16 or fp16
    with loss scaling on CUDA, fp32 elsewhere); ``micro_batch`` None sizes the micro-batch
    to the device's memory for each run config (``client.gpu.fit_micro_batch``), a number
    fixes it (capped at the run's batch size).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        precision: str = "auto",
        micro_batch: int | None = None,
        gpu_memory_gib: float | None = None,
    ) -> None:
        if micro_batch is not None and micro_batch < 1:
            raise ValueError(f"--micro-batch must be at least 1, not {micro_batch}")
        self.device = device
        self.memory_limit = limit_memory(device, gpu_memory_gib)
        self.precision: Precision = choose_precision(device, precision)
        self.micro_batch = micro_batch
        self.cfg: RunConfig | None = None
        self.trainer: InnerTrainer | None = None
        self.fit: Fit | None = None
        self.flops_per_token = 0.0  # training FLOPs per token of the built model
        self._key: str | None = None
        self.steps_taken = 0  # inner steps taken with this AdamW state (restored ones included)
        # what the AdamW state in memory is, for a lease's replay record: FRESH, the SHA-256
        # of the state file it was saved to or restored from, or None once training moved it
        self.state_digest: str | None = None
        self.lease_start: str | None = None  # state_digest when the lease now trained began

    def prepare(self, config: Mapping[str, Any]) -> tuple[RunConfig, bool]:
        """Build the model for ``config`` unless it is already built; True if (re)built."""
        key = json.dumps(config, sort_keys=True)
        if self.cfg is not None and key == self._key:
            return self.cfg, False
        try:
            cfg = parse_config(dict(config))
        except ConfigError as err:
            raise ProtocolError(
                f"the run's config from the server does not validate here ({err}); "
                "upgrade the client (pip install -U diloco-hub)"
            ) from None
        self.trainer = None  # free the old model before sizing the new one
        fit = size_micro_batch(
            cfg,
            self.device,
            self.precision,
            micro_batch=self.micro_batch,
            memory_limit=self.memory_limit,
        )
        model = build_model(cfg.model)
        self.trainer = InnerTrainer(
            model,
            cfg.inner,
            total_steps=cfg.total_inner_steps,
            device=self.device,
            precision=self.precision,
            micro_batch=fit.micro_batch,
        )
        self.cfg, self._key, self.steps_taken, self.fit = cfg, key, 0, fit
        self.state_digest = FRESH
        self.flops_per_token = flops_per_token(cfg.model, model.num_parameters())
        return cfg, True

    def holds(self, config: Mapping[str, Any]) -> bool:
        """Whether the model and AdamW state are the ones built for ``config``."""
        return self._key is not None and self._key == json.dumps(config, sort_keys=True)

    def describe(self) -> str:
        """How the model trains here: the device, precision and micro-batch."""
        if self.fit is None or self.cfg is None:
            raise RuntimeError("LocalTrainer.prepare must run first")
        batch, fit = self.cfg.inner.batch_size, self.fit
        scaled = " with loss scaling" if self.precision == "fp16" else ""
        memory = (
            f", peak {fit.peak_bytes / 2**30:.2f} of {fit.total_bytes / 2**30:.0f} GiB"
            if fit.peak_bytes is not None and fit.total_bytes
            else ""
        )
        passes = f"{fit.accumulation} pass{'es' if fit.accumulation > 1 else ''} a step"
        return (
            f"{self.device.type} {self.precision}{scaled}, "
            f"micro-batch {fit.micro_batch} of {batch} ({passes}){memory}"
        )

    def reset(self) -> None:
        """Forget the model and AdamW state (after a divergence): the next round starts fresh."""
        self.cfg = self.trainer = self._key = self.fit = None
        self.steps_taken = 0
        self.state_digest = self.lease_start = None

    @property
    def config_key(self) -> str:
        """Identifies the run config the model and AdamW state were built for."""
        if self._key is None:
            raise RuntimeError("LocalTrainer.prepare must run first")
        return hashlib.sha256(self._key.encode()).hexdigest()

    def save_state(self, path: Path, *, run_id: str, round: int) -> Path:
        """Write the AdamW state to ``path`` (atomically) for a restart to resume from, and
        for an audit of the next lease to replay from (its digest is that lease's start)."""
        if self.trainer is None or self.cfg is None:
            raise RuntimeError("LocalTrainer.prepare must run before save_state")
        saved = save_state(
            path,
            self.trainer.model,
            self.trainer.optimizer,
            run_id=run_id,
            config_key=self.config_key,
            steps=self.steps_taken,
            round=round,
            error=self.trainer.error_feedback,
            first_moment=not self.cfg.inner.reset_momentum,
        )
        self.state_digest = file_sha256(saved)
        return saved

    def keep_saved(self, path: Path, *, run_id: str) -> None:
        """Before a lease: if the AdamW state moved since it was last saved or restored (a
        lease given up mid-way), save it to ``path`` now, so that the lease begins from a
        state a file holds, which an audit of it may ask for (docs/verification.md)."""
        if self.state_digest is None:
            self.save_state(path, run_id=run_id, round=0)

    def resume(self, path: Path, *, run_id: str) -> tuple[bool, str]:
        """After (re)building the model: the AdamW state saved at ``path`` restored if it
        fits; whether it was (False also when there was none) and a sentence saying so."""
        device = self.device
        if not path.exists():
            return True, f"fresh AdamW on {device}"
        try:
            saved = self.restore_state(path, run_id=run_id)
        except OptimizerStateError as err:
            return False, f"not resuming the saved AdamW state ({err}); starting fresh"
        return True, (
            f"AdamW state restored from {path} (step {saved.steps}, saved after round "
            f"{saved.round}) on {device}"
        )

    def restore_state(self, path: Path, *, run_id: str) -> SavedState:
        """Load the AdamW state saved at ``path``; OptimizerStateError if it does not fit."""
        if self.trainer is None:
            raise RuntimeError("LocalTrainer.prepare must run before restore_state")
        saved = load_state(
            path,
            self.trainer.model,
            self.trainer.optimizer,
            run_id=run_id,
            config_key=self.config_key,
        )
        self.steps_taken = saved.steps
        self.trainer.error_feedback = saved.error
        self.state_digest = file_sha256(path)
        return saved

    def batches(
        self, lease: Lease, shard: torch.Tensor, *, ahead: bool = False
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The lease's batches (``lease_stream``, as the simulator reads a lease): its range
        each window once, or random windows of its shard, drawn with ``lease.seed``;
        ``ahead``, for the steps trained ahead after it: its data again, in an order of
        their own, pass after pass."""
        if self.cfg is None:
            raise RuntimeError("LocalTrainer.prepare must run first")
        ranged, inner = lease.data_range is not None, self.cfg.inner
        if ranged and not ahead:
            available = range_windows(int(shard.numel()), self.cfg.model.block_size)
            if available // inner.batch_size < lease.inner_steps:
                raise ProtocolError(
                    f"the lease's range holds {available} windows, fewer than "
                    f"{lease.inner_steps} steps of {inner.batch_size}; tell the run's operator"
                )
        return lease_stream(
            shard,
            ranged=ranged,
            batch_size=inner.batch_size,
            block_size=self.cfg.model.block_size,
            seed=lease.seed + AHEAD_SEED if ahead else lease.seed,
            repeat=ahead,
        )

    def train(
        self,
        lease: Lease,
        params: Mapping[str, torch.Tensor],
        shard: torch.Tensor,
        *,
        on_step: Callable[[int, float, int], None],
        stop: Callable[[], bool],
        until: Callable[[int], str | None] | None = None,
        ahead: Ahead | None = None,
    ) -> InnerResult:
        """Load θ(t−1), then H AdamW steps on batches drawn with ``lease.seed``.
        ``on_step(done, loss, tokens)`` reports; ``stop()`` true ends the loop early and
        drops the work (StopTraining). ``until(done)`` returning a sentence (the deadline,
        ``client.pacing``) ends it too, but keeps the work: the result holds the ``done``
        steps taken (at least 1: it is asked after each step but the last).

        ``ahead``: steps this lease's H began with (``train_ahead``); they are folded onto
        θ(t−1) and only the rest (at least one) are taken here. The result's steps count
        them, its tokens do not (they read the last lease's data, counted by that lease)."""
        if self.trainer is None or self.cfg is None:
            raise RuntimeError("LocalTrainer.prepare must run before train")
        trainer = self.trainer
        # replayable only from a state the volunteer can reveal, and from the base itself
        self.lease_start = self.state_digest if ahead is None else None
        self.state_digest = None
        k = trainer.start_after(params, ahead)
        steps = max(1, lease.inner_steps - k)
        tokens_per_step = self.cfg.tokens_per_step

        def step_done(i: int, loss: float) -> None:
            self.steps_taken += 1
            on_step(k + i + 1, loss, (i + 1) * tokens_per_step)
            if i + 1 < steps and stop():
                raise StopTraining

        def deadline(done: int) -> bool:  # the steps taken so far are the result
            return until is not None and until(k + done) is not None

        rest = trainer.run(
            steps,
            start_step=lease.start_step + k,
            next_batch=self.batches(lease, shard),
            on_step=step_done,
            stop_after=deadline,
        )
        if ahead is None:
            return rest
        return InnerResult(k + rest.steps, rest.tokens, ahead.result.losses + rest.losses)

    def train_ahead(
        self, last: Lease, shard: torch.Tensor, *, steps: int, stop: Callable[[], bool]
    ) -> Ahead:
        """Overlap (``[inner] overlap``): up to ``steps`` steps from where the model is, the
        end of ``last``'s round (its upload is on its way), on ``last``'s data (its
        ``shard``) again, from the step after its nominal H; ``stop()`` true ends them after
        the step in progress (the next version is here). The next lease's ``train`` folds
        them in."""
        if self.trainer is None or self.cfg is None:
            raise RuntimeError("LocalTrainer.prepare must run before train_ahead")

        self.state_digest = None
        ahead = train_ahead(
            self.trainer,
            steps,
            start_step=last.start_step + self.cfg.inner.steps,
            next_batch=self.batches(last, shard, ahead=True),
            stop_after=lambda done: stop(),
        )
        self.steps_taken += ahead.result.steps
        return ahead

    def contribution(
        self, lease: Lease, params: Mapping[str, torch.Tensor], result: InnerResult
    ) -> Contribution:
        """Δ = θ(t−1) − θi, compressed by the run's codec, with the header's fields."""
        if self.trainer is None or self.cfg is None:
            raise RuntimeError("LocalTrainer.prepare must run before contribution")
        if not math.isfinite(result.mean_loss):
            raise DivergedError(f"the inner loop diverged (mean loss {result.mean_loss})")
        new = {n: p.detach().float().cpu() for n, p in parameters_of(self.trainer.model).items()}
        delta = pseudo_gradient(params, new)
        if not all(bool(torch.isfinite(d).all()) for d in delta.values()):
            raise DivergedError("the inner loop diverged (Δ holds NaN or Inf)")
        # the residual of error feedback (int4, int2, sparse) is kept with the AdamW state
        encoded, codec, self.trainer.error_feedback = encode_delta(
            delta, self.cfg.compression, self.trainer.error_feedback
        )
        meta = ContributionMeta(
            run_id=lease.run_id,
            round=lease.round,
            base_version=lease.base_version,
            tokens=result.tokens,
            inner_steps=result.steps,
            loss=result.mean_loss,
            codec=codec,
            replay=self.replay_record(),
        )
        return Contribution(meta, encoded, contribution_nbytes(meta, encoded))

    def replay_record(self) -> ReplayRecord | None:
        """What an audit needs of the lease just trained beyond the lease itself (None: it
        began from steps trained ahead, or from a state no file holds)."""
        if self.lease_start is None or self.fit is None:
            return None
        return ReplayRecord(self.lease_start, self.precision, self.fit.micro_batch)


def stop_flag(*events: threading.Event) -> Callable[[], bool]:
    return lambda: any(e.is_set() for e in events)
