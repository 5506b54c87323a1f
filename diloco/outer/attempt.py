"""One try of a round's step (``diloco.outer.close``): the inputs a close reads, the base
version opened once for every try, and the pass (two for ``centered_clip``) that sums the
kept uploads, steps and writes the version's files to temp names, measuring on the way
what the checks read (``diloco.outer.checks``)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco.checkpoint import (
    OuterStateFile,
    open_outer_state,
    params_entries,
    params_metadata,
    state_entries,
    state_metadata,
)
from diloco.config import RunConfig
from diloco.outer.checks import RecentChange, RoundFigures, Sampler, Sampling
from diloco.outer.chunked import Hyper, Outputs, PassResult, Step, UploadFile, run_pass
from diloco.outer.exact import Terms
from diloco.outer.robust import (
    Share,
    centre_pulls,
    clip_factors,
    cosine,
    distances,
    reference_norm,
)
from diloco.outer.scoring import Score, Windows
from diloco.wire import delta as deltas
from diloco.wire.exchange import codec_for, delta_codec_for
from diloco.wire.tensorfile import TensorFileReader, TensorFileWriter


@dataclass(frozen=True)
class Upload:
    """A contribution of the round as the close reads it."""

    id: str
    path: Path  # its stored body (``diloco.wire.contribution``); may be missing or damaged
    weight: float  # the tokens it counts for
    norm: float  # ‖Δ‖, measured when it was accepted
    # the first windows of its lease's data, as its volunteer read them, for the scoring
    # (diloco.outer.scoring); None: not scored (late work, whose base is an older version)
    own: Windows | None = None
    # its score, when it was taken before the close (on arrival, by the server); the close
    # then uses it instead of scoring it again
    score: Score | None = None


@dataclass(frozen=True)
class VersionPaths:
    """Where a version's three files are (or go)."""

    params: Path
    state: Path
    delta: Path


@dataclass(frozen=True)
class CloseInputs:
    run_id: str
    version: int  # the version this close publishes (= the round's index)
    cfg: RunConfig
    base_params: Path  # the base version's parameters
    base_state: Path  # its outer state (momentum, residual)
    uploads: list[Upload]  # in the order they were accepted: the sums' order
    history: list[float]  # norms of the run's latest aggregated contributions
    quorum: int
    out: VersionPaths  # where the new version is written (temp names until committed)
    # the checks' (diloco.outer.checks): the round's secret seed, where its samples are
    # taken, and the last published changes, sampled, to compare the uploads with
    check_seed: int = 0
    recent: list[RecentChange] = field(default_factory=list)
    # the windows every scored upload is also measured on (the validation data's first
    # score_windows); None: no upload is scored
    score_sample: Windows | None = None


@dataclass
class Base:
    """The base version, open for reading, and what every try of the step shares."""

    params: TensorFileReader
    state: OuterStateFile
    shapes: dict[str, tuple[int, ...]]
    upload_codec: dict
    delta_codec: deltas.DeltaCodec
    hyper: Hyper

    def align(self) -> int:
        """The pass's chunks start at multiples of this: whole blocks of int8 uploads and
        whole pieces of the delta (``diloco.wire.delta.alignment``)."""
        int8 = self.upload_codec["kind"] == "int8"
        uploads = self.upload_codec["block_size"] if int8 else 1
        return math.lcm(deltas.alignment(self.delta_codec), uploads)

    def close(self) -> None:
        self.params.close()
        self.state.reader.close()


@dataclass
class Tried:
    out: Outputs
    result: PassResult
    shares: dict[str, Share]
    figures: RoundFigures  # what the checks read
    change_sample: torch.Tensor


def open_base(inputs: CloseInputs) -> Base:
    cfg = inputs.cfg
    params = TensorFileReader(inputs.base_params)
    try:
        state = open_outer_state(inputs.base_state)
    except BaseException:
        params.close()
        raise
    names = json.loads(params.metadata["param_names"])
    return Base(
        params,
        state,
        {n: params.entries[n].shape for n in names},
        codec_for(cfg.compression).describe(),
        delta_codec_for(cfg.compression),
        Hyper(
            cfg.outer.lr_at(inputs.version, cfg.rounds.max_rounds),
            cfg.outer.momentum,
            cfg.outer.nesterov,
        ),
    )


