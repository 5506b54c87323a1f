"""The compute of a close: robust aggregate and guarded outer step, one pass, files written.

It runs in a worker thread with no transaction, row lock or pooled connection held
(``server.rounds.closing`` claims before and publishes after). Given the same inputs it
writes the same bytes, so a close that a crash interrupts is simply done again.

- The contributions are read back from storage, chunk by chunk (``diloco.outer_pass``),
  and combined as the run's ``[aggregation]`` says (``diloco.robust``: clipped to a
  multiple of the round's median norm by default), each weighted by the tokens it counts
  for. ``mean`` and ``clipped_mean`` take one pass that sums, steps and writes the new
  version; ``centered_clip`` needs the clipped mean first (one more pass, and the model's
  size in memory for it).
- The version's files: parameters, outer state (momentum and delta residual), and the
  int8 delta from the base version (``diloco.delta``). Memory stays a few chunks a
  contribution: nothing of the model's size is held but by ``centered_clip``.
- The step is judged before anything is published (``diloco.protocol.rules.judge_step``):
  one that is not finite is tried again without the contribution farthest from the
  aggregate. One whose update is *suspicious* (longer than ``suspect_multiple`` times the
  round's median contribution) is evaluated before publishing and discarded the same way
  if it raises the eval loss past ``max_loss_ratio`` times the base's; any other step is
  published at once, and its eval loss is measured afterwards (``server.rounds.version_eval``).
- A contribution whose stored blob cannot be read (missing, damaged: its trailer digest
  fails) is left out with the reason and the pass started over without it;
  ``decide_after_exclusions`` then says whether the others still make a step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from diloco import delta as deltas
from diloco.checkpoint import (
    OuterStateFile,
    open_outer_state,
    params_entries,
    params_metadata,
    state_entries,
    state_metadata,
)
from diloco.codec import Int8Codec, make_codec
from diloco.config import RunConfig
from diloco.faults import FaultInjector
from diloco.outer_pass import Hyper, Outputs, PassResult, Step, UploadFile, run_pass
from diloco.protocol.rules import decide_after_exclusions, judge_step
from diloco.protocol.state import Action, Decision, StepVerdict
from diloco.robust import Share, SourceUnreadable, centre_pulls, clip_factors, cosine, distances
from diloco.tensorfile import TensorFileReader, TensorFileWriter
from server.checkpoints import evals
from server.checkpoints import service as checkpoints_service
from server.staging import Stage
from server.storage import Storage

log = logging.getLogger("diloco.rounds")


@dataclass(frozen=True)
class Stored:
    """A contribution of the round as the close reads it."""

    id: str
    blob_key: str
    weight: float  # the tokens it counts for
    norm: float  # ‖Δ‖, measured when it was accepted


@dataclass(frozen=True)
class StepInputs:
    run_id: str
    version: int  # the version this close publishes (= the round's index)
    cfg: RunConfig
    base_params_key: str  # the base version's parameters
    base_state_key: str  # its outer state (momentum, residual)
    base_eval_loss: float | None  # the base version's, when known (None: pending)
    contributions: list[Stored]  # in the order they were accepted
    history: list[float]  # norms of the run's latest aggregated contributions
    quorum: int


class StepRejected(Exception):
    """The guard discarded every step it could make with quorum: nothing is published."""

    def __init__(self, verdict: StepVerdict, left_out: Mapping[str, str]) -> None:
        tried = f"; left out {sorted(left_out)} first" if left_out else ""
        super().__init__(f"{verdict.reason}{tried}")
        self.verdict, self.left_out = verdict, dict(left_out)


@dataclass(frozen=True)
class OuterResult:
    excluded: dict[str, str]  # contribution id -> why it was left out (unreadable, guard)
    exclusion_codes: dict[str, str]  # contribution id -> blob_unreadable | guard
    # decide_after_exclusions' verdict when a blob was unreadable (None: none was)
    decision: Decision | None
    files: checkpoints_service.VersionFiles | None  # None: no step (below quorum)
    update_norm: float | None
    eval_loss: float | None  # measured before publishing (a suspicious step); else pending
    base_eval_loss: float | None  # measured here when the inputs did not know it
    shares: dict[str, Share]  # what each aggregated contribution put in
    # by stage: load, pass (and its parts pass_read, pass_sum, pass_step, pass_write),
    # judge, write (fsync and rename); tries added up
    seconds: dict[str, float]


@dataclass
class _Base:
    """The base version, open for reading, and what every try of the step shares."""

    params: TensorFileReader
    state: OuterStateFile
    shapes: dict[str, tuple[int, ...]]
    upload_codec: dict
    delta_codec: Int8Codec
    hyper: Hyper

    def close(self) -> None:
        self.params.close()
        self.state.reader.close()


@dataclass
class _Tried:
    out: Outputs
    result: PassResult
    shares: dict[str, Share]


def apply_outer_step(
    storage: Storage, inputs: StepInputs, *, eval_windows: int, faults: FaultInjector
) -> OuterResult:
    """Aggregate, step under the guard and write ``inputs.version`` (module docstring)."""
    clock = _StageClock()
    with Stage(storage) as stage:
        # on disk: the blobs' own files; on object storage: fetched to scratch, in parallel
        stage.inputs([inputs.base_params_key, inputs.base_state_key])
        stage.inputs((c.blob_key for c in inputs.contributions), missing_ok=True)
        base = _open_base(stage, inputs)
        try:
            return _close(stage, inputs, base, clock, eval_windows, faults)
        finally:
            base.close()


def _open_base(stage: Stage, inputs: StepInputs) -> _Base:
    cfg = inputs.cfg
    params = TensorFileReader(stage.input(inputs.base_params_key))
    try:
        state = open_outer_state(stage.input(inputs.base_state_key))
    except BaseException:
        params.close()
        raise
    names = json.loads(params.metadata["param_names"])
    return _Base(
        params,
        state,
        {n: params.entries[n].shape for n in names},
        make_codec(cfg.compression.kind, cfg.compression.block_size).describe(),
        Int8Codec(cfg.compression.block_size),
        Hyper(cfg.outer.lr_at(inputs.version), cfg.outer.momentum, cfg.outer.nesterov),
    )


def _close(
    stage: Stage,
    inputs: StepInputs,
    base: _Base,
    clock: _StageClock,
    eval_windows: int,
    faults: FaultInjector,
) -> OuterResult:
    clock.lap("load")
    unreadable: dict[str, str] = {}
    left_out: dict[str, str] = {}
    decision = None
    base_loss, measured_base = inputs.base_eval_loss, None
    policy = inputs.cfg.aggregation
    while True:
        kept = [c for c in inputs.contributions if c.id not in unreadable | left_out]
        if unreadable:
            decision = decide_after_exclusions(
                inputs.version,
                kept=len(kept) + len(left_out),
                excluded=unreadable,
                quorum=inputs.quorum,
            )
            if decision.action is not Action.CLOSE:
                codes = dict.fromkeys(unreadable, "blob_unreadable")
                return OuterResult(
                    unreadable, codes, decision, None, None, None, measured_base, {},
                    clock.seconds,
                )  # fmt: skip
        try:
            tried = _try_step(stage, inputs, base, kept, clock)
        except SourceUnreadable as err:
            unreadable[err.source_id] = err.reason
            log.warning("run %s round %d: %s", inputs.run_id, inputs.version, err)
            continue
        faults.hit("close.aggregate")
        faults.hit("close.step")
        result, loss = tried.result, None
        g_norm = math.sqrt(result.g_sq) if result.finite else math.inf
        median = statistics.median(c.norm for c in kept)
        if result.finite and g_norm > policy.suspect_multiple * median:
            log.warning(
                "run %s round %d: the update's norm %.4g is over %g x the median contribution's "
                "(%.4g): evaluating it before publishing",
                inputs.run_id, inputs.version, g_norm, policy.suspect_multiple, median,
            )  # fmt: skip
            if base_loss is None:
                measured_base = base_loss = _evaluate(
                    stage.storage, inputs, base.params.path, eval_windows
                )
            loss = _evaluate(stage.storage, inputs, tried.out.params.temp_path, eval_windows)
            clock.lap("judge")
        verdict = (
            judge_step(base_loss, loss, finite=result.finite, max_loss_ratio=policy.max_loss_ratio)
            if loss is not None or not result.finite
            else StepVerdict(True, "ok", "published; eval loss pending")
        )
        faults.hit("close.eval")
        if not verdict.ok:
            tried.out.abort()
            if len(kept) - 1 < inputs.quorum:
                raise StepRejected(verdict, left_out)
            culprit = max(kept, key=lambda c: tried.shares[c.id].distance)
            left_out[culprit.id] = f"the step with it was discarded ({verdict.reason})"
            log.warning("run %s round %d: %s", inputs.run_id, inputs.version, verdict.reason)
            continue
        break
    params_sha, delta_sha = tried.out.commit()
    stage.publish()  # object storage: the three files go up, durable before any row names them
    files = checkpoints_service.version_files(
        stage.storage,
        run_id=inputs.run_id,
        version=inputs.version,
        sha256=params_sha,
        delta_sha256=delta_sha,
    )
    clock.lap("write")
    faults.hit("close.write")
    excluded = unreadable | left_out
    codes = dict.fromkeys(unreadable, "blob_unreadable") | dict.fromkeys(left_out, "guard")
    return OuterResult(
        excluded,
        codes,
        decision,
        files,
        math.sqrt(tried.result.change_sq),
        loss,
        measured_base,
        tried.shares,
        clock.seconds,
    )


def _try_step(
    stage: Stage, inputs: StepInputs, base: _Base, kept: list[Stored], clock: _StageClock
) -> _Tried:
    """One try of the step with ``kept``: the pass (two for ``centered_clip``), the
    version's files written to temp names, and what each contribution put in. sha256 runs
    on a thread of its own (the uploads' trailers, the parameters file), beside the sums."""
    policy = inputs.cfg.aggregation
    norms = {c.id: c.norm for c in kept}
    total = sum(c.weight for c in kept)
    _, clip = clip_factors(norms, inputs.history, policy)
    coefficients = [c.weight * clip[c.id] / total for c in kept]
    with contextlib.ExitStack() as stack:
        hasher = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="close-sha256"))
        out = _outputs(stage, inputs, base, hasher)
        blobs = stage.inputs((c.blob_key for c in kept), missing_ok=True)  # staged already

        def open_uploads() -> list[UploadFile]:  # read from the start, hashed from the start
            return [
                stack.enter_context(
                    contextlib.closing(
                        UploadFile(c.id, blobs[c.blob_key], base.shapes, base.upload_codec, hasher)
                    )
                )
                for c in kept
            ]

        uploads = open_uploads()
        step = Step(base.hyper, base.params, base.state, base.delta_codec, out)
        block = base.delta_codec.block_size
        try:
            if policy.method != "centered_clip":
                result = run_pass(uploads, coefficients, base.shapes, block_size=block, step=step)
                dots, v_sq, factors = result.dots, result.g_sq, clip
            else:  # the clipped mean v first, then v + Σ wᵢsᵢ(Δᵢ − v)/W
                first = run_pass(uploads, coefficients, base.shapes, block_size=block, keep=True)
                dots, v_sq = first.dots, first.g_sq
                factors = centre_pulls(distances(norms, dots, v_sq))
                pulls = [c.weight * factors[c.id] / total for c in kept]
                centre = (first.kept, 1.0 - sum(pulls))
                result = run_pass(
                    open_uploads(), pulls, base.shapes, block_size=block, center=centre, step=step
                )
            out.params.settle()  # before its hashing thread goes
        except BaseException:
            out.abort()
            raise
    clock.lap("pass")
    for part, spent in result.seconds.items():  # where the pass's time went
        clock.seconds[f"pass_{part}"] = clock.seconds.get(f"pass_{part}", 0.0) + spent
    dist = distances(norms, dots, v_sq)
    v_norm = math.sqrt(v_sq)
    shares = {
        c.id: Share(c.weight, c.norm, factors[c.id], cosine(c.norm, dots[c.id], v_norm), dist[c.id])
        for c in kept
    }
    return _Tried(out, result, shares)


