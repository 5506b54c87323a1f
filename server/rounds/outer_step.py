"""The compute of a close on the server: the round's files staged, ``diloco.outer.close``, the
version published.

It runs in a worker thread with no transaction, row lock or pooled connection held
(``server.rounds.closing`` claims before and publishes after). The close itself — robust
aggregate, outer step, int8 delta with error feedback, every step judged before it is
published — is ``diloco.outer.close.close_round``, the very code ``diloco simulate`` runs; here
it reads the base version and the contributions staged from storage (on disk: the blobs'
own files; on object storage: fetched to scratch, in parallel) and writes the version's
three files where ``Stage.publish`` puts them in the store. The delta is durable before any
row names it; the parameters and the outer state are handed back written, and committed
after the version is published (``server.rounds.full_files``).

The judge is a small fixed sample: the first ``[aggregation] judge_windows`` eval windows
of the run's validation data (``server.checkpoints.evals.evaluate_file``), the same tokens
for the base and the step. The base version's judging loss is kept in memory per version
(the step a close publishes is the next close's base). The full eval of the published
version stays deferred (``server.rounds.version_eval``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.config import RunConfig
from diloco.data.text import lease_stream, read_lease_tokens
from diloco.faults import FaultInjector
from diloco.outer.checks import Check, RecentChange
from diloco.outer.close import (
    Closed,
    CloseInputs,
    Evaluate,
    Upload,
    VersionPaths,
    close_round,
    folding,
)
from diloco.outer.robust import Share
from diloco.outer.scoring import Score, Windows, lease_windows
from diloco.protocol.state import Decision
from server.checkpoints import evals
from server.checkpoints import service as checkpoints_service
from server.metrics import CLOSE_FOLDED
from server.rounds import full_files
from server.rounds.fold_sums import folds_for
from server.runs import data as run_data
from server.storage import keys
from server.storage.base import Storage
from server.storage.staging import Stage

log = logging.getLogger("diloco.rounds")

__all__ = ["OuterResult", "StepInputs", "Stored", "apply_outer_step"]


@dataclass(frozen=True)
class LeaseData:
    """Where a contribution's lease read its data, as its volunteer read it (``load_shard``,
    ``lease_stream``), and which of its windows the scoring reads again (``lease_picks``)."""

    shard_key: str
    seed: int
    dtype: str  # the shard's tokens
    chunk_len: int  # a text run's shard rows
    steps: int  # the inner steps the upload trained (its stream's batches)
    secret: int  # the lease's round's check seed: draws the windows scored
    start: int | None = None  # a dataset lease's range
    tokens: int | None = None


@dataclass(frozen=True)
class Stored:
    """A contribution of the round as the close reads it."""

    id: str
    blob_key: str
    weight: float  # the tokens it counts for
    norm: float  # ‖Δ‖, measured when it was accepted
    lease: LeaseData | None = None  # None: not scored (late work)
    score: Score | None = None  # taken on arrival (server.rounds.arrival_scores)


@dataclass(frozen=True)
class StepInputs:
    run_id: str
    version: int  # the version this close publishes (= the round's index)
    cfg: RunConfig
    base_params_key: str  # the base version's parameters
    base_state_key: str  # its outer state (momentum, residual)
    contributions: list[Stored]  # in the order they were accepted
    history: list[float]  # norms of the run's latest aggregated contributions
    quorum: int
    check_seed: int  # the round's secret sampling seed (diloco.outer.checks)
    recent: list[RecentChange]  # the run's last published changes, sampled


@dataclass(frozen=True)
class OuterResult:
    excluded: dict[str, str]  # contribution id -> why it was left out (unreadable, guard)
    exclusion_codes: dict[str, str]  # contribution id -> blob_unreadable | guard
    # decide_after_exclusions' verdict when a blob was unreadable (None: none was)
    decision: Decision | None
    files: checkpoints_service.VersionFiles | None  # None: no step (below quorum)
    update_norm: float | None
    judge_loss: float | None  # the step's loss on the judging sample (None: unjudged)
    base_judge_loss: float | None  # the base version's, on the same sample
    shares: dict[str, Share]  # what each aggregated contribution put in
    # by stage: load, pass (and its parts pass_read, pass_sum, pass_step, pass_write),
    # judge, write (the delta's fsync and rename); tries added up
    seconds: dict[str, float]
    checks: dict[str, Check]  # every contribution's (diloco.outer.checks)
    change_sample: torch.Tensor | None  # the published change, sampled (None: no step)
    # the version's parameters and outer state, written, not committed (None: no step)
    pending: full_files.Pending | None = None
    recipe: full_files.Recipe | None = None  # what a rebuild of them needs (None: no step)


def apply_outer_step(storage: Storage, inputs: StepInputs, *, faults: FaultInjector) -> OuterResult:
    """Stage the round's files, close it (``diloco.outer.close.close_round``: no files and
    a decision to reopen when too few contributions are left for a step, the unreadable or
    the ones the guard blamed left out) and put the version's delta into the store; the
    parameters and the outer state are left to write (``OuterResult.pending``: the caller
    writes and commits them after publishing, ``server.rounds.full_files``). No row is
    written here."""
    at = keys.version(inputs.run_id, inputs.version)
    stage = Stage(storage)
    pending = None
    folds = folds_for(storage)  # a fold and its round's close never overlap
    # held until the full files are written (their pass reads the round's running sum)
    lock = folds.lock(inputs.run_id, inputs.version)
    lock.acquire()
    try:
        folder = folds.folder(inputs.run_id, inputs.version)
        closed, base_loss = _close(storage, stage, inputs, at, faults, folder)
        if not closed.committed:
            return OuterResult(
                closed.excluded, closed.exclusion_codes, closed.decision, None, None, None,
                base_loss, {}, closed.seconds, closed.checks, None,
            )  # fmt: skip
        assert closed.pending is not None
        pending = full_files.Pending(stage, closed.pending, at, lock)  # it lets the lock go
        # object storage: the delta goes up, durable before a row names it
        stage.publish([at.delta])
        faults.hit("close.write")
    except BaseException:
        if pending is not None:
            pending.discard()
        raise
    finally:
        if pending is None:
            stage.close()
            lock.release()
    return _published(inputs, closed, base_loss, pending)


def _published(
    inputs: StepInputs, closed: Closed, base_loss: float | None, pending: full_files.Pending
) -> OuterResult:
    """What a close that published its delta hands back: the version's files (their
    parameters still to write: ``pending``) and what a rebuild of them needs."""
    assert closed.pending is not None and closed.params_sha256 is not None
    assert closed.delta_sha256 is not None
    files = checkpoints_service.version_files(
        run_id=inputs.run_id,
        version=inputs.version,
        sha256=closed.params_sha256,
        nbytes=closed.pending.params_nbytes,
        delta_sha256=closed.delta_sha256,
        delta_nbytes=closed.pending.delta_nbytes,
    )
    if closed.judge_loss is not None:  # the next close's base
        JUDGED.put(inputs.run_id, inputs.version, closed.judge_loss)
    kept = [(c.id, c.weight, c.norm) for c in inputs.contributions if c.id not in closed.excluded]
    return OuterResult(
        closed.excluded,
        closed.exclusion_codes,
        closed.decision,
        files,
        closed.update_norm,
        closed.judge_loss,
        base_loss,
        closed.shares,
        closed.seconds,
        closed.checks,
        closed.change_sample,
        pending,
        full_files.Recipe(kept, list(inputs.history)),
    )


def _close(
    storage: Storage,
    stage: Stage,
    inputs: StepInputs,
    at: keys.VersionKeys,
    faults: FaultInjector,
    folder: Path,
) -> tuple[Closed, float | None]:
    """``close_round`` on the round's files, staged (its running sum in ``folder``, if this
    process folded it: ``server.rounds.folding``); and the base version's judging loss."""
    stage.inputs([inputs.base_params_key, inputs.base_state_key])
    blobs = stage.inputs((c.blob_key for c in inputs.contributions), missing_ok=True)
    own, score_sample = _score_data(storage, stage, inputs)
    close = CloseInputs(
        run_id=inputs.run_id,
        version=inputs.version,
        cfg=inputs.cfg,
        base_params=stage.input(inputs.base_params_key),
        base_state=stage.input(inputs.base_state_key),
        uploads=[
            Upload(c.id, blobs[c.blob_key], c.weight, c.norm, own.get(c.id), c.score)
            for c in inputs.contributions
        ],
        history=inputs.history,
        quorum=inputs.quorum,
        out=VersionPaths(stage.output(at.params), stage.output(at.state), stage.output(at.delta)),
        check_seed=inputs.check_seed,
        recent=inputs.recent,
        score_sample=score_sample,
        fold=folding(inputs.cfg, inputs.history, folder if folder.exists() else None),
    )
    judge = _judge(storage, inputs)
    base_loss = JUDGED.get(inputs.run_id, inputs.version - 1)
    closed = close_round(close, evaluate=judge, base_judge_loss=base_loss, hit=faults.hit)
    CLOSE_FOLDED.inc(closed.folded)
    if closed.base_judge_loss is not None:  # measured by this close: kept for a retry
        base_loss = closed.base_judge_loss
        JUDGED.put(inputs.run_id, inputs.version - 1, base_loss)
    return closed, base_loss