def try_step(inputs: CloseInputs, base: Base, kept: list[Upload], clock: StageClock) -> Tried:
    """One try of the step with ``kept``: the pass (two for ``centered_clip``), the
    version's files written to temp names, and what each contribution put in. sha256 runs
    on a thread of its own (the uploads' trailers, the parameters file), beside the sums."""
    policy = inputs.cfg.aggregation
    norms = {u.id: u.norm for u in kept}
    total = math.fsum(u.weight for u in kept)  # exact: the same in any order
    _, clip = clip_factors(norms, inputs.history, policy)
    terms = Terms.of([u.weight * clip[u.id] for u in kept], list(norms.values()), total)
    coefficients = [u.weight * clip[u.id] / total for u in kept]
    n_params = sum(math.prod(shape) for shape in base.shapes.values())
    sampler = Sampler(
        base.shapes,
        [
            Sampling.for_round(n_params, s)
            for s in [inputs.check_seed, *(r.seed for r in inputs.recent)]
        ],
    )
    with contextlib.ExitStack() as stack:
        hasher = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="close-sha256"))
        out = outputs(inputs, base, hasher)

        def open_uploads() -> list[UploadFile]:  # read from the start, hashed from the start
            return [
                stack.enter_context(
                    contextlib.closing(
                        UploadFile(u.id, u.path, base.shapes, base.upload_codec, hasher)
                    )
                )
                for u in kept
            ]

        step = Step(base.hyper, base.params, base.state, base.delta_codec, out, sampler)
        align = base.align()
        try:
            uploads = open_uploads()
            if policy.method != "centered_clip":
                result = run_pass(
                    uploads, terms, base.shapes, align=align, step=step, sampler=sampler
                )
                dots, v_sq, factors = result.dots, result.g_sq, clip
            else:  # the clipped mean v first, then v + Σ wᵢsᵢ(Δᵢ − v)/W
                first = run_pass(
                    uploads, terms, base.shapes, align=align, keep=True, sampler=sampler
                )
                dots, v_sq = first.dots, first.g_sq
                factors = centre_pulls(distances(norms, dots, v_sq))
                pulls = [u.weight * factors[u.id] for u in kept]
                centre = (first.kept, 1.0 - math.fsum(pulls) / total)
                pulled = Terms.of(pulls, list(norms.values()), total)
                result = run_pass(
                    open_uploads(), pulled, base.shapes, align=align, center=centre, step=step
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
        u.id: Share(u.weight, u.norm, factors[u.id], cosine(u.norm, dots[u.id], v_norm), dist[u.id])
        for u in kept
    }
    figures = RoundFigures(
        ids=[u.id for u in kept],
        norms=norms,
        coefficients={u.id: c for u, c in zip(kept, coefficients, strict=True)},
        dots=dots,
        g_sq=v_sq,
        samples=sampler.uploads(),
        recent=list(inputs.recent),
        reference=reference_norm(list(norms.values()), inputs.history, policy),
    )
    return Tried(out, result, shares, figures, sampler.changes())


def outputs(inputs: CloseInputs, base: Base, hasher: ThreadPoolExecutor) -> Outputs:
    names = list(base.shapes)
    meta = {"run_id": inputs.run_id}
    hp = base.hyper
    hparams = {"lr": hp.lr, "momentum": hp.momentum, "nesterov": hp.nesterov}
    delta_meta = deltas.metadata(
        run_id=inputs.run_id,
        version=inputs.version,
        base_version=inputs.version - 1,
        names=names,
        codec=base.delta_codec,
    )
    writers: list[TensorFileWriter] = []
    try:
        writers.append(
            TensorFileWriter(
                inputs.out.params,
                params_entries(base.shapes),
                params_metadata(version=inputs.version, names=names, metadata=meta),
                hasher=hasher,
            )
        )
        writers.append(
            TensorFileWriter(
                inputs.out.state,
                state_entries(base.shapes),
                state_metadata(version=inputs.version, names=names, hparams=hparams, metadata=meta),
                digest=False,
            )
        )
        writers.append(
            TensorFileWriter(
                inputs.out.delta, deltas.entries(base.shapes, base.delta_codec), delta_meta
            )
        )
    except BaseException:
        for w in writers:
            w.abort()
        raise
    return Outputs(*writers)


class StageClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now