def _outputs(stage: Stage, inputs: StepInputs, base: _Base, hasher: ThreadPoolExecutor) -> Outputs:
    keys = checkpoints_service.version_keys(inputs.run_id, inputs.version)
    names = list(base.shapes)
    meta = {"run_id": inputs.run_id}
    writers: list[TensorFileWriter] = []
    try:
        writers.append(
            TensorFileWriter(
                stage.output(keys.params),
                params_entries(base.shapes),
                params_metadata(version=inputs.version, names=names, metadata=meta),
                hasher=hasher,
            )
        )
        hparams = {
            "lr": base.hyper.lr,
            "momentum": base.hyper.momentum,
            "nesterov": base.hyper.nesterov,
        }
        writers.append(
            TensorFileWriter(
                stage.output(keys.state),
                state_entries(base.shapes),
                state_metadata(version=inputs.version, names=names, hparams=hparams, metadata=meta),
                digest=False,
            )
        )
        writers.append(
            TensorFileWriter(
                stage.output(keys.delta),
                deltas.entries(base.shapes, base.delta_codec),
                deltas.metadata(
                    run_id=inputs.run_id,
                    version=inputs.version,
                    base_version=inputs.version - 1,
                    names=names,
                    codec=base.delta_codec,
                ),
            )
        )
    except BaseException:
        for w in writers:
            w.abort()
        raise
    return Outputs(*writers)


def _evaluate(storage: Storage, inputs: StepInputs, params_path: Path, windows: int) -> float:
    return evals.evaluate_file(
        storage, run_id=inputs.run_id, cfg=inputs.cfg, params_path=params_path, windows=windows
    )


class _StageClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now