def _score_data(
    storage: Storage, stage: Stage, inputs: StepInputs
) -> tuple[dict[str, Windows], Windows | None]:
    """The scoring's windows (``diloco.outer.scoring``): ``score_windows`` windows of each
    contribution's lease's data that was not scored on arrival (``lease_picks``), read from
    its shard as its volunteer read them, and the validation data's first ones; nothing
    with scoring off."""
    cfg = inputs.cfg
    leased = [c for c in inputs.contributions if c.lease is not None]
    if not cfg.aggregation.score_windows or not leased:
        return {}, None
    sample = score_sample(storage, inputs.run_id, cfg)
    if sample is None:
        return {}, None
    unscored = [c for c in leased if c.score is None]
    keys_ = {c.lease.shard_key for c in unscored if c.lease is not None}
    paths = stage.inputs(keys_, missing_ok=True)  # a missing one: that upload is unscored
    own: dict[str, Windows] = {}
    shards: dict[str, torch.Tensor] = {}  # a text run's shards, each read once
    for c in unscored:
        assert c.lease is not None
        try:
            own[c.id] = read_lease_windows(c.lease, paths.get(c.lease.shard_key), shards, cfg)
        except (OSError, ValueError, RuntimeError, StopIteration) as err:  # unscored, logged
            log.warning("run %s: contribution %s not scored: its lease's data: %s",
                        inputs.run_id, c.id, err)  # fmt: skip
    return own, sample


def score_sample(storage: Storage, run_id: str, cfg: RunConfig) -> Windows | None:
    """The windows every scored upload is measured on besides its own: the validation
    data's first ``score_windows``; None when it has not one."""
    n, block = cfg.aggregation.score_windows, cfg.model.block_size
    val = run_data.load_val(storage, run_id, cfg, tokens=n * block + 1)
    if val.numel() <= block:  # not one window to judge by
        return None
    return Windows.validation(val, n, block)


def read_lease_windows(
    lease: LeaseData, path: Path | None, shards: dict[str, torch.Tensor], cfg: RunConfig
) -> Windows:
    """The ``score_windows`` windows of a lease's stream its scoring reads (``lease_picks``),
    its shard staged at ``path`` (None: it could not be fetched)."""
    if path is None:
        raise OSError(f"its shard {lease.shard_key} could not be fetched")
    ranged = lease.start is not None
    data = shards.get(lease.shard_key)
    if data is None:
        data = read_lease_tokens(
            path, dtype=lease.dtype, chunk_len=lease.chunk_len, start=lease.start,
            tokens=lease.tokens,
        )  # fmt: skip
        if not ranged:
            shards[lease.shard_key] = data
    batches = lease_stream(
        data, ranged=ranged, batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size,
        seed=lease.seed,
    )  # fmt: skip
    return lease_windows(batches, cfg, steps=lease.steps, secret=lease.secret, lease=lease.seed)


def _judge(storage: Storage, inputs: StepInputs) -> Evaluate:
    windows = inputs.cfg.aggregation.judge_windows

    def evaluate(params_path: Path, delta_path: Path | None) -> float:
        return evals.evaluate_file(
            storage, run_id=inputs.run_id, cfg=inputs.cfg, params_path=params_path,
            windows=windows, delta_path=delta_path,
        )  # fmt: skip

    return evaluate


class JudgedLosses:
    """The judging loss of recently published versions, by (run, version): a close's
    base was the close before's step. In memory, bounded: a version not here (another
    process closed it, a restart) is evaluated again, on the same tokens."""

    def __init__(self, keep: int = 1024) -> None:
        self._losses: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()  # closes of several runs run on several threads

    def get(self, run_id: str, version: int) -> float | None:
        with self._lock:
            return self._losses.get((run_id, version))

    def put(self, run_id: str, version: int, loss: float) -> None:
        with self._lock:
            self._losses[(run_id, version)] = loss
            while len(self._losses) > self._keep:
                self._losses.popitem(last=False)


JUDGED = JudgedLosses()
